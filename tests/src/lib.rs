//! Harness for allocbpf's end-to-end tests: compiles the C workloads in `workloads/`,
//! runs them, and runs the real `allocbpf` binary against them through real uprobes.
//!
//! The binary is `$ALLOCBPF_BIN`, or `target/release/allocbpf` (`cargo xtask test` builds
//! it first). The tests need root: without it they fail, they never skip.

pub mod accuracy;
pub mod agent;
pub mod allocators;
pub mod bench;
pub mod forge;
pub mod jvm;
pub mod node;
pub mod otelcol;
pub mod page;
pub mod prometheus;
pub mod protojson;
pub mod pyroscope;
pub mod simulate;
pub mod sites;
pub mod slow_proxy;
pub mod stored;
pub mod stores;
pub mod truth;

use std::{
    io::Read,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;

pub use allocbpf_harness::{workload_source, workspace_root, Lines, Workload};

/// The allocbpf binary under test.
pub fn allocbpf_bin() -> PathBuf {
    std::env::var_os("ALLOCBPF_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target/release/allocbpf"))
}

/// A memory figure of process `pid` from `/proc/PID/status`, in bytes (`field`:
/// `VmRSS`, `VmHWM`...); `None` once the process is gone.
pub fn status_bytes(pid: u32, field: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?
        .trim()
        .trim_end_matches(" kB")
        .parse::<u64>()
        .ok()
        .map(|kb| kb * 1024)
}

/// Fails unless the tests run as root (they load eBPF programs).
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "end-to-end tests attach real uprobes: run them as root (cargo xtask test)"
    );
    assert!(
        allocbpf_bin().exists(),
        "{} is missing: build it first (cargo xtask test does)",
        allocbpf_bin().display()
    );
}

/// A scratch directory under `target/e2e`, unique per test.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = workspace_root()
        .join("target/e2e")
        .join(format!("{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Compiles `workloads/<name>.c` with `flags` into the scratch area; returns the binary.
pub fn compile_workload(name: &str, flags: &[&str]) -> Result<PathBuf> {
    compile_source(&format!("{name}.c"), "gcc", flags)
}

/// Compiles `workloads/<file>` with `compiler` (gcc, g++ or rustc) and `flags`, into
/// `target/e2e/bin` under a name that says how.
pub fn compile_source(file: &str, compiler: &str, flags: &[&str]) -> Result<PathBuf> {
    let name = file.split('.').next().unwrap_or(file);
    let tag: String = flags
        .join("")
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .collect();
    let binary = workspace_root()
        .join("target/e2e/bin")
        .join(format!("{name}-{compiler}-{tag}"));
    allocbpf_harness::compile(&workload_source(file), compiler, flags, &binary)?;
    Ok(binary)
}

/// Stops a server the tests started: SIGTERM, then waits up to `timeout` for a clean
/// exit; kills it after that. `log` says what it wrote, for the error.
pub fn terminate(
    mut child: Child,
    name: &str,
    timeout: Duration,
    log: impl Fn() -> String,
) -> Result<()> {
    let pid = libc::pid_t::try_from(child.id()).context("pid")?;
    // SAFETY: kill has no memory preconditions; the pid is our unreaped child.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            ensure!(
                status.success(),
                "{name} exited with {status} on SIGTERM: {}",
                log()
            );
            return Ok(());
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "{name} did not stop within {timeout:?} of SIGTERM: {}",
                log()
            );
        }
        thread::sleep(Duration::from_millis(25));
    }
}

/// A running allocbpf.
pub struct Profiler {
    /// The process.
    pub child: Child,
    /// Its stderr, line by line.
    pub stderr: Lines,
}

/// How an allocbpf run ended.
#[derive(Debug)]
pub struct Finished {
    /// Exit code.
    pub code: Option<i32>,
    /// Everything it wrote to stdout.
    pub stdout: String,
    /// Everything it wrote to stderr.
    pub stderr: String,
}

impl Profiler {
    /// Starts allocbpf with `args` and waits until its probes are attached.
    pub fn attach(args: &[&str]) -> Result<Profiler> {
        let mut profiler = Self::spawn(args)?;
        profiler
            .stderr
            .wait_for("allocbpf: profiling pid", Duration::from_secs(30))?;
        Ok(profiler)
    }

    /// Starts allocbpf with `args` without waiting.
    pub fn spawn(args: &[&str]) -> Result<Profiler> {
        let mut child = Command::new(allocbpf_bin())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting allocbpf")?;
        let stderr = Lines::spawn(child.stderr.take().unwrap());
        Ok(Profiler { child, stderr })
    }

    /// Waits for allocbpf to exit (killing it after `timeout`).
    pub fn finish(mut self, timeout: Duration) -> Result<Finished> {
        let mut stdout_pipe = self.child.stdout.take().unwrap();
        let reader = thread::spawn(move || {
            let mut s = String::new();
            let _ = stdout_pipe.read_to_string(&mut s);
            s
        });
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(status) = self.child.try_wait()? {
                break status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                bail!(
                    "allocbpf did not exit within {timeout:?}; stderr: {:?}",
                    self.stderr.seen
                );
            }
            thread::sleep(Duration::from_millis(20));
        };
        let stderr = self.stderr.rest(Duration::from_secs(2));
        Ok(Finished {
            code: status.code(),
            stdout: reader.join().unwrap_or_default(),
            stderr,
        })
    }
}

/// Runs allocbpf to completion with `args` (for argument and error tests).
pub fn run_allocbpf(args: &[&str], timeout: Duration) -> Result<Finished> {
    Profiler::spawn(args)?.finish(timeout)
}

/// Profiles the running process `pid` with `args` (which must stop it by themselves,
/// e.g. `--duration`) into a JSON profile at `out`; fails unless allocbpf exits 0.
pub fn profile_running_json(pid: u32, args: &[&str], out: &Path) -> Result<(Value, Finished)> {
    let pid = pid.to_string();
    let mut all = vec!["--pid", pid.as_str()];
    all.extend_from_slice(args);
    all.extend_from_slice(&[
        "--format",
        "json",
        "--output",
        out.to_str().context("path")?,
    ]);
    let finished = run_allocbpf(&all, Duration::from_secs(60))?;
    ensure!(
        finished.code == Some(0),
        "allocbpf failed: {}",
        finished.stderr
    );
    let json = serde_json::from_slice(&std::fs::read(out)?)?;
    Ok((json, finished))
}

impl Finished {
    /// allocbpf's start-up line (`allocbpf: profiling pid ... through ...`).
    pub fn startup_line(&self) -> &str {
        self.stderr
            .lines()
            .find(|l| l.starts_with("allocbpf: profiling pid"))
            .unwrap_or_default()
    }
}

/// The sites workload (`workloads/sites.c`) built with frame pointers and debug info.
pub fn sites_binary() -> PathBuf {
    compile_workload("sites", &["-O1", "-g", "-fno-omit-frame-pointer"]).unwrap()
}

/// Starts `binary`, attaches allocbpf to it with `args` (after `--pid PID`), lets the
/// workload run to completion, and returns how allocbpf, stopped by the target's exit,
/// finished. Fails if either fails.
pub fn profile_to_completion(binary: &Path, args: &[&str]) -> Result<Finished> {
    profile_workload(binary, &[], args)
}

/// [`profile_to_completion`] with arguments for the workload too.
pub fn profile_workload(binary: &Path, workload_args: &[&str], args: &[&str]) -> Result<Finished> {
    profile_workload_env(binary, workload_args, &[], args)
}

/// [`profile_workload`] with extra environment variables for the workload
/// (`LD_PRELOAD` of another allocator).
pub fn profile_workload_env(
    binary: &Path,
    workload_args: &[&str],
    env: &[(&str, &str)],
    args: &[&str],
) -> Result<Finished> {
    let mut workload = Workload::start_env(binary, workload_args, env)?;
    let pid = workload.pid.to_string();
    let mut all = vec!["--pid", pid.as_str()];
    all.extend_from_slice(args);
    let profiler = Profiler::attach(&all)?;
    workload.go()?;
    workload.wait(Duration::from_secs(120))?;
    let finished = profiler.finish(Duration::from_secs(60))?;
    ensure!(
        finished.code == Some(0),
        "allocbpf failed: {}",
        finished.stderr
    );
    ensure!(
        finished.stderr.contains("target exited"),
        "not stopped by the target's exit: {}",
        finished.stderr
    );
    Ok(finished)
}

/// The stacks of a `--format json` profile whose frames include `function`.
pub fn stacks_with<'a>(json: &'a Value, function: &str) -> Vec<&'a Value> {
    json["stacks"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .filter(|s| {
            s["frames"]
                .as_array()
                .is_some_and(|frames| frames.iter().any(|f| f == function))
        })
        .collect()
}

/// Sum of the numeric `field` over `stacks` (JSON; a missing value counts 0).
pub fn sum_field(stacks: &[&Value], field: &str) -> f64 {
    stacks
        .iter()
        .map(|s| s[field].as_f64().unwrap_or(0.0))
        .sum()
}

/// The summed `estimated_bytes` of `stacks`.
pub fn estimated_bytes(stacks: &[&Value]) -> f64 {
    sum_field(stacks, "estimated_bytes")
}

/// Runs `go tool pprof ARGS PROFILE` and returns its stdout; fails on a non-zero exit.
pub fn go_pprof(args: &[&str], profile: &Path, scratch: &Path) -> String {
    // Debian's Go (what `cargo xtask setup` installs) ships `pprof` built. A newer Go
    // found first on PATH (Go 1.24+) builds it on demand: ~25 s into an empty cache,
    // long enough to outlive the workload of the test that asked. So Debian's go when
    // it is there, and one build cache for every call otherwise.
    let go = ["/usr/bin/go"]
        .into_iter()
        .find(|path| Path::new(path).exists())
        .unwrap_or("go");
    let cache = workspace_root().join("target/e2e/gocache");
    let output = Command::new(go)
        .arg("tool")
        .arg("pprof")
        .args(args)
        .arg(profile)
        .env("PPROF_TMPDIR", scratch)
        .env("HOME", scratch)
        .env("GOCACHE", &cache)
        .output()
        .expect("go tool pprof (apt-get install golang-go)");
    assert!(
        output.status.success(),
        "go tool pprof {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The GNU build id of an ELF file, as `readelf -n` prints it (lowercase hex).
pub fn gnu_build_id(binary: &Path) -> String {
    let output = Command::new("readelf")
        .arg("-n")
        .arg(binary)
        .output()
        .unwrap();
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .find_map(|l| l.trim().strip_prefix("Build ID: ").map(str::to_string))
        .expect("gcc links a GNU build id")
}

/// Attaches allocbpf to `workload` at 64 KiB with JSON output to `out` (waits until
/// its probes are attached).
pub fn attach_json(workload: &Workload, out: &Path) -> Result<Profiler> {
    let pid = workload.pid.to_string();
    Profiler::attach(&[
        "--pid",
        &pid,
        "--rate",
        "64KiB",
        "--format",
        "json",
        "--output",
        out.to_str().context("path")?,
    ])
}

/// Serializes the tests of one test binary that profile fast allocators and check
/// derived bounds, which need every sample: several such profilers with their
/// workloads at once on a 2-core host starve the ring readers (seen: 60-787 ring-buffer
/// drops in 3 of 7 runs of `profile.rs` and `allocators.rs`). Hold the guard for the
/// whole test.
pub fn one_profiler_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// A Debian root made with `debootstrap --variant=minbase` for `suite`, with the
/// packages `include` (a container's view: its own libc and programs), made once under
/// `target/e2e/roots/` and kept for later runs. Serialized across test processes by a
/// lock file; a root left half-made by an interrupted run is made again.
pub fn debian_root(suite: &str, include: &[&str]) -> Result<PathBuf> {
    let roots = workspace_root().join("target/e2e/roots");
    std::fs::create_dir_all(&roots)?;
    let root = roots.join(suite);
    let done = roots.join(format!("{suite}.done"));
    let lock = std::fs::File::create(roots.join(format!("{suite}.lock")))?;
    // SAFETY: flock on a descriptor we own; released when `lock` is dropped.
    ensure!(
        unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) } == 0,
        "locking the {suite} root"
    );
    if done.exists() {
        return Ok(root);
    }
    let _ = std::fs::remove_dir_all(&root);
    let status = Command::new("debootstrap")
        .args([
            "--variant=minbase",
            &format!("--include={}", include.join(",")),
            suite,
            root.to_str().context("path")?,
            "http://deb.debian.org/debian",
        ])
        .stdout(Stdio::null())
        .status()
        .context("debootstrap (apt-get install debootstrap; cargo xtask setup installs it)")?;
    ensure!(status.success(), "debootstrap {suite} failed: {status}");
    std::fs::write(&done, b"")?;
    Ok(root)
}

/// Profiles `workload` (by `pid`, its host pid) into a JSON profile at `out` from its
/// go to its exit: the profile, allocbpf's run (which must succeed) and what the
/// workload printed.
pub fn profile_from_go(
    mut workload: Workload,
    pid: u32,
    out: &Path,
) -> Result<(Value, Finished, String)> {
    let pid = pid.to_string();
    let output_path = out.to_str().context("path")?;
    let profiler = Profiler::attach(&["--pid", &pid, "--format", "json", "--output", output_path])?;
    workload.go()?;
    workload.wait(Duration::from_secs(180))?;
    let output = workload.stdout.rest(Duration::from_secs(5));
    let finished = profiler.finish(Duration::from_secs(60))?;
    ensure!(finished.code == Some(0), "{}", finished.stderr);
    let profile = serde_json::from_slice(&std::fs::read(out)?)?;
    Ok((profile, finished, output))
}
