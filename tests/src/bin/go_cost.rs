//! What reading a Go program's heap profile costs (`cargo xtask bench --parts go`).
//!
//! 1. One read against the number of buckets: `workloads/go_buckets buckets` makes a
//!    heap profile of about DEPTHS x SIZES buckets (every allocation recorded); the
//!    bench examines its executable once, then polls it as the agent does, timing each
//!    poll's CPU time (this thread's) and counting the bytes it read. Medians of the
//!    rounds per size.
//! 2. The target's throughput with and without allocbpf reading it every second:
//!    `workloads/go_buckets throughput` allocating 1 KiB slices for a few seconds, bare
//!    and under `allocbpf --pid`, rounds alternating; medians and their ratio.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use allocbpf_e2e::{
    bench::{attach_profiler, median, rounds_arg},
    scratch_dir, workspace_root, Lines, Workload,
};
use allocbpf_go::process::{GoFile, GoProcess};
use allocbpf_images::procfs;
use anyhow::{bail, Context, Result};

/// Builds `workloads/go_buckets` with the machine's Go.
fn build() -> Result<PathBuf> {
    let binary = scratch_dir("go-cost").join("go_buckets");
    let go = ["/usr/local/go/bin/go"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .unwrap_or("go");
    let output = Command::new(go)
        .args(["build", "-o"])
        .arg(&binary)
        .arg(".")
        .current_dir(workspace_root().join("tests/workloads/go_buckets"))
        .env("GOTOOLCHAIN", "local")
        .env("GOCACHE", workspace_root().join("target/e2e/gocache"))
        .output()?;
    if !output.status.success() {
        bail!("go build: {}", String::from_utf8_lossy(&output.stderr));
    }
    Ok(binary)
}

/// This thread's CPU time.
fn thread_cpu() -> Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
    Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}

/// Polls of one buckets workload of `depths` x `sizes`: (buckets, median CPU per poll,
/// bytes per poll).
fn read_cost(
    binary: &Path,
    depths: usize,
    sizes: usize,
    rounds: usize,
) -> Result<(usize, f64, u64)> {
    let mut child = Command::new(binary)
        .args(["buckets", &depths.to_string(), &sizes.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut stdout = Lines::spawn(child.stdout.take().context("stdout")?);
    let pid: u32 = stdout
        .wait_for("", Duration::from_secs(30))?
        .trim()
        .parse()?;
    stdout.wait_for("ready", Duration::from_secs(120))?;
    let maps = procfs::read_maps(pid);
    let exe = std::fs::read_link(format!("/proc/{pid}/exe"))?;
    let mapping = maps
        .iter()
        .find(|m| m.executable && m.file_path() == Some(exe.as_path()))
        .context("the executable's mapping")?;
    let file = GoFile::examine(pid, mapping)?.context("not Go")?;
    let mut process = GoProcess::new(pid, &file, mapping).context("bias")?;
    let mut cpu = Vec::new();
    let (mut buckets, mut bytes) = (0, 0);
    for _ in 0..rounds.max(1) * 5 {
        let before = thread_cpu();
        let poll = process.poll(&file)?;
        cpu.push((thread_cpu() - before).as_secs_f64() * 1e6);
        (buckets, bytes) = (poll.buckets, poll.bytes_read);
    }
    drop(child.stdin.take());
    let _ = child.kill();
    let _ = child.wait();
    Ok((buckets, median(&cpu), bytes))
}

/// One throughput run, bare or with allocbpf reading it: slices per second of wall
/// time, and per second of the program's own CPU time (steadier on a shared VM).
fn throughput(binary: &Path, profiled: bool) -> Result<(f64, f64)> {
    let mut workload = Workload::start(binary, &["throughput", "5"])?;
    let profiler = match profiled {
        true => Some(attach_profiler(workload.pid, &["--output", "/dev/null"])?),
        false => None,
    };
    workload.go()?;
    let line = workload.stdout.wait_for(".", Duration::from_secs(60))?;
    workload.wait(Duration::from_secs(30))?;
    if let Some((mut child, _stderr)) = profiler {
        child.wait()?;
    }
    let mut figures = line.split_whitespace().map(str::parse::<f64>);
    match (figures.next(), figures.next()) {
        (Some(Ok(wall)), Some(Ok(cpu))) => Ok((wall, cpu)),
        _ => bail!("throughput line {line:?}"),
    }
}

fn main() -> Result<()> {
    let rounds = rounds_arg(3)?;
    let binary = build()?;
    println!(
        "one read of a Go heap profile (CPU of the reading thread, median of {} polls):",
        rounds * 5
    );
    for (depths, sizes) in [(10, 10), (100, 10), (100, 50), (100, 100)] {
        let (buckets, cpu_us, bytes) = read_cost(&binary, depths, sizes, rounds)?;
        println!(
            "  {buckets:>6} buckets: {cpu_us:>9.1} us, {bytes:>9} bytes read, {:.2} us per bucket",
            cpu_us / buckets.max(1) as f64
        );
    }
    let mut runs: [Vec<(f64, f64)>; 2] = [Vec::new(), Vec::new()];
    for _ in 0..rounds {
        runs[0].push(throughput(&binary, false)?);
        runs[1].push(throughput(&binary, true)?);
    }
    println!("a Go program allocating 1 KiB slices for 5 s, median of {rounds}:");
    let mut medians = Vec::new();
    for (name, runs) in ["bare", "read every second"].iter().zip(&runs) {
        let wall: Vec<f64> = runs.iter().map(|r| r.0).collect();
        let cpu: Vec<f64> = runs.iter().map(|r| r.1).collect();
        println!(
            "  {name:<18} {:>10.0} slices/s, {:>10.0} per CPU second   runs {wall:.0?}",
            median(&wall),
            median(&cpu)
        );
        medians.push((median(&wall), median(&cpu)));
    }
    println!(
        "  read/bare: {:.3} per second, {:.3} per CPU second",
        medians[1].0 / medians[0].0,
        medians[1].1 / medians[0].1
    );
    Ok(())
}
