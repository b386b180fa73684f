//! What the bench binaries (`src/bin/`: soak, burst, agent_cost) share.

use std::{
    fmt::Write as _,
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

/// Writes `dir/big.c`: `functions` small functions that each malloc and free, a file
/// whose compile keeps cc1 allocating (gcc -O2 of 3,000 takes ~1.8 s here).
pub fn write_malloc_heavy_source(dir: &Path, functions: usize) -> Result<()> {
    let mut source = String::from("#include <stdlib.h>\n");
    for i in 0..functions {
        let _ = writeln!(
            source,
            "int f{i}(int x) {{ int *p = malloc(sizeof(int) * {}); p[0] = x; int r = p[0] * {i}; free(p); return r; }}",
            i + 1
        );
    }
    std::fs::write(dir.join("big.c"), source).context("writing big.c")
}

/// What one compile of `big.c` took: its wall time, and the CPU time of gcc and of
/// everything it ran (cc1, as), user and system, from `wait4`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CompileTimes {
    /// Wall time.
    pub wall: Duration,
    /// User CPU time.
    pub user: Duration,
    /// System CPU time: the kernel's work for the compile, probe traps included.
    pub system: Duration,
}

impl CompileTimes {
    /// System time per second of user time. Probe traps run in the kernel, so probing
    /// raises it by about the traps' share of the compile's own work (plus the
    /// compile's own system time, ~5% here). A slower or busier host stretches user
    /// and system time alike, so unlike wall time the ratio holds still on a noisy VM.
    pub fn system_per_user(&self) -> f64 {
        self.system.as_secs_f64() / self.user.as_secs_f64().max(1e-9)
    }

    /// The wall times of `compiles`, seconds.
    pub fn walls(compiles: &[Self]) -> Vec<f64> {
        compiles.iter().map(|c| c.wall.as_secs_f64()).collect()
    }

    /// The [`system_per_user`](Self::system_per_user) of each of `compiles`.
    pub fn systems_per_user(compiles: &[Self]) -> Vec<f64> {
        compiles.iter().map(Self::system_per_user).collect()
    }
}

/// Runs `gcc -O2 -c big.c` in `dir` (see [`write_malloc_heavy_source`]) and times it.
pub fn compile_big(dir: &Path) -> Result<CompileTimes> {
    let started = Instant::now();
    let child = Command::new("gcc")
        .args(["-O2", "-c", "big.c", "-o", "big.o"])
        .current_dir(dir)
        .spawn()
        .context("gcc (cargo xtask setup installs it)")?;
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value for wait4 to overwrite.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // wait4 rather than `Child::wait`: it also gives the CPU time of gcc and of the
    // children it waited for. `child` is then dropped unwaited, which std allows.
    let waited = loop {
        // SAFETY: pid is our child; status and usage are valid for writes.
        let waited = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
        if waited == -1 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
        {
            continue;
        }
        break waited;
    };
    let wall = started.elapsed();
    drop(child);
    if waited != pid {
        bail!("waiting for gcc: {}", std::io::Error::last_os_error());
    }
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        bail!("gcc failed (wait status {status:#x})");
    }
    let time = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
    };
    Ok(CompileTimes {
        wall,
        user: time(usage.ru_utime),
        system: time(usage.ru_stime),
    })
}

/// The `--rounds N` argument of a bench binary, `default` without it.
pub fn rounds_arg(default: usize) -> Result<usize> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == "--rounds")
        .and_then(|i| args.get(i + 1))
        .map_or(Ok(default), |r| r.parse())
        .context("--rounds")
}

pub use allocbpf_profile::estimate::median;

/// User + system CPU seconds of process `pid` so far (`/proc/PID/stat`).
pub fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after_name = stat.rfind(')').context("stat")? + 2;
    let fields: Vec<&str> = stat[after_name..].split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>()? + fields[12].parse::<f64>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok(ticks / hz)
}

/// `allocbpf --pid PID ARGS...` once it says it profiles, its stdout discarded; its
/// stderr is read on (and kept alive) while it runs.
pub fn attach_profiler(pid: u32, args: &[&str]) -> Result<(std::process::Child, crate::Lines)> {
    let mut child = Command::new(crate::allocbpf_bin())
        .args(["--pid", &pid.to_string()])
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let mut stderr = crate::Lines::spawn(child.stderr.take().context("piped")?);
    stderr.wait_for("allocbpf: profiling pid", Duration::from_secs(60))?;
    Ok((child, stderr))
}

/// One run of a runtime's workload: bytes allocated per second of its loop, the loop's
/// seconds, and with `--pid`, allocbpf's CPU seconds over it.
pub type Run = (f64, f64, f64);

/// Starts a runtime's workload (waiting for its go), and runs it to its end once
/// `before_go` has been called with its pid: the figures of its [`Run`] less the
/// profiler's CPU, and its output.
pub trait Workloads {
    /// Starts one run's workload.
    fn start(&mut self) -> Result<crate::Workload>;
    /// Bytes the run allocated and its loop's seconds, from its output.
    fn figures(&self, output: &str) -> Result<(f64, f64)>;
}

/// One run of `workloads`: bare, or under `allocbpf --pid` (its CPU counted from the go
/// on, its start, which reads the runtime's files, being not the loop's).
pub fn run_once(workloads: &mut dyn Workloads, by_pid: bool) -> Result<Run> {
    let mut workload = workloads.start()?;
    let profiler = match by_pid {
        true => Some(attach_profiler(workload.pid, &["--output", "/dev/null"])?),
        false => None,
    };
    let cpu_at_go = match &profiler {
        Some((child, _)) => cpu_seconds(child.id())?,
        None => 0.0,
    };
    workload.go()?;
    workload
        .stdout
        .wait_for("loop_ns", Duration::from_secs(600))?;
    let output = workload.stdout.seen.join("\n");
    let (bytes, seconds) = workloads.figures(&output)?;
    let mut cpu = 0.0;
    if let Some((child, _stderr)) = &profiler {
        cpu = cpu_seconds(child.id())? - cpu_at_go;
    }
    workload.wait(Duration::from_secs(60))?;
    if let Some((mut child, _)) = profiler {
        child.wait()?;
    }
    Ok((bytes / seconds, seconds, cpu))
}

/// Runs `workloads` `rounds` times bare and under `--pid` (alternating), then under one
/// `allocbpf agent` at its defaults, and prints the medians of their throughput, their
/// ratios to bare and the profiler's CPU per second of the loop under `title`.
pub fn compare_runs(
    title: &str,
    scratch: &std::path::Path,
    rounds: usize,
    workloads: &mut dyn Workloads,
) -> Result<()> {
    let (mut bare, mut pid, mut pid_cpu) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        bare.push(run_once(workloads, false)?.0);
        let (rate, seconds, cpu) = run_once(workloads, true)?;
        pid.push(rate);
        pid_cpu.push(cpu / seconds);
    }
    let store = scratch.join("store");
    let agent =
        crate::agent::AgentProcess::start(&["--store", store.to_str().context("path")?], &[])?;
    let agent_pid = agent.child.id();
    let (mut under_agent, mut agent_cpu) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let before = cpu_seconds(agent_pid)?;
        let (rate, seconds, _) = run_once(workloads, false)?;
        under_agent.push(rate);
        agent_cpu.push((cpu_seconds(agent_pid)? - before) / seconds);
    }
    agent.terminate(Duration::from_secs(60))?;
    let base = median(&bare);
    println!("{title}, median of {rounds}:");
    for (name, runs) in [
        ("bare", &bare),
        ("--pid", &pid),
        ("agent (defaults)", &under_agent),
    ] {
        let m = median(runs);
        let gb: Vec<f64> = runs.iter().map(|r| r / 1e9).collect();
        println!(
            "  {name:<17} {:>6.2} GB/s  x{:.3} of bare   runs {gb:.2?}",
            m / 1e9,
            m / base
        );
    }
    println!(
        "  profiler CPU per second of the loop: --pid {:.3} s, agent {:.3} s",
        median(&pid_cpu),
        median(&agent_cpu)
    );
    Ok(())
}

/// Per command name in the store: processes, samples in all, and the mean observed
/// fraction of their profiles (1 when a profile does not say: observed full time).
pub fn observed(store: &Path, comm: &str) -> (usize, u64, f64) {
    let mut pids = std::collections::HashSet::new();
    let mut samples = 0;
    let mut fractions = Vec::new();
    for path in crate::agent::stored_profiles(store) {
        let (_, _, pid, name) = crate::agent::parse_stored_name(&path);
        if name != comm {
            continue;
        }
        let Ok(profile) = allocbpf_export::pprof::decode_file(&path) else {
            continue;
        };
        let s = |i: i64| profile.string_table[i as usize].as_str();
        pids.insert(pid);
        samples += profile
            .sample
            .iter()
            .flat_map(|x| x.label.iter())
            .filter(|l| s(l.key) == "samples")
            .map(|l| l.num as u64)
            .sum::<u64>();
        fractions.push(
            profile
                .comment
                .iter()
                .find_map(|&c| s(c).strip_prefix("observed_fraction="))
                .and_then(|v| v.parse().ok())
                .unwrap_or(1.0),
        );
    }
    let mean = fractions.iter().sum::<f64>() / fractions.len().max(1) as f64;
    (pids.len(), samples, mean)
}

/// `VmHWM` of `pid` in KiB (NaN if unreadable).
pub fn high_water_kib(pid: u32) -> f64 {
    status_kib(pid, "VmHWM:")
}

/// `VmRSS` of `pid` in KiB (NaN if unreadable).
pub fn resident_kib(pid: u32) -> f64 {
    status_kib(pid, "VmRSS:")
}

/// A KiB figure of `/proc/PID/status` (its line starting with `field`), NaN if
/// unreadable.
fn status_kib(pid: u32, field: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with(field))?;
            line.split_whitespace().nth(1)?.parse().ok()
        })
        .unwrap_or(f64::NAN)
}
