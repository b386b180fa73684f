//! A process whose executable lives on a mount that is then lazily unmounted
//! (`umount -l`, `fusermount -u -z`): the mount leaves every mount table, and with it
//! the only record of what its file system is. FUSE, NFS or CIFS there would make
//! opening the file wait on a daemon or a server that may never answer; the device
//! (anonymous, major 0, as for tmpfs, overlayfs or btrfs) says nothing.
//!
//! The test uses a tmpfs (nothing stalls, so a regression shows as the file being read,
//! not as a hang): allocbpf must not read the executable on the detached mount, must
//! still profile that process through its C library, and must read the same executable
//! normally for a second process running it from a tmpfs still mounted.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use allocbpf_e2e::{
    compile_workload, one_profiler_at_a_time, require_root, run_allocbpf, scratch_dir, stacks_with,
    Workload,
};
use serde_json::Value;

/// A tmpfs mounted at `dir`; detached (`umount -l`) on drop.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path) -> Tmpfs {
        std::fs::create_dir_all(dir).unwrap();
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=64m,mode=0755", "tmpfs"])
            .arg(dir)
            .status()
            .unwrap();
        assert!(status.success(), "mount -t tmpfs {}", dir.display());
        Tmpfs(dir.to_path_buf())
    }

    /// `umount -l`: the mount leaves every table; running programs keep their files.
    fn detach(&self) {
        let status = Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status()
            .unwrap();
        assert!(status.success(), "umount -l {}", self.0.display());
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // Already detached, for one: "not mounted" is expected.
        let _ = Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .stderr(std::process::Stdio::null())
            .status();
    }
}

/// Copies `binary` to `dir/mountwl` (its comm, which the profiler filters on) and
/// starts it for 60 s.
fn start_from(binary: &Path, dir: &Path) -> Workload {
    let copy = dir.join("mountwl");
    std::fs::copy(binary, &copy).unwrap();
    Workload::start(&copy, &["60"]).unwrap()
}

/// The profile's stacks of process `pid`.
fn stacks_of(json: &Value, pid: u32) -> Vec<&Value> {
    json["stacks"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .filter(|s| s["pid"].as_u64() == Some(u64::from(pid)))
        .collect()
}

#[test]
fn an_executable_on_a_lazily_unmounted_file_system_is_never_read() {
    require_root();
    let _one = one_profiler_at_a_time();
    // Canonical: mountinfo prints the mount point without `..`.
    let scratch = std::fs::canonicalize(scratch_dir("hostile-mounts")).unwrap();
    let built = compile_workload("agentwl", &["-O1", "-g", "-fno-omit-frame-pointer"]).unwrap();
    let mounted = Tmpfs::mount(&scratch.join("mounted"));
    let detached = Tmpfs::mount(&scratch.join("detached"));
    let mut kept = start_from(&built, &mounted.0);
    let mut lost = start_from(&built, &detached.0);
    detached.detach();
    // The detached mount is in no table, its device neither: only the maps remember it.
    let mountinfo = std::fs::read_to_string(format!("/proc/{}/mountinfo", lost.pid)).unwrap();
    let point = format!(" {} ", detached.0.display());
    assert!(!mountinfo.contains(&point), "still mounted: {mountinfo}");
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", lost.pid)).unwrap();
    let exe = maps
        .lines()
        .find(|l| l.ends_with("/mountwl") || l.ends_with("/mountwl (deleted)"))
        .expect("the workload maps its executable");
    let device = exe.split_whitespace().nth(3).unwrap();
    assert!(device.starts_with("00:"), "tmpfs is not anonymous: {exe}");

    let out = scratch.join("profile.json");
    let args = [
        "--comm",
        "^mountwl$",
        "--duration",
        "2s",
        "--format",
        "json",
        "-v",
    ];
    let finished = run_allocbpf(
        &[&args[..], &["--output", out.to_str().unwrap()]].concat(),
        Duration::from_secs(90),
    );
    let _ = kept.child.kill();
    let _ = lost.child.kill();
    let finished = finished.unwrap();
    assert_eq!(finished.code, Some(0), "{}", finished.stderr);
    let json: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    // Both are profiled: their C library is on a mounted file system.
    let kept_stacks = stacks_of(&json, kept.pid);
    let lost_stacks = stacks_of(&json, lost.pid);
    assert!(!kept_stacks.is_empty(), "pid {} not sampled", kept.pid);
    assert!(!lost_stacks.is_empty(), "pid {} not sampled", lost.pid);
    // The executable on the mounted tmpfs is read (its allocation site is named) ...
    let site = "agentwl_alloc_site";
    let named = |pid: u32| {
        stacks_with(&json, site)
            .iter()
            .any(|s| s["pid"].as_u64() == Some(u64::from(pid)))
    };
    assert!(named(kept.pid), "{site} not named for pid {}", kept.pid);
    // ... the same bytes on the detached one never are: nothing names its functions.
    assert!(
        !named(lost.pid),
        "the executable on the detached mount was read: {:#?}",
        lost_stacks
    );
    drop(detached);
    drop(mounted);
}
