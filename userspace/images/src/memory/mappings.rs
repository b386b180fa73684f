//! Which of a process's memory can be read at once, without waiting on anyone.
//!
//! A read faults in the pages it touches. Anonymous memory and files on local file
//! systems come in from RAM, swap or a local disk; a file on FUSE or a network file
//! system comes in only when its daemon or server answers. So before each read, the
//! kernel is asked which mapping holds each byte of it (`PROCMAP_QUERY` on the
//! process's `/proc/PID/maps`, Linux 6.11+: the mapping as it is now, not a cached
//! copy a process could have remapped since), and the mapping's file system is looked
//! up in the process's mount table. A read all in anonymous memory or files of file
//! systems that cannot stall ([`crate::procfs`]'s list) is made on the caller's thread;
//! any other (a stalling or unknown file system, a kernel without the query) goes to
//! the deadline reader ([`super::deadline`]).
//!
//! What is left: the process can remap the range between the query and the read (a
//! window of microseconds, which it must hit while we read); docs/design.md, "Reading
//! other processes' memory", says what that costs and what would close it.

use std::{
    collections::HashMap,
    fs::File,
    io,
    sync::Mutex,
    time::{Duration, Instant},
};

use crate::procfs::{
    procmap::{self, ProcmapQuery},
    MountTable,
};

/// Processes whose views are kept (their maps file open, their devices known); the
/// least recently used goes past it.
pub const MAX_VIEWS: usize = 512;

/// A process's mount table is read again at most this often (a device it maps that
/// no table listed may have been mounted since).
const MOUNTS_REFRESH: Duration = Duration::from_secs(1);

/// Mappings one read may span before it goes to the deadline reader anyway.
const MAX_SPANNED: usize = 16;

/// How a read of a range may be made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Every byte is in memory that cannot stall: read on the caller's thread.
    Direct,
    /// Some byte may stall, or nothing could be told: read on the deadline reader.
    Deadline,
    /// Some byte is in no mapping: the read would fail.
    Unmapped,
    /// The process is not the image its view was opened on (it exec'd, or exited and
    /// its pid may be another's): refused until [`forget`].
    Changed,
}

/// What is known of one process.
struct View {
    /// Its `/proc/PID/maps`, open: queried, and bound to that process (a reused pid
    /// gets `ESRCH` from it, not the new process's mappings).
    maps: File,
    /// Devices of its mount table (and ours): whether each may stall.
    devices: HashMap<u64, bool>,
    /// When the tables were read.
    mounts_read: Instant,
    /// Last use, on [`Views::clock`].
    used: u64,
    /// Its image is gone (the maps descriptor answers `ESRCH`): reads are refused.
    changed: bool,
}

/// Every view, and whether this kernel answers the query.
#[derive(Default)]
struct Views {
    by_pid: HashMap<u32, View>,
    clock: u64,
    unsupported: bool,
}

static VIEWS: Mutex<Option<Views>> = Mutex::new(None);

/// Whether `len` bytes at `address` in `pid` can be read at once.
pub fn verdict(pid: u32, address: u64, len: usize) -> Verdict {
    let Some(end) = address.checked_add(len as u64) else {
        return Verdict::Unmapped;
    };
    let mut views = VIEWS.lock().unwrap_or_else(|p| p.into_inner());
    let views = views.get_or_insert_with(Views::default);
    if views.unsupported {
        return Verdict::Deadline;
    }
    if !views.open(pid) {
        return Verdict::Deadline;
    }
    let view = views.by_pid.get_mut(&pid).expect("opened above");
    if view.changed {
        return Verdict::Changed;
    }
    let mut at = address;
    for _ in 0..MAX_SPANNED {
        let mapping = match view.query(at) {
            Ok(mapping) => mapping,
            Err(error) if error.raw_os_error() == Some(libc::ENOENT) => return Verdict::Unmapped,
            Err(error) if matches!(error.raw_os_error(), Some(libc::ENOTTY | libc::EINVAL)) => {
                tracing::warn!(
                    "this kernel cannot say which mapping holds an address (PROCMAP_QUERY: \
                     {error}): every read of another process's memory goes through the \
                     deadline reader"
                );
                views.unsupported = true;
                return Verdict::Deadline;
            }
            Err(_) => {
                // Its image is gone (exec, exit): what its readers know is of that
                // image, so nothing is read until they forget it (`forget`).
                view.changed = true;
                return Verdict::Changed;
            }
        };
        if !view.cannot_stall(pid, &mapping) {
            return Verdict::Deadline;
        }
        if mapping.vma_end >= end {
            return Verdict::Direct;
        }
        at = mapping.vma_end;
    }
    Verdict::Deadline
}

/// Binds `pid`'s reads to the image it runs now: the view is opened (if none is) on
/// its maps, whose descriptor keeps that image; once the process execs or exits, reads
/// are refused ([`Verdict::Changed`]) until [`forget`]. A runtime's reader is made
/// when it looks at the process, so its reads belong to the image it looked at.
pub fn bind(pid: u32) {
    let mut views = VIEWS.lock().unwrap_or_else(|p| p.into_inner());
    let views = views.get_or_insert_with(Views::default);
    // A reader made now is made for the image now (one whose exec went unseen too).
    if views.by_pid.get(&pid).is_some_and(|view| view.changed) {
        views.by_pid.remove(&pid);
    }
    views.open(pid);
}

/// Forgets `pid`'s view (the engine saw it exec, exit or be reused): its next reader
/// binds to the image it runs then.
pub fn forget(pid: u32) {
    let mut views = VIEWS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(views) = views.as_mut() {
        views.by_pid.remove(&pid);
    }
}

impl Views {
    /// Opens `pid`'s view unless it has one (the least recently used goes past
    /// [`MAX_VIEWS`]); marks it used. False if it cannot be opened.
    fn open(&mut self, pid: u32) -> bool {
        self.clock += 1;
        if !self.by_pid.contains_key(&pid) {
            let Some(view) = View::open(pid) else {
                return false;
            };
            if self.by_pid.len() >= MAX_VIEWS {
                let oldest = (self.by_pid.iter()).min_by_key(|(_, v)| v.used);
                let oldest = oldest.map(|(&p, _)| p).expect("a full table");
                self.by_pid.remove(&oldest);
            }
            self.by_pid.insert(pid, view);
        }
        let clock = self.clock;
        self.by_pid.get_mut(&pid).expect("inserted above").used = clock;
        true
    }
}

/// The device of the kernel's internal tmpfs (memfds, shared anonymous memory), which
/// no mount table lists: that of a memfd of our own.
fn kernel_tmpfs_device() -> Option<u64> {
    static DEVICE: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *DEVICE.get_or_init(|| {
        // SAFETY: memfd_create with a NUL-terminated name; the descriptor is owned below.
        let fd = unsafe { libc::memfd_create(c"allocbpf-device".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return None;
        }
        // SAFETY: `fd` is ours, open, and closed when `file` drops.
        let file = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        let dev = std::os::unix::fs::MetadataExt::dev(&file.metadata().ok()?);
        Some((u64::from(libc::major(dev)) << 32) | u64::from(libc::minor(dev)))
    })
}

/// The device and file-system verdicts of `pid`'s mount table and ours.
fn read_devices(pid: u32) -> HashMap<u64, bool> {
    let mut devices = HashMap::new();
    for at in [
        format!("/proc/{pid}/mountinfo"),
        "/proc/self/mountinfo".to_string(),
    ] {
        if let Ok(table) = MountTable::read(&at) {
            for (device, stalls) in table.stalling_by_device() {
                *devices.entry(device).or_insert(false) |= stalls;
            }
        }
    }
    devices
}

impl View {
    fn open(pid: u32) -> Option<View> {
        Some(View {
            maps: File::open(format!("/proc/{pid}/maps")).ok()?,
            devices: read_devices(pid),
            mounts_read: Instant::now(),
            used: 0,
            changed: false,
        })
    }

    /// The mapping that holds `address` now.
    fn query(&self, address: u64) -> io::Result<ProcmapQuery> {
        procmap::query(&self.maps, address, 0)
    }

    /// True if reading `mapping` cannot wait on a daemon or a server: anonymous memory,
    /// or a file of a file system known not to stall.
    fn cannot_stall(&mut self, pid: u32, mapping: &ProcmapQuery) -> bool {
        if mapping.inode == 0 && mapping.dev_major == 0 && mapping.dev_minor == 0 {
            return true;
        }
        let device = mapping.device();
        if Some(device) == kernel_tmpfs_device() {
            return true;
        }
        if let Some(&stalls) = self.devices.get(&device) {
            return !stalls;
        }
        if self.mounts_read.elapsed() >= MOUNTS_REFRESH {
            self.devices = read_devices(pid);
            self.mounts_read = Instant::now();
        }
        self.devices.get(&device) == Some(&false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_heap_and_our_executable_are_read_at_once_and_nothing_is_unmapped() {
        let pid = std::process::id();
        let boxed = Box::new([0u8; 64]);
        assert_eq!(verdict(pid, boxed.as_ptr() as u64, 64), Verdict::Direct);
        let code = verdict as fn(u32, u64, usize) -> Verdict as usize as u64;
        assert_eq!(
            verdict(pid, code, 16),
            Verdict::Direct,
            "a file on a local disk"
        );
        assert_eq!(verdict(pid, 8, 8), Verdict::Unmapped);
        assert_eq!(verdict(pid, u64::MAX - 4, 8), Verdict::Unmapped);
    }

    #[test]
    fn reads_of_a_process_that_execs_are_refused_until_it_is_forgotten_or_bound_anew() {
        // A shell that execs `sleep` when told (a line on its stdin).
        let mut child = std::process::Command::new("/bin/sh")
            .args(["-c", "read line; exec sleep 30"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        bind(pid);
        let stack = |pid: u32| {
            let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
            let line = maps
                .lines()
                .find(|l| l.ends_with("[stack]"))
                .unwrap()
                .to_string();
            u64::from_str_radix(line.split('-').next().unwrap(), 16).unwrap()
        };
        assert_eq!(verdict(pid, stack(pid), 8), Verdict::Direct);
        use std::io::Write;
        child.stdin.take().unwrap().write_all(b"go\n").unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !std::fs::read_link(format!("/proc/{pid}/exe"))
            .unwrap()
            .ends_with("sleep")
        {
            assert!(Instant::now() < deadline, "no exec");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(
            verdict(pid, stack(pid), 8),
            Verdict::Changed,
            "the image it was bound to"
        );
        forget(pid);
        assert_eq!(
            verdict(pid, stack(pid), 8),
            Verdict::Direct,
            "bound to the new image"
        );
        // A reader made after the exec (a runtime's new look) binds to the new image.
        let _ = verdict(pid, 8, 8);
        bind(pid);
        assert_eq!(verdict(pid, stack(pid), 8), Verdict::Direct);
        let _ = child.kill();
        let _ = child.wait();
    }

    #[test]
    fn a_memfd_of_ours_is_read_at_once() {
        // SAFETY: as in `kernel_tmpfs_device`.
        let fd = unsafe { libc::memfd_create(c"allocbpf-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: `fd` is ours; the mapping is unmapped below.
        let mapped = unsafe {
            libc::ftruncate(fd, 4096);
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        assert_ne!(mapped, libc::MAP_FAILED);
        let verdict = verdict(std::process::id(), mapped as u64, 8);
        // SAFETY: our own mapping and descriptor.
        unsafe {
            libc::munmap(mapped, 4096);
            libc::close(fd);
        }
        assert_eq!(verdict, Verdict::Direct);
    }
}
