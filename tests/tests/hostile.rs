//! A process that turns the path of its own executable into a trap must not stop the
//! profiler, nor make it open anything but the file the process maps.
//!
//! `workloads/swapexe.c` unlinks its executable and puts at that path a FIFO (opening
//! it blocks until a writer comes: the old agent hung there for good), a symlink to
//! `/dev/zero` (a read without end) or a symlink to the C library (the old agent then
//! took libc for this file and probed it a second time). System-wide allocbpf must
//! finish on time, profile the process through its real mappings, and never take the
//! path for the file.
//!
//! A process run from a FUSE file system whose daemon stops answering is the same trap
//! one level down: every open and read of its files waits on that daemon.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command},
    time::{Duration, Instant},
};

use allocbpf_e2e::{compile_workload, require_root, run_allocbpf, scratch_dir, Workload};
use serde_json::Value;

/// A private copy of the hostile binary (it deletes its own executable).
fn hostile_copy(mode: &str) -> PathBuf {
    let built = compile_workload("swapexe", &["-O1"]).unwrap();
    let copy = scratch_dir(&format!("hostile-{mode}")).join("swapexe");
    std::fs::copy(&built, &copy).unwrap();
    copy
}

/// Runs system-wide allocbpf for 2 s against a `swapexe MODE` process; checks that it
/// ends in time, that the process is profiled, and that its swapped path is never
/// taken for an allocator.
fn profile_hostile(mode: &str) {
    require_root();
    let binary = hostile_copy(mode);
    let mut workload = Workload::start(&binary, &[mode]).unwrap();
    workload
        .stdout
        .wait_for("swapped", Duration::from_secs(10))
        .unwrap();
    let out = binary.with_file_name("profile.json");
    let finished = profile_comm("^swapexe$", &out).unwrap();
    assert_eq!(finished.code, Some(0), "{}", finished.stderr);
    // The swapped path is never examined as a file: no image, no probe named after it.
    let path = binary.display().to_string();
    for line in finished.stderr.lines() {
        assert!(
            !(line.contains(&path) && (line.contains("probed at") || line.contains("entries)"))),
            "the swapped path was taken for an allocator: {line}"
        );
    }
    assert_sampled(&out, workload.pid);
}

/// Runs system-wide allocbpf with `-v` for 2 s on the processes whose comm matches
/// `comm`, into the JSON profile `out`. Start-up (examining every process's files) plus
/// 2 s must fit in 90 s: a hang is a failure.
fn profile_comm(comm: &str, out: &Path) -> anyhow::Result<allocbpf_e2e::Finished> {
    let args = ["--comm", comm, "--duration", "2s", "--format", "json", "-v"];
    let out = out.to_str().unwrap();
    run_allocbpf(
        &[&args[..], &["--output", out]].concat(),
        Duration::from_secs(90),
    )
}

/// The JSON profile at `out` has samples of process `pid`.
fn assert_sampled(out: &Path, pid: u32) {
    let json: Value = serde_json::from_slice(&std::fs::read(out).unwrap()).unwrap();
    let text = json.to_string();
    assert!(
        text.contains(&format!("{pid}")),
        "pid {pid} not in the profile: {text:.2000}"
    );
    let samples = json["totals"]["samples"].as_u64().unwrap_or(0);
    assert!(samples > 0, "no sample: {:#}", json["totals"]);
}

#[test]
fn an_executable_swapped_for_a_fifo_does_not_hang_the_profiler() {
    profile_hostile("fifo");
}

#[test]
fn an_executable_swapped_for_a_symlink_to_dev_zero_is_not_read() {
    profile_hostile("zero");
}

#[test]
fn an_executable_swapped_for_a_symlink_to_libc_is_not_taken_for_libc() {
    profile_hostile("libc");
}

/// A bindfs (FUSE) mount of `source` at `mount`, its daemon our child; unmounted on drop.
struct FuseMount {
    daemon: Child,
    mount: PathBuf,
}

impl FuseMount {
    fn bindfs(source: &Path, mount: &Path) -> FuseMount {
        std::fs::create_dir_all(mount).unwrap();
        let daemon = Command::new("bindfs")
            .arg("-f")
            .arg(source)
            .arg(mount)
            .spawn()
            .expect("bindfs is installed by the test setup");
        let mounted = FuseMount {
            daemon,
            mount: mount.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        let target = format!(" {} ", mount.display());
        while !std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .any(|l| l.contains(&target) && l.contains(" - fuse"))
        {
            assert!(Instant::now() < deadline, "bindfs did not mount");
            std::thread::sleep(Duration::from_millis(50));
        }
        mounted
    }

    /// Stops the daemon: from now on, every request to the file system waits.
    fn stall(&self) {
        // SAFETY: a plain signal to our own child.
        unsafe { libc::kill(self.daemon.id() as i32, libc::SIGSTOP) };
    }
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        // SAFETY: as in `stall`.
        unsafe { libc::kill(self.daemon.id() as i32, libc::SIGCONT) };
        let _ = Command::new("umount").arg("-l").arg(&self.mount).status();
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
    }
}

/// The executable of a running process lives on a FUSE file system whose daemon then
/// stops: opening or reading that file would wait as long as the daemon likes (the old
/// agent would have hung in open() at its first look at the process). allocbpf finds
/// the file system in the process's mountinfo and never opens the file: it finishes on
/// time and profiles the process through its C library.
#[test]
fn an_executable_on_a_stalled_fuse_file_system_is_never_opened() {
    require_root();
    // Canonical: mountinfo prints the mount point without `..`.
    let scratch = std::fs::canonicalize(scratch_dir("hostile-fuse")).unwrap();
    let source = scratch.join("src");
    std::fs::create_dir_all(&source).unwrap();
    let built = compile_workload("agentwl", &["-O1"]).unwrap();
    std::fs::copy(&built, source.join("fusewl")).unwrap();
    let fuse = FuseMount::bindfs(&source, &scratch.join("mnt"));
    let mut workload = Workload::start(&fuse.mount.join("fusewl"), &["60"]).unwrap();
    fuse.stall();
    let out = scratch.join("profile.json");
    let finished = profile_comm("^fusewl$", &out);
    let _ = workload.child.kill();
    let finished = finished.unwrap();
    assert_eq!(finished.code, Some(0), "{}", finished.stderr);
    assert_sampled(&out, workload.pid);
}
