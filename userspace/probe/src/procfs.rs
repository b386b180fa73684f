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
    ffi::{OsStr, OsString},
    fs::{File, OpenOptions},
    io::{self, Read},
    ops::Range,
    os::unix::{
        ffi::{OsStrExt, OsStringExt},
        fs::{FileExt, MetadataExt, OpenOptionsExt},
    },
    path::{Path, PathBuf},
    sync::atomic::{AtomicU64, Ordering},
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
    /// mappings; empty when there is none). Bytes, as the kernel prints them: a path
    /// need not be UTF-8 (convert lossily only to show it).
    pub name: OsString,
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
        let name = self.name.as_bytes();
        name.starts_with(b"/").then(|| {
            Path::new(OsStr::from_bytes(
                name.strip_suffix(b" (deleted)").unwrap_or(name),
            ))
        })
    }
}

/// Parses the text of `/proc/PID/maps` (bytes: paths need not be UTF-8; a `&str`
/// does too); malformed lines are skipped.
pub fn parse_maps(text: impl AsRef<[u8]>) -> Vec<MapsEntry> {
    text.as_ref()
        .split(|&b| b == b'\n')
        .filter_map(|line| {
            // range perms offset dev inode [name, which may contain spaces]
            let mut fields = line.splitn(6, u8::is_ascii_whitespace);
            let (start, end) = split_once(fields.next()?, b'-')?;
            let perms = fields.next()?;
            let offset = hex(fields.next()?)?;
            let (major, minor) = split_once(fields.next()?, b':')?;
            let device = hex(major)? << 32 | hex(minor)?;
            let inode = std::str::from_utf8(fields.next()?).ok()?.parse().ok()?;
            // Padded with spaces before the name; the name itself is verbatim (only a
            // newline in it is escaped, as `\012`).
            let name = fields.next().unwrap_or_default().trim_ascii_start();
            Some(MapsEntry {
                range: hex(start)?..hex(end)?,
                executable: perms.contains(&b'x'),
                offset,
                device,
                inode,
                name: OsString::from_vec(name.to_vec()),
            })
        })
        .collect()
}

/// `field` split at the first `separator`.
fn split_once(field: &[u8], separator: u8) -> Option<(&[u8], &[u8])> {
    let at = field.iter().position(|&b| b == separator)?;
    Some((&field[..at], &field[at + 1..]))
}

/// A hexadecimal number field.
fn hex(field: &[u8]) -> Option<u64> {
    u64::from_str_radix(std::str::from_utf8(field).ok()?, 16).ok()
}

/// `pid`'s command name (`/proc/PID/comm`, without its newline): bytes, the process's
/// own choice (`prctl(PR_SET_NAME)`, or its executable's name), not necessarily UTF-8.
/// `None` if it is gone.
pub fn comm(pid: u32) -> Option<OsString> {
    let mut comm = std::fs::read(format!("/proc/{pid}/comm")).ok()?;
    if comm.last() == Some(&b'\n') {
        comm.pop();
    }
    Some(OsString::from_vec(comm))
}

/// Whether process `pid` exists now (`/proc/PID`).
pub fn is_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// `pid`'s number of threads (`/proc/PID/stat` field 20), `None` if it is gone. The
/// command name in that line is the process's own choice and may hold spaces and
/// parentheses: the fields are counted after the last `)`.
pub fn thread_count(pid: u32) -> Option<u32> {
    // Bytes: the name need not be UTF-8.
    let stat = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    parse_thread_count(&stat)
}

/// The thread count of a `/proc/PID/stat` line.
fn parse_thread_count(stat: &[u8]) -> Option<u32> {
    let after_name = stat.iter().rposition(|&b| b == b')')? + 1;
    // After the name: state (field 3) first, so num_threads (field 20) is the 18th.
    let field = stat[after_name..]
        .split(u8::is_ascii_whitespace)
        .filter(|field| !field.is_empty())
        .nth(17)?;
    std::str::from_utf8(field).ok()?.parse().ok()
}

/// `/proc/PID/maps` read at most. A process maps at most `vm.max_map_count` ranges
/// (65,530 by default, ~100 bytes a line), but each line's path is the process's to
/// choose, up to 4 KiB: it must not make us read and hold hundreds of megabytes. Past
/// the cap the map is cut at the last whole line ([`MAPS_TRUNCATED`] counts it).
pub const MAX_MAPS_BYTES: u64 = 16 << 20;

/// Memory maps cut at [`MAX_MAPS_BYTES`] since start (exported as `maps_truncated_total`).
pub static MAPS_TRUNCATED: AtomicU64 = AtomicU64::new(0);

/// `pid`'s memory map, at most [`MAX_MAPS_BYTES`] of it, or why it cannot be read
/// (`NotFound`: the process is gone).
pub fn try_read_maps(pid: u32) -> io::Result<Vec<MapsEntry>> {
    let mut text = Vec::new();
    File::open(format!("/proc/{pid}/maps"))?
        .take(MAX_MAPS_BYTES + 1)
        .read_to_end(&mut text)?;
    if cut_to_lines(&mut text, MAX_MAPS_BYTES) {
        MAPS_TRUNCATED.fetch_add(1, Ordering::Relaxed);
    }
    Ok(parse_maps(&text))
}

/// Cuts `text`, read with a cap of `max` bytes (and one more asked for, to tell), at
/// its last whole line within the cap if it is over it; true if it was.
fn cut_to_lines(text: &mut Vec<u8>, max: u64) -> bool {
    if text.len() as u64 <= max {
        return false;
    }
    text.truncate(max as usize);
    let whole = text
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |at| at + 1);
    text.truncate(whole);
    true
}

/// `pid`'s memory map ([`try_read_maps`]); empty if it cannot be read (the process
/// exited).
pub fn read_maps(pid: u32) -> Vec<MapsEntry> {
    try_read_maps(pid).unwrap_or_default()
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
    /// The process's mount table cannot say which file system the file is on: it
    /// could be FUSE, so it is not opened (no verdict about the file itself).
    #[error("{path}: its file system is not known ({reason}): not opened")]
    UnknownFileSystem {
        /// The map_files path.
        path: String,
        /// Why (`/proc/PID/mountinfo` unreadable, or cut before the device).
        reason: String,
    },
    /// Not a 64-bit little-endian ELF file with section headers: nothing to examine.
    #[error("{path} is not an ELF file this profiler can examine: not read")]
    NotElf {
        /// The map_files path.
        path: String,
    },
    /// An ELF file whose layout makes reading it cost more than any real one (a hostile
    /// file): not read ([`crate::elf_ranges`]).
    #[error("{path} refused: {refusal}: not read")]
    Refused {
        /// The map_files path.
        path: String,
        /// What is wrong with its layout.
        refusal: crate::elf_ranges::Refusal,
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
    // Fails closed: a file system that cannot be told is not taken for a safe one.
    match filesystem_type(pid, entry.device) {
        Ok(Some(fstype)) if may_stall(&fstype) => {
            return Err(MappedFileError::Unbounded { path, fstype });
        }
        Ok(_) => {}
        Err(reason) => return Err(MappedFileError::UnknownFileSystem { path, reason }),
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
/// encoding) in `pid`'s mount namespace; `Ok(None)` if it is not listed (a btrfs
/// subvolume's files carry a device of their own). `Err` (why) if that cannot be told:
/// the mountinfo cannot be read (the process is gone), or it was cut at
/// [`MAX_MOUNTINFO_BYTES`] before the device was found.
fn filesystem_type(pid: u32, device: u64) -> Result<Option<String>, String> {
    // Bytes: mount points need not be UTF-8 (a process can mount on any name).
    let mut text = Vec::new();
    File::open(format!("/proc/{pid}/mountinfo"))
        .and_then(|file| file.take(MAX_MOUNTINFO_BYTES + 1).read_to_end(&mut text))
        .map_err(|error| format!("cannot read /proc/{pid}/mountinfo: {error}"))?;
    let cut = cut_to_lines(&mut text, MAX_MOUNTINFO_BYTES);
    match mountinfo_type(&text, device) {
        Some(fstype) => Ok(Some(fstype)),
        None if cut => Err(format!(
            "/proc/{pid}/mountinfo is over {MAX_MOUNTINFO_BYTES} bytes and does not list \
             the device before that"
        )),
        None => Ok(None),
    }
}

/// [`filesystem_type`] on the text of a mountinfo file: `ID PARENT MAJOR:MINOR ROOT
/// MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS`, numbers in decimal
/// (spaces in paths escaped as `\040`, other bytes verbatim). The type is made text
/// lossily (a FUSE subtype is the mounter's choice): `fuse.` stays.
fn mountinfo_type(text: &[u8], device: u64) -> Option<String> {
    let wanted = format!("{}:{}", device >> 32, device & 0xffff_ffff);
    text.split(|&b| b == b'\n').find_map(|line| {
        let mut fields = line.split(|&b| b == b' ');
        if fields.nth(2)? != wanted.as_bytes() {
            return None;
        }
        let separator = line.windows(3).position(|w| w == b" - ")?;
        let fstype = line[separator + 3..].split(|&b| b == b' ').next()?;
        Some(String::from_utf8_lossy(fstype).into_owned())
    })
}

/// A path to an open file of ours (`/proc/self/fd/N`) that the kernel resolves to that
/// very inode: how the uprobe attach reaches a file opened by [`open_mapped`], with no
/// path lookup in another process's namespace (and how blazesym reaches a sealed copy
/// of one, [`crate::sealed_copy`]: never the file itself).
pub fn descriptor_path(file: &File) -> PathBuf {
    use std::os::fd::AsRawFd;
    PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()))
}

/// The GNU build id of `file` (opened by [`open_mapped`]), read from its notes with
/// bounded positioned reads ([`crate::sealed_copy::read_build_id`]: nothing mapped,
/// nothing followed); `None` if it has none or is not ELF. Metadata for reports only:
/// anyone can put any build id in a file of theirs, so it never identifies a file.
pub fn build_id(file: &File) -> Option<Vec<u8>> {
    crate::sealed_copy::read_build_id(file)
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
    // Sorted and merged (each byte read once), and refused past the layout caps.
    let ranges = match crate::elf_ranges::needed_ranges(size, read_at) {
        Ok(ranges) => ranges,
        Err(crate::elf_ranges::RangesError::NotElf) => {
            return Err(MappedFileError::NotElf { path })
        }
        Err(crate::elf_ranges::RangesError::Refused(refusal)) => {
            return Err(MappedFileError::Refused { path, refusal })
        }
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
        assert_eq!(parse_thread_count(stat.as_bytes()), Some(13));
        assert_eq!(parse_thread_count(b"4242 (x) R 1"), None);
        // A name that is not UTF-8 either.
        let stat = b"4242 (x\xff\xfe)) R 1 4242 4242 0 -1 4194560 120 0 0 0 5 3 0 0 20 0 7 0 1";
        assert_eq!(parse_thread_count(stat), Some(7));
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

    /// A path that is not UTF-8 neither fails the read nor loses its line.
    #[test]
    fn names_that_are_not_utf8_parse() {
        let maps: &[u8] = b"\
55d0c0000000-55d0c0001000 r-xp 00000000 fe:01 123                        /tmp/x\xff\xfe\xc3bad
7f0000028000-7f000019d000 r-xp 00028000 fe:01 456 /usr/lib/libc.so.6
7f0000030000-7f000003d000 r-xp 00028000 fe:01 457 /tmp/\xff (deleted)
";
        let entries = parse_maps(maps);
        assert_eq!(entries.len(), 3);
        assert_eq!(entries[0].name.as_bytes(), b"/tmp/x\xff\xfe\xc3bad");
        assert_eq!(
            entries[0].file_path().map(|p| p.as_os_str().as_bytes()),
            Some(&b"/tmp/x\xff\xfe\xc3bad"[..])
        );
        assert_eq!(entries[0].inode, 123);
        assert!(entries[0].executable);
        assert_eq!(
            entries[1].file_path(),
            Some(Path::new("/usr/lib/libc.so.6"))
        );
        assert_eq!(
            entries[2].file_path().map(|p| p.as_os_str().as_bytes()),
            Some(&b"/tmp/\xff"[..])
        );
    }

    #[test]
    fn capped_reads_are_cut_at_a_whole_line() {
        let mut text = b"aaaa\nbbbb\ncccc\n".to_vec();
        assert!(!cut_to_lines(&mut text, 15));
        assert_eq!(text, b"aaaa\nbbbb\ncccc\n");
        // Read with a cap of 12 (13 bytes asked for): "ccc" of the last line is partial.
        let mut text = b"aaaa\nbbbb\nccc".to_vec();
        assert!(cut_to_lines(&mut text, 12));
        assert_eq!(text, b"aaaa\nbbbb\n");
        let mut text = b"aaaaaaaa".to_vec();
        assert!(cut_to_lines(&mut text, 4));
        assert!(text.is_empty());
        // Our own map is far under the cap, and whole.
        let maps = try_read_maps(std::process::id()).unwrap();
        assert!(maps.iter().any(|e| e.name == "[stack]"), "{maps:?}");
        assert_eq!(
            try_read_maps(u32::MAX).map_err(|e| e.kind()),
            Err(io::ErrorKind::NotFound)
        );
    }

    #[test]
    fn comms_are_bytes() {
        let comm = comm(std::process::id()).unwrap();
        assert!(
            !comm.is_empty() && !comm.as_bytes().ends_with(b"\n"),
            "{comm:?}"
        );
        assert_eq!(super::comm(u32::MAX), None);
    }

    /// Our own executable mapping of libc.
    fn own_libc() -> MapsEntry {
        read_maps(std::process::id())
            .into_iter()
            .find(|e| e.executable && e.name.to_string_lossy().contains("libc.so"))
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
        let mountinfo = mountinfo.as_bytes();
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

    /// A mount point (or FUSE subtype) that is not UTF-8 does not hide the mount.
    #[test]
    fn fuse_mounts_with_names_that_are_not_utf8_are_refused() {
        let mountinfo: &[u8] = b"\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:45 / /home/eve/\xff\xfe rw,nosuid,nodev shared:30 - fuse.sshfs eve@host:/ rw
41 22 0:46 / /home/eve/b rw,nosuid,nodev shared:31 - fuse.\xff x rw
";
        let device = |major: u64, minor: u64| major << 32 | minor;
        assert_eq!(
            mountinfo_type(mountinfo, device(0, 45)).as_deref(),
            Some("fuse.sshfs")
        );
        assert!(may_stall(
            &mountinfo_type(mountinfo, device(0, 46)).unwrap()
        ));
        assert_eq!(
            mountinfo_type(mountinfo, device(8, 1)).as_deref(),
            Some("ext4")
        );
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
            matches!(&fstype, Ok(Some(t)) if !may_stall(t)),
            "{fstype:?}"
        );
        // A process that is gone: not known, so nothing of it is opened.
        assert!(filesystem_type(u32::MAX, exe.device).is_err());
    }
}
