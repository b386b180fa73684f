use super::*;

/// A hostile name with spaces and parentheses does not shift the fields.
#[test]
fn thread_counts_are_read_after_the_name() {
    let stat = "4242 (a) b) 7 8 9) R 1 4242 4242 0 -1 4194560 120 0 0 0 5 3 0 0 20 0 13 0 1 2 3";
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
#[ignore = "needs root: opens files through /proc/PID/map_files (cargo xtask test runs it in its root lane)"]
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

/// A mount table from its text, whole.
fn table(text: &[u8]) -> MountTable {
    MountTable {
        text: text.to_vec(),
        cut: false,
    }
}

/// [`MapsEntry::device`]'s encoding of `major:minor`.
fn device(major: u64, minor: u64) -> u64 {
    major << 32 | minor
}

#[test]
fn fuse_mounts_are_found_by_device_and_refused() {
    let mountinfo = table(
        b"\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:45 / /home/eve/mnt rw,nosuid,nodev shared:30 - fuse.sshfs eve@host:/ rw,user_id=1000
41 22 0:46 / /run/user/1000/doc rw,nosuid master:5 - fuse.portal portal rw
42 22 0:47 / /var/lib/docker/overlay2/x/merged rw - overlay overlay rw,lowerdir=a
",
    );
    assert_eq!(mountinfo.device_type(device(8, 1)).as_deref(), Some("ext4"));
    let fuse = mountinfo.device_type(device(0, 45)).unwrap();
    assert_eq!(fuse, "fuse.sshfs");
    assert!(may_stall(&fuse));
    assert!(may_stall("fuseblk") && may_stall("fuse"));
    let overlay = mountinfo.device_type(device(0, 47)).unwrap();
    assert!(!may_stall(&overlay));
    // 0:4 is not 0:45; an unlisted device is not known.
    assert_eq!(mountinfo.device_type(device(0, 4)), None);
}

/// A mount point (or FUSE subtype) that is not UTF-8 does not hide the mount.
#[test]
fn fuse_mounts_with_names_that_are_not_utf8_are_refused() {
    let mountinfo = table(
        b"\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:45 / /home/eve/\xff\xfe rw,nosuid,nodev shared:30 - fuse.sshfs eve@host:/ rw
41 22 0:46 / /home/eve/b rw,nosuid,nodev shared:31 - fuse.\xff x rw
",
    );
    assert_eq!(
        mountinfo.device_type(device(0, 45)).as_deref(),
        Some("fuse.sshfs")
    );
    assert!(may_stall(&mountinfo.device_type(device(0, 46)).unwrap()));
    assert_eq!(mountinfo.device_type(device(8, 1)).as_deref(), Some("ext4"));
    assert_eq!(mountinfo.mount_type(40).as_deref(), Some("fuse.sshfs"));
}

/// Network and cluster file systems, whose server or peers may never answer, are
/// refused like FUSE; local ones (block devices, overlayfs, btrfs, tmpfs) are not.
#[test]
fn network_file_systems_are_refused_by_type() {
    let mountinfo = table(
        b"\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
50 22 0:50 / /mnt/nfs rw,relatime shared:40 - nfs4 server:/export rw,vers=4.2,hard
51 22 0:51 / /mnt/smb rw,relatime shared:41 - cifs //server/share rw,vers=3.1.1
52 22 0:52 / /mnt/host rw,relatime shared:42 - 9p hostshare rw,trans=virtio
53 22 0:53 / /mnt/nfs3 rw shared:43 - nfs server:/old rw,vers=3
54 22 0:54 / /mnt/smb3 rw shared:44 - smb3 //server/b rw
55 22 0:55 / /mnt/ceph rw shared:45 - ceph 10.0.0.1:/ rw
56 22 0:56 / /mnt/vfs rw shared:46 - virtiofs tag rw
57 22 0:57 / /mnt/gluster rw shared:47 - fuse.glusterfs g:/vol rw
58 22 8:17 / /mnt/cluster rw shared:48 - gfs2 /dev/sdb1 rw
59 22 0:59 / /var/lib/docker/overlay2/y/merged rw - overlay overlay rw
60 22 0:36 /@home /home rw shared:50 - btrfs /dev/sda2 rw,subvol=/@home
61 22 0:61 / /tmp rw shared:51 - tmpfs tmpfs rw
62 22 253:0 / /data rw shared:52 - xfs /dev/mapper/data rw
",
    );
    for (minor, fstype) in [
        (50, "nfs4"),
        (51, "cifs"),
        (52, "9p"),
        (53, "nfs"),
        (54, "smb3"),
        (55, "ceph"),
        (56, "virtiofs"),
        (57, "fuse.glusterfs"),
    ] {
        let found = mountinfo.device_type(device(0, minor));
        assert_eq!(found.as_deref(), Some(fstype));
        assert!(may_stall(fstype), "{fstype}");
    }
    assert!(may_stall(&mountinfo.device_type(device(8, 17)).unwrap()));
    for fstype in ["afs", "lustre", "glusterfs", "orangefs", "coda", "ocfs2"] {
        assert!(may_stall(fstype), "{fstype}");
    }
    for (id, fstype) in [
        (22, "ext4"),
        (59, "overlay"),
        (60, "btrfs"),
        (61, "tmpfs"),
        (62, "xfs"),
    ] {
        assert_eq!(mountinfo.mount_type(id).as_deref(), Some(fstype));
        assert!(!may_stall(fstype), "{fstype}");
    }
    // Names that only contain a refused one are not refused.
    assert!(!may_stall("nfsd") && !may_stall("fusectl") && !may_stall("9pfs"));
}

/// A mapping's mount is found by id in the process's table, else in ours; a mount
/// in neither (detached by `umount -l`) is not known, whatever its device.
#[test]
fn mounts_are_found_by_id_in_the_process_table_then_ours() {
    // The container's view: its overlay root (anonymous device 0:47) and a btrfs
    // subvolume (0:36); mount 41's parent field is 1500, which is no mount id.
    let process = table(
        b"\
41 1500 0:46 / /proc rw - proc proc rw
1500 1400 0:47 / / rw - overlay overlay rw,lowerdir=a
1501 1500 0:36 /@data /data rw - btrfs /dev/sda2 rw,subvol=/@data
",
    );
    let not_read = || -> Result<MountTable, String> { panic!("ours is not needed") };
    assert_eq!(mount_type(1500, &process, not_read).unwrap(), "overlay");
    assert_eq!(mount_type(1501, &process, not_read).unwrap(), "btrfs");
    // Outside the process's chroot, or in the namespace it left: ours lists it.
    let ours = || Ok(table(b"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n"));
    assert_eq!(mount_type(22, &process, ours).unwrap(), "ext4");
    // In neither: detached. Not known, so not opened.
    let detached = mount_type(1502, &process, ours).unwrap_err();
    assert!(detached.contains("detached"), "{detached}");
    // A table cut at the cap may list it past the cut: not known either.
    let cut = MountTable {
        cut: true,
        ..table(&process.text)
    };
    let past = mount_type(1502, &cut, ours).unwrap_err();
    assert!(past.contains("cap"), "{past}");
    // Ours unreadable: not known.
    assert!(mount_type(1502, &process, || Err("gone".to_string())).is_err());
    // Mount 1 is the parent of 22, not a mount.
    assert!(mount_type(1, &process, ours).is_err());
}

#[test]
fn fdinfo_mount_ids_parse() {
    let fdinfo = b"pos:\t0\nflags:\t012100000\nmnt_id:\t1234\nino:\t56\n";
    assert_eq!(parse_fdinfo_mount_id(fdinfo), Some(1234));
    assert_eq!(parse_fdinfo_mount_id(b"pos:\t0\nflags:\t0\n"), None);
    assert_eq!(parse_fdinfo_mount_id(b"mnt_id:\tx\n"), None);
}

/// The mount of our own libc mapping, pinned through map_files, is the one
/// `statx(STATX_MNT_ID)` names, and our mount table lists it as a local file system.
#[test]
#[ignore = "needs root: opens files through /proc/PID/map_files (cargo xtask test runs it in its root lane)"]
fn the_mount_of_a_pinned_mapping_is_in_our_mount_table() {
    let me = std::process::id();
    let libc = own_libc();
    let path = libc.map_files_path(me);
    let pinned = pin(&path).unwrap();
    let mount = fdinfo_mount_id(&pinned).unwrap();
    // SAFETY: a zeroed statx is a valid buffer; the path is NUL-terminated.
    let stx = unsafe {
        let mut stx: libc::statx = std::mem::zeroed();
        let at = std::ffi::CString::new(path.clone()).unwrap();
        let rc = libc::statx(
            libc::AT_FDCWD,
            at.as_ptr(),
            libc::AT_STATX_DONT_SYNC,
            libc::STATX_MNT_ID,
            &mut stx,
        );
        assert_eq!(rc, 0, "{}", io::Error::last_os_error());
        stx
    };
    assert_ne!(stx.stx_mask & libc::STATX_MNT_ID, 0);
    assert_eq!(stx.stx_mnt_id, mount);
    let ours = MountTable::read("/proc/self/mountinfo").unwrap();
    assert!(!ours.cut);
    let fstype = ours.mount_type(mount).expect("our libc's mount is listed");
    assert!(!may_stall(&fstype), "{fstype}");
    // A process that is gone: not known, so nothing of it is opened.
    assert!(matches!(
        open_mapped(u32::MAX, &libc),
        Err(MappedFileError::UnknownFileSystem { .. })
    ));
}

/// A memfd's mount is in no mount table, but it is the kernel's own tmpfs: its
/// files open.
#[test]
#[ignore = "needs root: opens files through /proc/PID/map_files (cargo xtask test runs it in its root lane)"]
fn a_mapped_memfd_opens() {
    use std::os::fd::{AsRawFd, FromRawFd};
    // SAFETY: a NUL-terminated name.
    let fd = unsafe { libc::memfd_create(c"procfs-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "{}", io::Error::last_os_error());
    // SAFETY: `fd` is open and ours alone.
    let memfd = unsafe { File::from_raw_fd(fd) };
    memfd.set_len(4096).unwrap();
    // SAFETY: a fresh private read-only mapping of 4 KiB, unmapped below.
    let address = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ,
            libc::MAP_PRIVATE,
            memfd.as_raw_fd(),
            0,
        )
    };
    assert_ne!(address, libc::MAP_FAILED);
    let me = std::process::id();
    let entry = read_maps(me)
        .into_iter()
        .find(|e| e.range.start == address as u64)
        .unwrap();
    let ours = MountTable::read("/proc/self/mountinfo").unwrap();
    let mount = fdinfo_mount_id(&memfd).unwrap();
    assert_eq!(ours.mount_type(mount), None, "listed after all");
    assert_eq!(kernel_tmpfs_mount(), Some(mount));
    let opened = open_mapped(me, &entry);
    // SAFETY: the mapping made above, no longer used.
    unsafe { libc::munmap(address, 4096) };
    assert!(opened.is_ok(), "{opened:?}");
}

/// A tmpfs mounted at a fresh directory, detached (`umount -l`) on drop.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(name: &str) -> Tmpfs {
        let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let at = std::ffi::CString::new(dir.as_os_str().as_bytes()).unwrap();
        // SAFETY: NUL-terminated strings; no data.
        let rc = unsafe {
            libc::mount(
                c"tmpfs".as_ptr(),
                at.as_ptr(),
                c"tmpfs".as_ptr(),
                0,
                c"size=1m,mode=0700".as_ptr().cast(),
            )
        };
        assert_eq!(
            rc,
            0,
            "mount tmpfs (as root): {}",
            io::Error::last_os_error()
        );
        Tmpfs(dir)
    }

    /// `umount -l`: the mount leaves every table; files mapped from it stay.
    fn detach(&self) {
        let at = std::ffi::CString::new(self.0.as_os_str().as_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        unsafe { libc::umount2(at.as_ptr(), libc::MNT_DETACH) };
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        self.detach();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// A file mapped from a tmpfs (an anonymous device, like overlayfs, btrfs, FUSE or
/// NFS) opens while its mount is listed, and is refused once the mount is detached:
/// its device is then in no table either, and nothing says what the file system is.
#[test]
#[ignore = "needs root: mounts a tmpfs (cargo xtask test runs it in its root lane)"]
fn a_file_on_a_detached_mount_is_not_opened() {
    let tmpfs = Tmpfs::mount("procfs-detached");
    let path = tmpfs.0.join("mapped");
    std::fs::write(&path, vec![7u8; 4096]).unwrap();
    let file = File::open(&path).unwrap();
    use std::os::fd::AsRawFd;
    // SAFETY: a fresh private read-only mapping of a 4 KiB file, unmapped below.
    let address = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ,
            libc::MAP_PRIVATE,
            file.as_raw_fd(),
            0,
        )
    };
    assert_ne!(address, libc::MAP_FAILED);
    drop(file);
    let me = std::process::id();
    let entry = read_maps(me)
        .into_iter()
        .find(|e| e.range.start == address as u64)
        .unwrap();
    assert_eq!(entry.device >> 32, 0, "tmpfs has an anonymous device");
    let opened = open_mapped(me, &entry);
    assert!(opened.is_ok(), "{opened:?}");
    tmpfs.detach();
    let ours = MountTable::read("/proc/self/mountinfo").unwrap();
    assert_eq!(ours.device_type(entry.device), None);
    let refused = open_mapped(me, &entry);
    // SAFETY: the mapping made above, no longer used.
    unsafe { libc::munmap(address, 4096) };
    match refused {
        Err(MappedFileError::UnknownFileSystem { reason, .. }) => {
            assert!(reason.contains("detached"), "{reason}")
        }
        other => panic!("opened or refused otherwise: {other:?}"),
    }
}

#[test]
fn task_flags_are_read_after_a_name_with_spaces_and_parentheses() {
    let stat = b"4242 (a) (b c) R 1 4242 4242 0 -1 4194564 120 0 0 0";
    assert_eq!(parse_flags(stat), Some(4_194_564));
    assert!(parse_flags(stat).is_some_and(|flags| flags & PF_EXITING != 0));
    let running = b"4242 (busy) S 1 4242 4242 0 -1 4194560 120 0";
    assert!(parse_flags(running).is_some_and(|flags| flags & PF_EXITING == 0));
    assert_eq!(parse_flags(b"4242 (short) R 1"), None);
    assert_eq!(parse_flags(b"no name at all"), None);
}

#[test]
fn this_process_is_not_exiting_and_a_reaped_child_is() {
    assert!(!is_exiting(std::process::id()));
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    assert!(is_exiting(pid));
}
