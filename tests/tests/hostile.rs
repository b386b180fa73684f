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

    /// Lets the daemon answer again.
    fn resume(&self) {
        // SAFETY: as in `stall`.
        unsafe { libc::kill(self.daemon.id() as i32, libc::SIGCONT) };
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

/// `major:minor/inode` as allocbpf's logs print an image's key.
fn image_key(path: &Path) -> String {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).unwrap();
    let dev = meta.dev();
    format!(
        "{:x}:{:x}/{}",
        libc::major(dev),
        libc::minor(dev),
        meta.ino()
    )
}

/// The hostile process is an allocator itself (its own malloc) and swaps its path
/// between itself and a symlink to the C library every millisecond while allocbpf
/// discovers, examines and attaches it. Whatever the timing, the probes must go to the
/// file the process maps: its key is the one attached, libc is attached once (for the
/// other processes), and the process is sampled, which only its own probed malloc can
/// do (libc's malloc never runs in it).
#[test]
fn an_executable_swapped_with_libc_during_attach_is_probed_as_itself() {
    require_root();
    let built = compile_workload("swapexe", &["-O1", "-DOWN_MALLOC"]).unwrap();
    let binary = scratch_dir("hostile-race").join("swapexe");
    let _ = std::fs::remove_file(&binary);
    std::fs::copy(&built, &binary).unwrap();
    let own_key = image_key(&binary);
    let mut workload = Workload::start(&binary, &["race"]).unwrap();
    workload
        .stdout
        .wait_for("swapped", Duration::from_secs(10))
        .unwrap();
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", workload.pid)).unwrap();
    let libc = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.ends_with("/libc.so.6"))
        .expect("the workload maps glibc");
    let libc_key = image_key(Path::new(libc));
    let out = binary.with_file_name("profile.json");
    let finished = profile_comm("^swapexe$", &out);
    let _ = workload.child.kill();
    let finished = finished.unwrap();
    assert_eq!(finished.code, Some(0), "{}", finished.stderr);
    let attached: Vec<&str> = finished
        .stderr
        .lines()
        .filter(|l| l.contains("attached") && l.contains(" probes to "))
        .collect();
    assert!(
        attached.iter().any(|l| l.contains(&format!("({own_key})"))),
        "the process's own file ({own_key}) was not attached: {attached:#?}"
    );
    let libc_attaches = attached
        .iter()
        .filter(|l| l.contains(&format!("({libc_key})")))
        .count();
    assert_eq!(libc_attaches, 1, "libc ({libc_key}): {attached:#?}");
    assert_sampled(&out, workload.pid);
}

/// A process maps an 8 GiB sparse file and a 400 MiB one that starts like an ELF file,
/// both executable. allocbpf examines every executable mapping: it must refuse the
/// first by size and the second unread (its headers lead nowhere), finish on time,
/// profile the process through its libc, and its peak memory must stay far below what
/// reading either would take.
#[test]
fn huge_mapped_files_are_neither_read_nor_held() {
    require_root();
    let dir = scratch_dir("hostile-huge");
    // Under its own name: the filter below matches the command name.
    let binary = dir.join("hugemap");
    std::fs::copy(compile_workload("hugemap", &["-O1"]).unwrap(), &binary).unwrap();
    let mut workload = Workload::start(&binary, &[dir.to_str().unwrap()]).unwrap();
    workload
        .stdout
        .wait_for("mapped", Duration::from_secs(10))
        .unwrap();
    let out = dir.join("profile.json");
    let args = [
        "--comm",
        "^hugemap$",
        "--duration",
        "2s",
        "--format",
        "json",
        "-vv",
    ];
    let profiler =
        allocbpf_e2e::Profiler::spawn(&[&args[..], &["--output", out.to_str().unwrap()]].concat())
            .unwrap();
    let pid = profiler.child.id();
    let watcher = std::thread::spawn(move || {
        let mut peak = 0;
        while let Some(now) = allocbpf_e2e::status_bytes(pid, "VmHWM") {
            peak = peak.max(now);
            std::thread::sleep(Duration::from_millis(20));
        }
        peak
    });
    let finished = profiler.finish(Duration::from_secs(90));
    let _ = workload.child.kill();
    let finished = finished.unwrap();
    let peak = watcher.join().unwrap();
    for file in ["huge.bin", "fake.so"] {
        let _ = std::fs::remove_file(dir.join(file));
    }
    assert_eq!(finished.code, Some(0), "{}", finished.stderr);
    assert_sampled(&out, workload.pid);
    // The agent's own footprint is ~60 MiB; reading the 400 MiB file would add 400.
    assert!(peak < 200 << 20, "peak resident memory {} MiB", peak >> 20);
}

/// A process maps a file of a FUSE file system, untouched, and the daemon stops: a read
/// of that memory would wait in the kernel until the daemon answers, and it is the
/// process that chooses which addresses runtimes read (a structure's pointer). The read
/// comes back within its deadline, the process is set aside (its next read refused at
/// once) while other processes are read as before, and once the daemon answers again
/// the stuck read returns and the process is read again.
#[test]
fn memory_of_a_file_on_a_stalled_fuse_file_system_is_read_within_a_deadline() {
    use allocbpf_images::memory::{deadline, ProcessMemory};
    require_root();
    let scratch = std::fs::canonicalize(scratch_dir("hostile-fuse-memory")).unwrap();
    let source = scratch.join("src");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(source.join("data.bin"), vec![0x5au8; 1 << 20]).unwrap();
    let fuse = FuseMount::bindfs(&source, &scratch.join("mnt"));
    let mapped = fuse.mount.join("data.bin");
    // Workloads print their pid first.
    let script = "import mmap, os, sys, time\n\
                  print(os.getpid(), flush=True)\n\
                  f = open(sys.argv[1], 'rb')\n\
                  m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n\
                  print('mapped', flush=True)\n\
                  time.sleep(120)\n";
    let mut target = Workload::start(
        Path::new("/usr/bin/python3"),
        &["-c", script, mapped.to_str().unwrap()],
    )
    .unwrap();
    target
        .stdout
        .wait_for("mapped", Duration::from_secs(20))
        .unwrap();
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", target.pid)).unwrap();
    let line = maps
        .lines()
        .find(|l| l.ends_with(mapped.to_str().unwrap()))
        .expect("the file is mapped");
    let start = u64::from_str_radix(line.split('-').next().unwrap(), 16).unwrap();
    let address = start + 0x8000;
    fuse.stall();

    let memory = ProcessMemory::new(target.pid);
    let mut word = [0u8; 8];
    let started = Instant::now();
    let error = memory
        .read(address, &mut word)
        .expect_err("the daemon is stopped");
    let waited = started.elapsed();
    assert_eq!(error.kind(), std::io::ErrorKind::TimedOut, "{error}");
    assert!(waited < deadline::READ_DEADLINE * 8, "{waited:?}");

    // Set aside: refused at once, its anonymous memory too.
    let started = Instant::now();
    let error = memory.read(address, &mut word).expect_err("set aside");
    assert_eq!(error.kind(), std::io::ErrorKind::WouldBlock, "{error}");
    assert!(
        started.elapsed() < deadline::READ_DEADLINE,
        "refused at once"
    );
    assert_eq!(deadline::figures().stuck_now, 1);

    // Other processes are read as before.
    let value: u64 = 0x0123_4567_89ab_cdef;
    let own = ProcessMemory::new(std::process::id());
    assert_eq!(own.u64(&value as *const u64 as u64).unwrap(), value);

    // The daemon answers: the stuck read returns, and the process is read again.
    fuse.resume();
    let deadline = Instant::now() + Duration::from_secs(20);
    while memory.read(address, &mut word).is_err() {
        assert!(
            Instant::now() < deadline,
            "still set aside after the daemon answered"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(word, [0x5a; 8]);
    assert_eq!(deadline::figures().stuck_now, 0);
    let _ = target.child.kill();
}
