//! Mounts: which mount a pinned file was reached through, and the type of its file
//! system, read from the mount tables, so that a file on a file system that may wait
//! for ever (FUSE, a network one) is never opened or read (`super::open_mapped`).

use std::{fs::File, io::Read};

use super::cut_to_lines;

/// The id of the mount `file` was reached through, as `/proc/self/fdinfo/N` prints it
/// (`mnt_id:`, Linux 3.15+; the id mountinfo lists first). The kernel prints it from
/// the open file, asking its file system nothing, where `statx(STATX_MNT_ID)` would
/// call its `getattr`, which `AT_STATX_DONT_SYNC` does not keep off the wire on every
/// file system (9p without a cache, CIFS with attributes invalidated, GFS2, OCFS2).
pub(super) fn fdinfo_mount_id(file: &File) -> Result<u64, String> {
    use std::os::fd::AsRawFd;
    let at = format!("/proc/self/fdinfo/{}", file.as_raw_fd());
    let mut text = Vec::new();
    File::open(&at)
        .and_then(|info| info.take(64 << 10).read_to_end(&mut text))
        .map_err(|error| format!("cannot read {at}: {error}"))?;
    parse_fdinfo_mount_id(&text).ok_or_else(|| format!("{at} has no mnt_id"))
}

/// The id of the kernel's internal tmpfs mount, which backs every memfd, System V
/// shared memory segment and shared anonymous mapping (`/memfd:NAME (deleted)`,
/// `/SYSV... (deleted)`, `/dev/zero (deleted)` in the maps): in no mount table, yet
/// nothing stands behind it (a .NET process maps its JIT code from a memfd). Found
/// from a memfd of ours, each time it is asked (only for a mount in no table, so kept
/// in no process-wide cell); `None` if that fails (such files are then refused).
pub(super) fn kernel_tmpfs_mount() -> Option<u64> {
    use std::os::fd::FromRawFd;
    // SAFETY: a NUL-terminated name; the descriptor returned is ours alone.
    let fd = unsafe { libc::memfd_create(c"allocbpf-mount".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` is open and owned by nobody else.
    let memfd = unsafe { File::from_raw_fd(fd) };
    fdinfo_mount_id(&memfd).ok()
}

/// The `mnt_id:` field of the text of a `/proc/PID/fdinfo/N` file.
pub(super) fn parse_fdinfo_mount_id(text: &[u8]) -> Option<u64> {
    text.split(|&b| b == b'\n').find_map(|line| {
        let value = line.strip_prefix(b"mnt_id:")?;
        std::str::from_utf8(value).ok()?.trim().parse().ok()
    })
}

/// `/proc/PID/mountinfo` read at most (a process can create many mounts in a user
/// namespace of its own); past it, the rest is not looked at.
pub(super) const MAX_MOUNTINFO_BYTES: u64 = 16 << 20;

/// File system types (as mountinfo prints them) whose opens and reads wait on someone
/// else, who may never answer: a user-space daemon (FUSE, which any user may mount;
/// virtiofs, whose daemon is the host's) or a server over the network (an unreachable
/// NFS server makes every request wait, `hard` mounts for ever; the cluster file
/// systems GFS2 and OCFS2 wait on their lock manager's peers). `fuse.*` too.
const STALLING_TYPES: &[&str] = &[
    "fuse",
    "fuseblk",
    "virtiofs",
    "nfs",
    "nfs4",
    "cifs",
    "smb3",
    "9p",
    "ceph",
    "afs",
    "lustre",
    // Mounted through FUSE (`fuse.glusterfs`); the bare name, should a kernel client
    // ever print it.
    "glusterfs",
    "orangefs",
    "coda",
    "gfs2",
    "ocfs2",
    // Out-of-tree clients of parallel network file systems.
    "beegfs",
    "gpfs",
];

/// Whether opens and reads on file system type `fstype` may wait for ever on a daemon
/// or a server ([`STALLING_TYPES`], `fuse.*`).
pub(super) fn may_stall(fstype: &str) -> bool {
    fstype.starts_with("fuse.") || STALLING_TYPES.contains(&fstype)
}

/// A mount table (`/proc/PID/mountinfo`) as read: at most [`MAX_MOUNTINFO_BYTES`] of
/// it, cut at its last whole line past that.
pub(crate) struct MountTable {
    /// Bytes: mount points need not be UTF-8 (a process can mount on any name).
    pub(super) text: Vec<u8>,
    /// Cut at the cap: what it does not list may be past the cut.
    pub(super) cut: bool,
}

impl MountTable {
    /// The table at `at`; `Err` (why) if it cannot be read (the process is gone).
    pub(crate) fn read(at: &str) -> Result<MountTable, String> {
        let mut text = Vec::new();
        File::open(at)
            .and_then(|file| file.take(MAX_MOUNTINFO_BYTES + 1).read_to_end(&mut text))
            .map_err(|error| format!("cannot read {at}: {error}"))?;
        let cut = cut_to_lines(&mut text, MAX_MOUNTINFO_BYTES);
        Ok(MountTable { text, cut })
    }

    /// The type of the file system with device `device` ([`MapsEntry::device`]'s
    /// encoding), if a mount of it is listed: a device names one file system (a
    /// superblock), whose type every mount of it shares.
    pub(super) fn device_type(&self, device: u64) -> Option<String> {
        let wanted = format!("{}:{}", device >> 32, device & 0xffff_ffff);
        mountinfo_type(&self.text, 2, wanted.as_bytes())
    }

    /// Every device listed ([`MapsEntry::device`]'s encoding), and whether its file
    /// system may stall a read ([`may_stall`]).
    pub(crate) fn stalling_by_device(&self) -> std::collections::HashMap<u64, bool> {
        let mut devices = std::collections::HashMap::new();
        for line in self.text.split(|&b| b == b'\n') {
            let Some(device) = line.split(|&b| b == b' ').nth(2) else {
                continue;
            };
            let Some((major, minor)) = std::str::from_utf8(device)
                .ok()
                .and_then(|d| d.split_once(':'))
                .and_then(|(a, b)| Some((a.parse::<u64>().ok()?, b.parse::<u64>().ok()?)))
            else {
                continue;
            };
            let Some(separator) = line.windows(3).position(|w| w == b" - ") else {
                continue;
            };
            let Some(fstype) = line[separator + 3..].split(|&b| b == b' ').next() else {
                continue;
            };
            let stalls = may_stall(&String::from_utf8_lossy(fstype));
            // A device mounted twice is one file system: one verdict.
            *devices.entry((major << 32) | minor).or_insert(false) |= stalls;
        }
        devices
    }

    /// The type of the file system of mount `id`, if it is listed.
    pub(super) fn mount_type(&self, id: u64) -> Option<String> {
        mountinfo_type(&self.text, 0, id.to_string().as_bytes())
    }
}

/// The type of the file system of mount `id`: from `table` (the process's), else from
/// the table `own` reads (ours: mount ids are system-wide, and a mount the process's
/// table leaves out, outside its chroot or in the namespace it left, may be in ours).
/// `Err` (why) if it is in neither: detached (`umount -l`), in a namespace we cannot
/// see, or past a cut. Such a file is not opened whatever its device: the device the
/// maps print need not be the pinned file's (the process may have mapped another file
/// at that range since), and the pinned file's own device is known only through its
/// file system's `getattr`.
pub(super) fn mount_type(
    id: u64,
    table: &MountTable,
    own: impl FnOnce() -> Result<MountTable, String>,
) -> Result<String, String> {
    if let Some(fstype) = table.mount_type(id) {
        return Ok(fstype);
    }
    let own = own()?;
    if let Some(fstype) = own.mount_type(id) {
        return Ok(fstype);
    }
    Err(if table.cut || own.cut {
        format!(
            "mount {id} is not listed before the {MAX_MOUNTINFO_BYTES}-byte cap of a mount \
             table"
        )
    } else {
        format!(
            "mount {id} is in no mount table, the process's or ours: detached (umount -l) \
             or in a namespace out of sight"
        )
    })
}

/// The file system type of the first line of the mountinfo `text` whose field `field`
/// (0: the mount id, 2: the device as `MAJOR:MINOR`) is `wanted`. A line is `ID PARENT
/// MAJOR:MINOR ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS`,
/// numbers in decimal (spaces in paths escaped as `\040`, other bytes verbatim). The
/// type is made text lossily (a FUSE subtype is the mounter's choice): `fuse.` stays.
fn mountinfo_type(text: &[u8], field: usize, wanted: &[u8]) -> Option<String> {
    text.split(|&b| b == b'\n').find_map(|line| {
        if line.split(|&b| b == b' ').nth(field)? != wanted {
            return None;
        }
        let separator = line.windows(3).position(|w| w == b" - ")?;
        let fstype = line[separator + 3..].split(|&b| b == b' ').next()?;
        Some(String::from_utf8_lossy(fstype).into_owned())
    })
}
