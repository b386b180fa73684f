//! A process's memory map (`/proc/PID/maps`) and its mapped files, as the process
//! sees them.
//!
//! One parser for the maps, and one way to open a mapped file: through
//! `/proc/PID/map_files/START-END`, which the kernel resolves to the very file mapped
//! (even if deleted, replaced, or in another mount namespace), never through the path
//! the maps print. That path belongs to another, possibly hostile, user: it may now
//! be a FIFO (an `open` that never returns), a symlink to `/dev/zero` (a read without
//! end) or to a host file (an absolute symlink resolves against our root). A mapping
//! is never a FIFO or a device, and map_files follows no path the process controls.
//! The file opened is still checked: a regular file with the mapping's device and
//! inode, read with a size cap ([`MAX_MAPPED_FILE_BYTES`]).
//!
//! Files on FUSE file systems are not opened at all: every open and read of such a file
//! is a request answered by a user-space daemon, which any user may run (fusermount is
//! setuid) and which may never answer. The file system is found in the process's own
//! `/proc/PID/mountinfo` by the mapping's device, without touching the file.

use std::{
    fs::{File, OpenOptions},
    io::{self, Read},
    ops::Range,
    os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt},
    path::{Path, PathBuf},
};

/// One line of `/proc/PID/maps`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapsEntry {
    /// Address range.
    pub range: Range<u64>,
    /// Executable (`x` in the permissions).
    pub executable: bool,
    /// File offset of the range's start.
    pub offset: u64,
    /// Device of the mapped file (major << 32 | minor); 0 for anonymous mappings.
    pub device: u64,
    /// Inode of the mapped file; 0 for anonymous mappings.
    pub inode: u64,
    /// The path field as printed (may end in " (deleted)"; `[heap]` etc. for anonymous
    /// mappings; empty when there is none).
    pub name: String,
}

impl MapsEntry {
    /// `/proc/PID/map_files/START-END`: the kernel's link to the very file mapped here
    /// (blazesym names mappings the same way).
    pub fn map_files_path(&self, pid: u32) -> String {
        format!(
            "/proc/{pid}/map_files/{:x}-{:x}",
            self.range.start, self.range.end
        )
    }

    /// The mapped file's path, if the mapping is file-backed (" (deleted)" removed).
    pub fn file_path(&self) -> Option<&Path> {
        self.name
            .starts_with('/')
            .then(|| Path::new(self.name.trim_end_matches(" (deleted)")))
    }
}

/// Parses the text of `/proc/PID/maps`; malformed lines are skipped.
pub fn parse_maps(text: &str) -> Vec<MapsEntry> {
    text.lines()
        .filter_map(|line| {
            // range perms offset dev inode [name, which may contain spaces]
            let mut fields = line.splitn(6, char::is_whitespace);
            let (start, end) = fields.next()?.split_once('-')?;
            let perms = fields.next()?;
            let offset = u64::from_str_radix(fields.next()?, 16).ok()?;
            let (major, minor) = fields.next()?.split_once(':')?;
            let device =
                u64::from_str_radix(major, 16).ok()? << 32 | u64::from_str_radix(minor, 16).ok()?;
            let inode = fields.next()?.parse().ok()?;
            Some(MapsEntry {
                range: u64::from_str_radix(start, 16).ok()?..u64::from_str_radix(end, 16).ok()?,
                executable: perms.contains('x'),
                offset,
                device,
                inode,
                name: fields.next().unwrap_or("").trim().to_string(),
            })
        })
        .collect()
}

/// Whether process `pid` exists now (`/proc/PID`).
pub fn is_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// `pid`'s number of threads (`/proc/PID/stat` field 20), `None` if it is gone. The
/// command name in that line is the process's own choice and may hold spaces and
/// parentheses: the fields are counted after the last `)`.
pub fn thread_count(pid: u32) -> Option<u32> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_thread_count(&text)
}

/// The thread count of a `/proc/PID/stat` line.
fn parse_thread_count(stat: &str) -> Option<u32> {
    let (_, fields) = stat.rsplit_once(')')?;
    // After the name: state (field 3) first, so num_threads (field 20) is the 18th.
    fields.split_ascii_whitespace().nth(17)?.parse().ok()
}

/// `pid`'s memory map; empty if it cannot be read (the process exited).
pub fn read_maps(pid: u32) -> Vec<MapsEntry> {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .map(|text| parse_maps(&text))
        .unwrap_or_default()
}

/// Mapped files larger than this are not read. Allocators and programs' code are far
/// smaller (Debian's libc.so.6 is 1.9 MB, redis-server 1.9 MB, a Rust binary with debug
/// info a few hundred MB at most); a process must not make the agent read gigabytes by
/// mapping a huge sparse file. Files are read rather than mapped: the owner of a mapped
/// file could truncate it under our mapping and kill the agent with `SIGBUS`.
pub const MAX_MAPPED_FILE_BYTES: u64 = 512 << 20;

/// Why a mapped file was not opened or read.
#[derive(Debug, thiserror::Error)]
pub enum MappedFileError {
    /// The process or the mapping is gone, or map_files refused.
    #[error("cannot open {path}: {source}")]
    Open {
        /// The map_files path.
        path: String,
        /// The errno.
        source: io::Error,
    },
    /// Not a regular file.
    #[error("{path} is not a regular file")]
    NotRegular {
        /// The map_files path.
        path: String,
    },
    /// Not the file the maps name (device or inode differ).
    #[error("{path} is device {device:#x} inode {inode}, not the mapping's")]
    NotTheMapping {
        /// The map_files path.
        path: String,
        /// Its device (major << 32 | minor).
        device: u64,
        /// Its inode.
        inode: u64,
    },
    /// Over [`MAX_MAPPED_FILE_BYTES`].
    #[error("{path} has {size} bytes, over the {MAX_MAPPED_FILE_BYTES}-byte cap")]
    TooLarge {
        /// The map_files path.
        path: String,
        /// Its size.
        size: u64,
    },
    /// On a file system whose reads a user-space daemon answers.
    #[error("{path} is on a {fstype} file system, whose daemon could stall any read: not opened")]
    Unbounded {
        /// The map_files path.
        path: String,
        /// The file system type (`fuse.sshfs`...).
        fstype: String,
    },
    /// Not a 64-bit little-endian ELF file with section headers: nothing to examine.
    #[error("{path} is not an ELF file this profiler can examine: not read")]
    NotElf {
        /// The map_files path.
        path: String,
    },
    /// Reading failed.
    #[error("reading {path}: {source}")]
    Read {
        /// The map_files path.
        path: String,
        /// The errno.
        source: io::Error,
    },
}

/// A device number as `/proc/PID/maps` prints it, in [`MapsEntry::device`]'s encoding.
fn maps_device(st_dev: u64) -> u64 {
    let (major, minor) = (libc::major(st_dev), libc::minor(st_dev));
    u64::from(major) << 32 | u64::from(minor)
}

/// Opens of mapped files that failed for want of descriptors (`EMFILE`, `ENFILE`) since
/// start: the agent raises its limit at start, so this moving means a host that maps
/// more files than the limit allows (exported as `descriptor_errors_total`).
pub static DESCRIPTOR_ERRORS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Opens the file of mapping `entry` of `pid` through `/proc/PID/map_files/` only,
/// without blocking on special files, and checks that it is a regular file with the
/// mapping's device and inode.
pub fn open_mapped(pid: u32, entry: &MapsEntry) -> Result<File, MappedFileError> {
    let path = entry.map_files_path(pid);
    if let Some(fstype) = filesystem_type(pid, entry.device).filter(|t| may_stall(t)) {
        return Err(MappedFileError::Unbounded { path, fstype });
    }
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(&path)
        .map_err(|source| {
            if matches!(source.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) {
                DESCRIPTOR_ERRORS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            MappedFileError::Open {
                path: path.clone(),
                source,
            }
        })?;
    let meta = file.metadata().map_err(|source| MappedFileError::Open {
        path: path.clone(),
        source,
    })?;
    if !meta.file_type().is_file() {
        return Err(MappedFileError::NotRegular { path });
    }
    let device = maps_device(meta.dev());
    if device != entry.device || meta.ino() != entry.inode {
        return Err(MappedFileError::NotTheMapping {
            path,
            device,
            inode: meta.ino(),
        });
    }
    Ok(file)
}

/// `/proc/PID/mountinfo` read at most (a process can create many mounts in a user
/// namespace of its own); past it, the rest is not looked at.
const MAX_MOUNTINFO_BYTES: u64 = 16 << 20;

/// Whether reads on file system type `fstype` are answered by a user-space daemon.
fn may_stall(fstype: &str) -> bool {
    fstype == "fuse" || fstype == "fuseblk" || fstype.starts_with("fuse.")
}

/// The type of the file system with device `device` ([`MapsEntry::device`]'s
/// encoding) in `pid`'s mount namespace; `None` if it is not listed (a btrfs
/// subvolume's files carry a device of their own) or the process is gone.
fn filesystem_type(pid: u32, device: u64) -> Option<String> {
    let mut text = String::new();
    File::open(format!("/proc/{pid}/mountinfo"))
        .ok()?
        .take(MAX_MOUNTINFO_BYTES)
        .read_to_string(&mut text)
        .ok()?;
    mountinfo_type(&text, device)
}

/// [`filesystem_type`] on the text of a mountinfo file: `ID PARENT MAJOR:MINOR ROOT
/// MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS`, numbers in decimal.
fn mountinfo_type(text: &str, device: u64) -> Option<String> {
    let wanted = format!("{}:{}", device >> 32, device & 0xffff_ffff);
    text.lines().find_map(|line| {
        let mut fields = line.split(' ');
        if fields.nth(2)? != wanted {
            return None;
        }
        let (_, after) = line.split_once(" - ")?;
        Some(after.split(' ').next()?.to_string())
    })
}

/// A path to an open file of ours (`/proc/self/fd/N`) that the kernel resolves to that
/// very inode: how blazesym and the uprobe attach reach a file opened by
/// [`open_mapped`], with no path lookup in another process's namespace.
pub fn descriptor_path(file: &File) -> PathBuf {
    use std::os::fd::AsRawFd;
    PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()))
}

/// The GNU build id of `file` (opened by [`open_mapped`]), read by blazesym through
/// [`descriptor_path`]; `None` if it has none or is not ELF.
pub fn build_id(file: &File) -> Option<Vec<u8>> {
    blazesym::helper::read_elf_build_id(&descriptor_path(file))
        .ok()
        .flatten()
        .map(|id| id.to_vec())
}

/// Reads `file` (opened by [`open_mapped`], at most [`MAX_MAPPED_FILE_BYTES`]) into a
/// buffer of its size: all of it but the DWARF debug sections, which stay zero and take
/// no memory ([`crate::elf_ranges`]). Anything but an ELF file is refused unread.
pub fn read_mapped(file: &File, what: &Path) -> Result<Vec<u8>, MappedFileError> {
    let path = what.display().to_string();
    let read_error = |source| MappedFileError::Read {
        path: path.clone(),
        source,
    };
    let size = file.metadata().map_err(read_error)?.len();
    if size > MAX_MAPPED_FILE_BYTES {
        return Err(MappedFileError::TooLarge { path, size });
    }
    // Zeroed memory is mapped on demand: pages never written are never resident. The
    // file is read as it was at `size`: one that shrinks meanwhile fails a read, one
    // that grows is not read past it.
    let read_at = |at: u64, buf: &mut [u8]| file.read_exact_at(buf, at);
    let Some(ranges) = crate::elf_ranges::needed_ranges(size, read_at) else {
        return Err(MappedFileError::NotElf { path });
    };
    let mut data = vec![0u8; size as usize];
    for range in ranges {
        let buffer = &mut data[range.start as usize..range.end as usize];
        file.read_exact_at(buffer, range.start)
            .map_err(read_error)?;
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hostile name with spaces and parentheses does not shift the fields.
    #[test]
    fn thread_counts_are_read_after_the_name() {
        let stat =
            "4242 (a) b) 7 8 9) R 1 4242 4242 0 -1 4194560 120 0 0 0 5 3 0 0 20 0 13 0 1 2 3";
        assert_eq!(parse_thread_count(stat), Some(13));
        assert_eq!(parse_thread_count("4242 (x) R 1"), None);
        assert_eq!(thread_count(std::process::id()).map(|n| n >= 1), Some(true));
    }

    #[test]
    fn lines_parse_with_spaces_and_deleted_files() {
        let maps = "\
55d0c0000000-55d0c0001000 r--p 00000000 fe:01 123 /usr/bin/sleep
7f0000028000-7f000019d000 r-xp 00028000 fe:01 456 /opt/my app/lib.so (deleted)
7f00001f0000-7f00001f1000 rw-p 00000000 00:00 0 [heap]
7f00001f1000-7f00001f2000 rw-p 00000000 00:00 0
garbage
";
        let entries = parse_maps(maps);
        assert_eq!(entries.len(), 4);
        assert!(!entries[0].executable);
        assert_eq!(entries[1].range, 0x7f0000028000..0x7f000019d000);
        assert_eq!(entries[1].offset, 0x28000);
        assert_eq!(entries[1].device, 0xfe << 32 | 1);
        assert_eq!(entries[1].inode, 456);
        assert!(entries[1].executable);
        assert_eq!(
            entries[1].file_path(),
            Some(Path::new("/opt/my app/lib.so"))
        );
        assert_eq!(entries[2].file_path(), None);
        assert_eq!(entries[3].name, "");
    }

    /// Our own executable mapping of libc.
    fn own_libc() -> MapsEntry {
        read_maps(std::process::id())
            .into_iter()
            .find(|e| e.executable && e.name.contains("libc.so"))
            .expect("tests run on glibc")
    }

    #[test]
    fn a_mapped_file_opens_through_map_files_and_is_checked() {
        let libc = own_libc();
        let file = open_mapped(std::process::id(), &libc).unwrap();
        let data = read_mapped(&file, Path::new("libc")).unwrap();
        assert!(data.starts_with(b"\x7fELF"));
        // Another inode than the mapping's: refused, whatever the file is.
        let wrong = MapsEntry {
            inode: libc.inode + 1,
            ..libc.clone()
        };
        assert!(matches!(
            open_mapped(std::process::id(), &wrong),
            Err(MappedFileError::NotTheMapping { .. })
        ));
        // A range that is not a mapping: no file at all (nothing else is tried).
        let unmapped = MapsEntry {
            range: 0x1000..0x2000,
            ..libc
        };
        assert!(matches!(
            open_mapped(std::process::id(), &unmapped),
            Err(MappedFileError::Open { .. })
        ));
    }

    #[test]
    fn fuse_mounts_are_found_by_device_and_refused() {
        let mountinfo = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:45 / /home/eve/mnt rw,nosuid,nodev shared:30 - fuse.sshfs eve@host:/ rw,user_id=1000
41 22 0:46 / /run/user/1000/doc rw,nosuid master:5 - fuse.portal portal rw
42 22 0:47 / /var/lib/docker/overlay2/x/merged rw - overlay overlay rw,lowerdir=a
";
        let device = |major: u64, minor: u64| major << 32 | minor;
        assert_eq!(
            mountinfo_type(mountinfo, device(8, 1)).as_deref(),
            Some("ext4")
        );
        let fuse = mountinfo_type(mountinfo, device(0, 45)).unwrap();
        assert_eq!(fuse, "fuse.sshfs");
        assert!(may_stall(&fuse));
        assert!(may_stall("fuseblk") && may_stall("fuse"));
        let overlay = mountinfo_type(mountinfo, device(0, 47)).unwrap();
        assert!(!may_stall(&overlay));
        // 0:4 is not 0:45; an unlisted device is not known.
        assert_eq!(mountinfo_type(mountinfo, device(0, 4)), None);
    }

    #[test]
    fn this_process_files_are_on_a_known_file_system() {
        let me = std::process::id();
        let exe = read_maps(me)
            .into_iter()
            .find(|e| e.executable && e.file_path().is_some())
            .unwrap();
        let fstype = filesystem_type(me, exe.device);
        assert!(
            fstype.as_deref().is_some_and(|t| !may_stall(t)),
            "{fstype:?}"
        );
    }
}
