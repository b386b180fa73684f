//! The process being profiled (`--pid`) and the allocator images it allocates through.
//!
//! The images are found in the target's own `/proc/PID/maps` and opened through
//! `/proc/PID/root`, so a process in a container (its own mount namespace and libc) is
//! probed in the libc it really uses. Nothing is hard-coded about its path.

use std::{fs, path::Path};

use crate::{discover::ImageCache, image::AllocatorImage, procfs::parse_maps};

/// Errors about the target process or its libc.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    /// No such process.
    #[error("no process with pid {0} (check the pid; it may have exited)")]
    NoSuchProcess(u32),
    /// The process's memory map cannot be read.
    #[error("cannot read the memory map of pid {pid}")]
    Maps {
        /// The target pid.
        pid: u32,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A kernel thread: no user memory at all.
    #[error("pid {pid} ({comm}) is a kernel thread: it has no user-space heap to profile")]
    KernelThread {
        /// The target pid.
        pid: u32,
        /// Its command name.
        comm: String,
    },
    /// No dynamically linked libc in the process.
    #[error(
        "pid {pid} ({comm}) has no dynamically linked libc in its memory map and no file it \
         maps defines malloc: it is statically linked without symbols or uses its own \
         allocator (try --allocator-symbol PREFIX, e.g. je_)"
    )]
    NoLibc {
        /// The target pid.
        pid: u32,
        /// Its command name.
        comm: String,
    },
}

/// A process to profile.
#[derive(Clone, Debug)]
pub struct Target {
    /// Its pid (tgid).
    pub pid: u32,
    /// Its command name.
    pub comm: String,
    /// The allocator images it allocates through: its libc, and its executable or
    /// other files when they define the (prefixed) allocation functions.
    pub images: Vec<AllocatorImage>,
}

/// Reads `/proc/PID/comm`.
pub fn comm_of(pid: u32) -> Option<String> {
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|s| s.trim_end().to_string())
}

impl Target {
    /// Resolves a pid to a target: checks the process exists, finds its libc and the
    /// allocation functions in it.
    pub fn resolve(pid: u32, prefixes: &[String]) -> Result<Target, TargetError> {
        if pid == 0 || !Path::new(&format!("/proc/{pid}")).exists() {
            return Err(TargetError::NoSuchProcess(pid));
        }
        let comm = comm_of(pid).ok_or(TargetError::NoSuchProcess(pid))?;
        let maps = fs::read_to_string(format!("/proc/{pid}/maps")).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                TargetError::NoSuchProcess(pid)
            } else {
                TargetError::Maps { pid, source }
            }
        })?;
        if maps.trim().is_empty() {
            return Err(TargetError::KernelThread { pid, comm });
        }
        let images = ImageCache::default().discover(pid, &parse_maps(&maps), prefixes);
        if images.is_empty() {
            return Err(TargetError::NoLibc { pid, comm });
        }
        Ok(Target { pid, comm, images })
    }
}
