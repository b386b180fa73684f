//! One process to profile, and the allocator images it allocates through.
//!
//! The images are found in the target's own `/proc/PID/maps` and opened through
//! `/proc/PID/map_files`, so a process in a container (its own mount namespace and libc) is
//! probed in the libc it really uses. Nothing is hard-coded about its path.

use std::ffi::OsString;
use std::time::{Duration, Instant};

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
    /// The process has stayed in its dynamic loader, no library mapped, for
    /// [`LOADER_WAIT`]: stopped or traced at its start (or it needs no library).
    #[error(
        "pid {pid} ({comm}) has mapped no library yet: it has stayed in its dynamic loader \
         (stopped or traced at its start, or a program that needs no library); profile it \
         once it runs"
    )]
    StillLoading {
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

/// How long [`Target::resolve`] waits for a process still in its dynamic loader to map
/// its libraries: far longer than a loader takes, short enough not to hang on a
/// process stopped there.
pub const LOADER_WAIT: Duration = Duration::from_secs(2);
/// How often its map is read again meanwhile.
const LOADER_POLL: Duration = Duration::from_millis(5);

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
        let mut images = cache.discover(pid, &maps, lookup);
        let mut maps = maps;
        // Looked at in its first moment, the process may not have mapped its libraries
        // yet: wait for its loader (boundedly: a stopped or traced process may stay
        // there). A Go program's heap is read from its runtime's own profile: it needs
        // no probe, and may need no library (an interpreter and nothing else mapped).
        let waited_since = Instant::now();
        while images.is_empty() && cache.go_mappings(&maps).is_empty() {
            if !procfs::in_dynamic_loader(pid, &maps) {
                return Err(TargetError::NoAllocator {
                    pid,
                    comm: text(&comm),
                });
            }
            if waited_since.elapsed() >= LOADER_WAIT {
                return Err(TargetError::StillLoading {
                    pid,
                    comm: text(&comm),
                });
            }
            std::thread::sleep(LOADER_POLL);
            maps = procfs::try_read_maps(pid).map_err(|_| TargetError::NoSuchProcess(pid))?;
            images = cache.discover(pid, &maps, lookup);
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

#[cfg(test)]
mod tests {
    use std::os::unix::process::CommandExt;
    use std::process::Command;

    use super::*;

    /// A child traced from its start stops at its exec, before its loader runs: the
    /// kernel has mapped the executable and `ld.so`, nothing else.
    fn stopped_at_exec(program: &str) -> std::process::Child {
        let mut command = Command::new(program);
        command.arg("30");
        // SAFETY: PTRACE_TRACEME touches no memory of ours; it is async-signal-safe.
        unsafe {
            command.pre_exec(|| {
                if libc::ptrace(libc::PTRACE_TRACEME, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().unwrap();
        let mut status = 0;
        // SAFETY: waits for our own child.
        let waited = unsafe { libc::waitpid(child.id() as i32, &mut status, 0) };
        assert_eq!(waited, child.id() as i32);
        assert!(libc::WIFSTOPPED(status), "status {status:#x}");
        child
    }

    fn detach(pid: u32) {
        // SAFETY: detaches our own stopped tracee and lets it run on.
        let detached = unsafe { libc::ptrace(libc::PTRACE_DETACH, pid as i32, 0, 0) };
        assert_eq!(detached, 0, "{}", std::io::Error::last_os_error());
    }

    #[test]
    fn a_process_still_in_its_loader_is_waited_for() {
        let mut child = stopped_at_exec("sleep");
        let pid = child.id();
        let maps = procfs::try_read_maps(pid).unwrap();
        assert!(procfs::in_dynamic_loader(pid, &maps), "{maps:#?}");
        // The tracer is the thread that spawned the child: it releases, another resolves.
        let resolver = std::thread::spawn(move || Target::resolve(pid, &Lookup::default()));
        std::thread::sleep(Duration::from_millis(100));
        detach(pid);
        let target = resolver.join().unwrap();
        let _ = child.kill();
        let _ = child.wait();
        let target = target.unwrap();
        assert!(!target.images.is_empty());
    }

    #[test]
    fn a_process_held_in_its_loader_is_not_waited_for_without_end() {
        let mut child = stopped_at_exec("sleep");
        let pid = child.id();
        let started = Instant::now();
        let target = Target::resolve(pid, &Lookup::default());
        let waited = started.elapsed();
        detach(pid);
        let _ = child.kill();
        let _ = child.wait();
        assert!(matches!(target, Err(TargetError::StillLoading { .. })));
        assert!(
            waited >= LOADER_WAIT && waited < LOADER_WAIT * 3,
            "{waited:?}"
        );
    }
}
