//! One process to profile, and the allocator images it allocates through.
//!
//! The images are found in the target's own `/proc/PID/maps` and opened through
//! `/proc/PID/map_files`, so a process in a container (its own mount namespace and libc) is
//! probed in the libc it really uses. Nothing is hard-coded about its path.

use std::ffi::OsString;

use crate::discover::{ImageCache, Silence};
use crate::image::AllocatorImage;
use crate::image::Lookup;
use crate::procfs;

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
        /// Its command name (made text lossily).
        comm: String,
    },
    /// No mapped file defines an allocation entry of the catalogue.
    #[error(
        "pid {pid} ({comm}) allocates through no function allocbpf can probe: no file it maps \
         defines malloc, operator new or another known allocation entry (it may be a Go or \
         other runtime with its own heap, or statically linked without symbols; for a \
         prefixed custom allocator try --allocator-symbol PREFIX, e.g. my_)"
    )]
    NoAllocator {
        /// The target pid.
        pid: u32,
        /// Its command name (made text lossily).
        comm: String,
    },
}

/// A process to profile.
#[derive(Clone, Debug)]
pub struct Target {
    /// Its pid (tgid).
    pub pid: u32,
    /// Its command name (bytes, not necessarily UTF-8).
    pub comm: OsString,
    /// The allocator images it may allocate through: every file it maps that defines
    /// allocation entries (libc, jemalloc, its own executable...); none for a Go program
    /// without cgo (its heap profile is read instead).
    pub images: Vec<AllocatorImage>,
    /// What to say if it makes no probed call while profiled.
    pub silence: Silence,
    /// The facts found examining the files it maps (allocator or not): kept, so that
    /// a later look at its maps examines only the files it mapped since (dlopen).
    pub cache: ImageCache,
}

/// Reads `/proc/PID/comm` ([`procfs::comm`]: bytes, not necessarily UTF-8).
pub fn comm_of(pid: u32) -> Option<OsString> {
    procfs::comm(pid)
}

impl Target {
    /// Resolves a pid to a target: checks the process exists and finds the files it
    /// maps that define allocation entries.
    pub fn resolve(pid: u32, lookup: &Lookup) -> Result<Target, TargetError> {
        if pid == 0 || !procfs::is_alive(pid) {
            return Err(TargetError::NoSuchProcess(pid));
        }
        let comm = comm_of(pid).ok_or(TargetError::NoSuchProcess(pid))?;
        let maps = procfs::try_read_maps(pid).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                TargetError::NoSuchProcess(pid)
            } else {
                TargetError::Maps { pid, source }
            }
        })?;
        let text = |comm: &OsString| comm.to_string_lossy().into_owned();
        if maps.is_empty() {
            return Err(TargetError::KernelThread {
                pid,
                comm: text(&comm),
            });
        }
        let mut cache = ImageCache::default();
        let images = cache.discover(pid, &maps, lookup);
        // A Go program's heap is read from its runtime's own profile: it needs no probe.
        if images.is_empty() && cache.go_mappings(&maps).is_empty() {
            return Err(TargetError::NoAllocator {
                pid,
                comm: text(&comm),
            });
        }
        Ok(Target {
            pid,
            comm,
            images,
            silence: cache.silence(&maps),
            cache,
        })
    }
}
