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
//! Files on FUSE and network file systems are not opened at all: every open and read of
//! such a file is a request answered by a user-space daemon (which any user may run:
//! fusermount is setuid) or a server, either of which may never answer
//! (`may_stall`). Nor are files whose mount is in no mount table (lazily unmounted):
//! their file system cannot be told. The mapping is pinned with an `O_PATH` descriptor
//! (no request to its file system), its mount looked up by id in the process's own
//! `/proc/PID/mountinfo` (or ours), and only then is that very file opened
//! ([`open_mapped`]).

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
};

pub use self::loader::in_dynamic_loader;
#[cfg(test)]
use self::mounts::parse_fdinfo_mount_id;
pub(crate) use self::mounts::MountTable;
use self::mounts::{fdinfo_mount_id, kernel_tmpfs_mount, may_stall, mount_type};

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

/// The owner of process `pid` (the owner of its `/proc/PID`, its effective user), `None`
/// if it is gone.
pub fn process_owner(pid: u32) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}"))
        .ok()
        .map(|m| m.uid())
}

/// Whether process `pid` exists now (`/proc/PID`).
pub fn is_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Whether process `pid` has exited: it is gone, or a zombie its parent has not
/// reaped yet (`/proc/PID/stat` state `Z` or `X`), whose memory is already gone.
pub fn has_exited(pid: u32) -> bool {
    match std::fs::read(format!("/proc/{pid}/stat")) {
        Ok(stat) => parse_state(&stat).is_none_or(|state| matches!(state, b'Z' | b'X')),
        Err(_) => true,
    }
}

/// The kernel's `PF_EXITING` task flag: set as the task starts to exit, before its
/// memory map is torn down and long before it is a zombie.
const PF_EXITING: u64 = 0x4;

/// True if `pid` has exited ([`has_exited`]) or its main thread has begun to exit: what
/// a look at a process that fails half-way (its files unreadable, its map emptied)
/// tells apart from a process that really lacks what was looked for.
pub fn is_exiting(pid: u32) -> bool {
    match std::fs::read(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            parse_state(&stat).is_none_or(|state| matches!(state, b'Z' | b'X'))
                || parse_flags(&stat).is_some_and(|flags| flags & PF_EXITING != 0)
        }
        Err(_) => true,
    }
}

/// The task flags of a `/proc/PID/stat` line (field 9, the sixth after the name).
fn parse_flags(stat: &[u8]) -> Option<u64> {
    let after_name = stat.iter().rposition(|&b| b == b')')? + 1;
    let field = (stat[after_name..].split(|b| b.is_ascii_whitespace()))
        .filter(|field| !field.is_empty())
        .nth(6)?;
    std::str::from_utf8(field).ok()?.parse().ok()
}

/// The state letter of a `/proc/PID/stat` line (field 3, the first after the name).
fn parse_state(stat: &[u8]) -> Option<u8> {
    let after_name = stat.iter().rposition(|&b| b == b')')? + 1;
    stat[after_name..]
        .iter()
        .copied()
        .find(|b| !b.is_ascii_whitespace())
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
/// the cap the map is cut at the last whole line ([`read_maps_counting_cuts`] counts it).
pub const MAX_MAPS_BYTES: u64 = 16 << 20;

/// The mapping of ours (this process's) that holds `address`, if any.
pub fn own_mapping_at(address: u64) -> Option<MapsEntry> {
    try_read_maps(std::process::id())
        .ok()?
        .into_iter()
        .find(|entry| entry.range.contains(&address))
}

/// `pid`'s memory map, at most [`MAX_MAPS_BYTES`] of it, or why it cannot be read
/// (`NotFound`: the process is gone).
pub fn try_read_maps(pid: u32) -> io::Result<Vec<MapsEntry>> {
    read_maps_cut(pid).map(|(maps, _)| maps)
}

/// `pid`'s memory map ([`read_maps`]), adding one to `cuts` if it was cut at
/// [`MAX_MAPS_BYTES`] (the engine's count, exported as `maps_truncated_total`).
pub fn read_maps_counting_cuts(pid: u32, cuts: &mut u64) -> Vec<MapsEntry> {
    let (maps, cut) = read_maps_cut(pid).unwrap_or_default();
    *cuts += u64::from(cut);
    maps
}

/// `pid`'s memory map, and whether it was cut at [`MAX_MAPS_BYTES`].
fn read_maps_cut(pid: u32) -> io::Result<(Vec<MapsEntry>, bool)> {
    let mut text = Vec::new();
    File::open(format!("/proc/{pid}/maps"))?
        .take(MAX_MAPS_BYTES + 1)
        .read_to_end(&mut text)?;
    let cut = cut_to_lines(&mut text, MAX_MAPS_BYTES);
    Ok((parse_maps(&text), cut))
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
    /// On a file system whose opens and reads a user-space daemon or a server answers
    /// (`may_stall`).
    #[error(
        "{path} is on a {fstype} file system, whose daemon or server could stall any open \
         or read: not opened"
    )]
    Unbounded {
        /// The map_files path.
        path: String,
        /// The file system type (`fuse.sshfs`, `nfs4`...).
        fstype: String,
    },
    /// No mount table can say which file system the file is on: it could be FUSE or
    /// NFS, so it is not opened (no verdict about the file itself: another process may
    /// map it through a mount that is listed).
    #[error("{path}: its file system is not known ({reason}): not opened")]
    UnknownFileSystem {
        /// The map_files path.
        path: String,
        /// Why (`/proc/PID/mountinfo` unreadable, or cut before the mount; the mount
        /// in no table: detached by `umount -l`).
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

impl MappedFileError {
    /// True when the open failed for want of descriptors (`EMFILE`, `ENFILE`): the agent
    /// raises its limit at start, so this happening means a host that maps more files
    /// than the limit allows (callers count it: `descriptor_errors_total`).
    pub fn out_of_descriptors(&self) -> bool {
        matches!(self, MappedFileError::Open { source, .. }
            if matches!(source.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)))
    }
}

/// A device number as `/proc/PID/maps` prints it, in [`MapsEntry::device`]'s encoding.
fn maps_device(st_dev: u64) -> u64 {
    let (major, minor) = (libc::major(st_dev), libc::minor(st_dev));
    u64::from(major) << 32 | u64::from(minor)
}

/// Opens the file of mapping `entry` of `pid` through `/proc/PID/map_files/` only,
/// without blocking on special files or on a file system that may stall, and checks
/// that it is a regular file with the mapping's device and inode. In that order,
/// failing closed (a file system that cannot be told is not taken for a safe one):
/// 1. the mapping's device is looked up in the process's mount table: a file system
///    that may stall (`may_stall`) is refused without touching the file;
/// 2. the map_files link is opened `O_PATH` (`pin`): the kernel resolves it to the
///    file mapped there now and opens nothing, asking its file system nothing;
/// 3. the mount that descriptor was reached through (`fdinfo_mount_id`) is looked up
///    by id in the process's mount table, else in ours (`mount_type`): a type that
///    may stall is refused, and so is a mount in neither (detached by `umount -l`:
///    FUSE, NFS or tmpfs, nobody can tell);
/// 4. the pinned file itself is opened, through `/proc/self/fd/N` (the file just
///    judged, even if the process mapped another at that range meanwhile), and checked.
pub fn open_mapped(pid: u32, entry: &MapsEntry) -> Result<File, MappedFileError> {
    let path = entry.map_files_path(pid);
    let unknown = |reason| MappedFileError::UnknownFileSystem {
        path: entry.map_files_path(pid),
        reason,
    };
    let table = MountTable::read(&format!("/proc/{pid}/mountinfo")).map_err(unknown)?;
    if let Some(fstype) = table.device_type(entry.device).filter(|t| may_stall(t)) {
        return Err(MappedFileError::Unbounded { path, fstype });
    }
    let pinned = pin(&path)?;
    let mount = fdinfo_mount_id(&pinned).map_err(unknown)?;
    // A mount in no table may be the kernel's internal tmpfs (memfds): looked for only
    // then, since telling it costs a memfd of our own.
    let fstype = mount_type(mount, &table, || MountTable::read("/proc/self/mountinfo"))
        .or_else(|reason| match kernel_tmpfs_mount() == Some(mount) {
            true => Ok("tmpfs".to_string()),
            false => Err(reason),
        })
        .map_err(unknown)?;
    if may_stall(&fstype) {
        return Err(MappedFileError::Unbounded { path, fstype });
    }
    let file = open_with(
        descriptor_path(&pinned),
        libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC,
    )
    .map_err(|source| MappedFileError::Open {
        path: path.clone(),
        source,
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

/// Opens `path` for reading with `flags`.
fn open_with(path: impl AsRef<Path>, flags: i32) -> io::Result<File> {
    OpenOptions::new().read(true).custom_flags(flags).open(path)
}

/// An `O_PATH` descriptor of the file the map_files link `path` resolves to now: the
/// link is followed by the kernel (`nd_jump_link`: the mapping's own path, no lookup
/// in the file system), and an `O_PATH` open calls no `open` of the file system. Its
/// only use is [`fdinfo_mount_id`] and reopening it: never `fstat` it (that asks the
/// file system, `getattr`). `Open` if the mapping is gone.
fn pin(path: &str) -> Result<File, MappedFileError> {
    open_with(path, libc::O_PATH | libc::O_CLOEXEC).map_err(|source| MappedFileError::Open {
        path: path.to_string(),
        source,
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

/// The file `entry` of `pid`'s maps (at `path`) opened by [`open_mapped`] and read by
/// [`read_mapped`]; `None` when it cannot be, an open that failed for want of
/// descriptors adding one to `descriptor_errors` (what a runtime examining the files of
/// the processes it looks at counts).
pub fn read_mapped_file(
    pid: u32,
    entry: &MapsEntry,
    path: &Path,
    descriptor_errors: &mut u64,
) -> Option<Vec<u8>> {
    match open_mapped(pid, entry) {
        Ok(file) => read_mapped(&file, path).ok(),
        Err(error) => {
            *descriptor_errors += u64::from(error.out_of_descriptors());
            None
        }
    }
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

mod loader;
mod mounts;
pub mod procmap;
#[cfg(test)]
mod tests;
