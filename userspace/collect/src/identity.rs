//! What a profile says about its process: the labels every profile carries.

use std::{
    borrow::Cow,
    collections::HashMap,
    ffi::OsString,
    os::unix::ffi::{OsStrExt, OsStringExt},
    path::{Path, PathBuf},
};

use allocbpf_images::{
    procfs::{self, MapsEntry},
    sealed_copy,
};
use allocbpf_runtime::Found;

/// A process as seen in `/proc` when it was first sampled (or last exec'd). Its names
/// are bytes, as the kernel gives them: they need not be UTF-8, and are made text
/// (lossily) only where text is needed ([`ProcessInfo::labels`], logs, metrics).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProcessInfo {
    /// Process id.
    pub pid: u32,
    /// When it started, in clock ticks after boot (`/proc/PID/stat` field 22; `None`
    /// if unknown). With the pid it names one process: exec keeps it, and a process
    /// that reuses the pid later has another ([`is_alive`]).
    pub start_time: Option<u64>,
    /// Command name (`/proc/PID/comm`).
    pub comm: OsString,
    /// Executable path as the process sees it (`/proc/PID/exe`); empty if it cannot be
    /// read.
    pub exe: PathBuf,
    /// GNU build id of the executable, hex (empty if none).
    pub exe_build_id: String,
    /// cgroup v2 path (`0::PATH` in `/proc/PID/cgroup`).
    pub cgroup: OsString,
    /// Container id found in the cgroup path (docker, containerd, CRI-O, podman).
    pub container_id: Option<String>,
    /// What the language runtimes found in it (its CPython version, its Go version and
    /// sampler...), once the engine has handed it to them (not read from procfs:
    /// [`ProcessInfo::read`] leaves it empty).
    pub runtimes: Vec<Found>,
}

impl ProcessInfo {
    /// Reads `pid`'s identity; `None` if it is gone (or a kernel thread: no
    /// executable). `maps`: its memory map, read by the caller. No name has to be
    /// UTF-8, and an executable link that cannot be read for another reason than its
    /// absence (`EACCES` without `CAP_SYS_PTRACE`) leaves `exe` empty: neither is a
    /// reason not to profile a process.
    pub fn read(pid: u32, maps: &[MapsEntry], build_ids: &mut BuildIdCache) -> Option<ProcessInfo> {
        // First: the names read after it are this process's or a later one's, which a
        // start time read after them could not tell.
        let start_time = start_time(pid)?;
        let comm = procfs::comm(pid)?;
        let exe = match std::fs::read_link(format!("/proc/{pid}/exe")) {
            Ok(exe) => exe,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return None,
            Err(_) => PathBuf::new(),
        };
        let cgroup = std::fs::read(format!("/proc/{pid}/cgroup"))
            .ok()
            .and_then(|text| cgroup_v2_path(&text))
            .unwrap_or_default();
        let exe_build_id = match exe.as_os_str().is_empty() {
            true => String::new(),
            false => build_ids.of(pid, maps, &exe),
        };
        Some(ProcessInfo {
            pid,
            start_time: Some(start_time),
            comm,
            exe,
            exe_build_id,
            container_id: container_id(&cgroup.to_string_lossy()),
            cgroup,
            runtimes: Vec::new(),
        })
    }

    /// The command name as text (lossily: bytes that are not UTF-8 become U+FFFD).
    pub fn comm_text(&self) -> Cow<'_, str> {
        self.comm.to_string_lossy()
    }

    /// The labels of this process's profiles, in a fixed order (names made text
    /// lossily).
    pub fn labels(&self, hostname: &str) -> Vec<(&'static str, String)> {
        let mut labels = vec![
            ("hostname", hostname.to_string()),
            ("pid", self.pid.to_string()),
            ("comm", self.comm_text().into_owned()),
            ("exe", self.exe.to_string_lossy().into_owned()),
            ("exe_build_id", self.exe_build_id.clone()),
            ("cgroup", self.cgroup.to_string_lossy().into_owned()),
        ];
        if let Some(id) = &self.container_id {
            labels.push(("container_id", id.clone()));
        }
        if !self.runtimes.is_empty() {
            let names: Vec<&str> = self.runtimes.iter().map(|found| found.runtime).collect();
            labels.push(("runtime", names.join(",")));
        }
        for found in &self.runtimes {
            labels.extend(found.labels.iter().cloned());
        }
        labels
    }
}

/// `pid`'s start time, in clock ticks after boot (`/proc/PID/stat` field 22); `None`
/// if it is gone.
pub fn start_time(pid: u32) -> Option<u64> {
    // Bytes: the command name in that line need not be UTF-8.
    let stat = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    parse_start_time(&stat)
}

/// The start time of a `/proc/PID/stat` line. The command name (field 2, in
/// parentheses) is the process's own choice and may hold spaces, parentheses and bytes
/// that are not UTF-8: the fields are counted after the line's last `)`.
pub fn parse_start_time(stat: &[u8]) -> Option<u64> {
    let after_name = stat.iter().rposition(|&b| b == b')')? + 1;
    // After the name: state (field 3) first, so starttime (field 22) is the 20th.
    let field = stat[after_name..]
        .split(u8::is_ascii_whitespace)
        .filter(|field| !field.is_empty())
        .nth(19)?;
    std::str::from_utf8(field).ok()?.parse().ok()
}

/// Whether the process with pid `pid` that started at `start_time` still exists: the
/// pid does, and a process that reused it since is not taken for it. Without a start
/// time, whether the pid exists.
pub fn is_alive(pid: u32, start_time: Option<u64>) -> bool {
    match start_time {
        Some(started) => self::start_time(pid) == Some(started),
        None => procfs::is_alive(pid),
    }
}

/// The unified hierarchy's path in a `/proc/PID/cgroup` text (bytes: a cgroup's name
/// need not be UTF-8; a `&str` does too).
pub fn cgroup_v2_path(text: impl AsRef<[u8]>) -> Option<OsString> {
    text.as_ref()
        .split(|&b| b == b'\n')
        .find_map(|line| line.strip_prefix(b"0::"))
        .map(|path| OsString::from_vec(path.to_vec()))
}

/// A 64-hex-digit container id in a cgroup path (`/docker/ID`,
/// `/system.slice/docker-ID.scope`, `.../cri-containerd-ID.scope`, `crio-ID`,
/// `libpod-ID`), the innermost if several.
pub fn container_id(cgroup: &str) -> Option<String> {
    cgroup.rsplit('/').find_map(|segment| {
        let segment = segment.strip_suffix(".scope").unwrap_or(segment);
        let id = segment.rsplit(['-', ':']).next()?;
        (id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit())).then(|| id.to_string())
    })
}

/// The machine's host name.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".to_string())
}

/// Build ids of executables by device and inode: a host runs the same few binaries in
/// many processes, and each is read once. Bounded (cleared when full).
#[derive(Debug, Default)]
pub struct BuildIdCache {
    ids: HashMap<(u64, u64), String>,
    /// Opens that failed for want of descriptors so far.
    descriptor_errors: u64,
}

/// Entries kept before the cache starts over.
const MAX_BUILD_IDS: usize = 4096;

impl BuildIdCache {
    /// Opens of executables that failed for want of descriptors so far.
    pub fn descriptor_errors(&self) -> u64 {
        self.descriptor_errors
    }

    /// The hex build id of `pid`'s executable `exe` (as `/proc/PID/exe` names it, and
    /// found in the process's memory map `maps`; empty if it has none or cannot be
    /// read). The file is the one the process maps, opened through map_files with
    /// `procfs::open_mapped`'s checks (never on a FUSE file system, whose daemon could
    /// stall the read), and keyed by the mapping's device and inode: nothing is looked
    /// up by path.
    pub fn of(&mut self, pid: u32, maps: &[MapsEntry], exe: &Path) -> String {
        // Compared as bytes: neither name need be UTF-8.
        let exe = exe.as_os_str().as_bytes();
        let Some(mapping) = maps.iter().find(|m| m.name.as_bytes() == exe) else {
            return String::new();
        };
        let key = (mapping.device, mapping.inode);
        if let Some(id) = self.ids.get(&key) {
            return id.clone();
        }
        let file = match procfs::open_mapped(pid, mapping) {
            Ok(file) => file,
            Err(error) => {
                self.descriptor_errors += u64::from(error.out_of_descriptors());
                return String::new();
            }
        };
        let id: String = sealed_copy::read_build_id(&file)
            .map(|id| id.iter().map(|b| format!("{b:02x}")).collect())
            .unwrap_or_default();
        if self.ids.len() >= MAX_BUILD_IDS {
            self.ids.clear();
        }
        self.ids.insert(key, id.clone());
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_ids_from_common_runtimes() {
        let id = "4f1c9a3b2d8e7f6a5b4c3d2e1f0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a";
        for path in [
            format!("/system.slice/docker-{id}.scope"),
            format!("/docker/{id}"),
            format!("/kubepods.slice/kubepods-pod1.slice/cri-containerd-{id}.scope"),
            format!("/machine.slice/libpod-{id}.scope/container"),
        ] {
            assert_eq!(container_id(&path).as_deref(), Some(id), "{path}");
        }
        assert_eq!(
            container_id("/user.slice/user-0.slice/session-1.scope"),
            None
        );
        assert_eq!(
            cgroup_v2_path("0::/system.slice/ssh.service\n").unwrap(),
            "/system.slice/ssh.service"
        );
        assert_eq!(
            cgroup_v2_path(b"1:name=x:/\n0::/a/\xff\xfe.scope\n")
                .unwrap()
                .as_bytes(),
            b"/a/\xff\xfe.scope"
        );
        assert_eq!(cgroup_v2_path("1:cpu:/a\n"), None);
    }

    /// A Python process's profiles say which CPython it runs, a Go one's which Go and
    /// that the Go runtime sampled it; others have no such labels.
    #[test]
    fn python_processes_are_labelled_with_their_version() {
        let mut info = ProcessInfo {
            pid: 7,
            ..ProcessInfo::default()
        };
        assert!(info
            .labels("host")
            .iter()
            .all(|(k, _)| *k != "python_version"));
        let found = |labels: &[(&'static str, &str)]| Found {
            runtime: labels[0].0,
            labels: labels.iter().map(|&(k, v)| (k, v.to_string())).collect(),
            source: None,
        };
        info.runtimes = vec![found(&[
            ("go_version", "go1.26.8"),
            ("sampler", "go_runtime"),
        ])];
        assert!(info
            .labels("h")
            .contains(&("sampler", "go_runtime".to_string())));
        info.runtimes = vec![found(&[("python_version", "3.11")])];
        assert!(info
            .labels("host")
            .contains(&("python_version", "3.11".to_string())));
    }

    /// Names that are not UTF-8 are kept as bytes, and made text lossily for labels.
    #[test]
    fn labels_of_names_that_are_not_utf8() {
        let info = ProcessInfo {
            pid: 7,
            comm: OsString::from_vec(b"x\xff\xfe\xc3bad".to_vec()),
            exe: PathBuf::from(OsString::from_vec(b"/tmp/x\xff\xfe\xc3bad".to_vec())),
            cgroup: OsString::from_vec(b"/a/\xff".to_vec()),
            ..ProcessInfo::default()
        };
        let labels = info.labels("host");
        assert_eq!(
            labels[2],
            ("comm", "x\u{fffd}\u{fffd}\u{fffd}bad".to_string())
        );
        assert_eq!(labels[3].1, "/tmp/x\u{fffd}\u{fffd}\u{fffd}bad");
        assert_eq!(labels[5].1, "/a/\u{fffd}");
        assert_eq!(info.comm.as_bytes(), b"x\xff\xfe\xc3bad");
    }

    /// The start time is counted after the last `)`: a command name with spaces,
    /// parentheses and bytes that are not UTF-8 does not shift it.
    #[test]
    fn start_times_after_hostile_names() {
        let rest = b" S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 3 0 98765 \
12345678 100 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n";
        let line = |name: &[u8]| [b"1234 (".as_slice(), name, b")", rest].concat();
        for name in [
            b"a".as_slice(),
            b"a b",
            b") (",
            b"x) (y\xff) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21",
            b"\xff\xfe)",
            b"",
        ] {
            assert_eq!(parse_start_time(&line(name)), Some(98765), "{name:?}");
        }
        assert_eq!(parse_start_time(b"1234 (a) S 1 2 3"), None);
        assert_eq!(parse_start_time(b"1234 a S"), None);
        assert_eq!(parse_start_time(b""), None);
    }

    /// A pid and a start time name one process: ours is alive, a process with our pid
    /// that started at another time is not.
    #[test]
    fn a_process_is_its_pid_and_start_time() {
        let pid = std::process::id();
        let started = start_time(pid).unwrap();
        assert_eq!(start_time(pid), Some(started));
        assert!(is_alive(pid, Some(started)));
        assert!(is_alive(pid, None));
        assert!(!is_alive(pid, Some(started + 1)));
        assert_eq!(start_time(u32::MAX), None);
        assert!(!is_alive(u32::MAX, None));
    }

    #[test]
    #[ignore = "needs root: opens files through /proc/PID/map_files (cargo xtask test runs it in its root lane)"]
    fn this_process_has_labels() {
        let mut cache = BuildIdCache::default();
        let pid = std::process::id();
        let me = ProcessInfo::read(pid, &procfs::read_maps(pid), &mut cache).unwrap();
        assert!(!me.exe.as_os_str().is_empty());
        assert_eq!(Some(me.comm.clone()), procfs::comm(pid));
        // This test binary has a build id (the linker's default), read through its
        // mapping.
        assert_eq!(me.exe_build_id.len(), 40, "{me:?}");
        assert_eq!(me.start_time, start_time(pid));
        assert!(me.start_time.is_some());
        let labels = me.labels("host");
        assert_eq!(labels[0], ("hostname", "host".to_string()));
        assert_eq!(labels[1].1, std::process::id().to_string());
    }
}
