//! What profiling costs a Python program (`cargo xtask bench --parts python`): Debian's
//! python3.11 running `workloads/python_sites.py` (objects under and over 512 bytes,
//! through pymalloc and malloc), timed from its go to its exit, bare, under
//! `allocbpf --pid`, under `allocbpf --pid --budget 1%` and under `allocbpf agent` at its
//! defaults. Rounds alternate the four; medians and their ratios to bare are printed.

use std::{
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use allocbpf_e2e::{
    agent::AgentProcess,
    allocbpf_bin,
    bench::{median, rounds_arg},
    scratch_dir, workspace_root, Lines, Workload,
};
use anyhow::{Context, Result};

/// Rounds of the workload's three sites (100 objects each) per run.
const SITE_ROUNDS: &str = "20000";

/// One timed run of the workload, with allocbpf attached as `profiler` says.
fn timed_run(profiler: Option<&[&str]>) -> Result<f64> {
    let script = workspace_root().join("tests/workloads/python_sites.py");
    let mut workload = Workload::start(
        Path::new("/usr/bin/python3.11"),
        &[script.to_str().context("path")?, SITE_ROUNDS],
    )?;
    let pid = workload.pid.to_string();
    let attached: Option<(Child, Lines)> = match profiler {
        None => None,
        Some(extra) => {
            let mut child = Command::new(allocbpf_bin())
                .args(["--pid", &pid, "--output", "/dev/null"])
                .args(extra)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()?;
            let mut stderr = Lines::spawn(child.stderr.take().unwrap());
            stderr.wait_for("allocbpf: profiling pid", Duration::from_secs(60))?;
            Some((child, stderr))
        }
    };
    let started = Instant::now();
    workload.go()?;
    workload.wait(Duration::from_secs(600))?;
    let seconds = started.elapsed().as_secs_f64();
    if let Some((mut child, _)) = attached {
        child.wait()?;
    }
    Ok(seconds)
}

fn main() -> Result<()> {
    let rounds = rounds_arg(5)?;
    let scratch = scratch_dir("python-cost");
    let configs: [(&str, Option<&[&str]>); 3] = [
        ("bare", None),
        ("--pid", Some(&[])),
        ("--pid --budget 1%", Some(&["--budget", "1%"])),
    ];
    let mut seconds: Vec<Vec<f64>> = vec![Vec::new(); configs.len() + 1];
    for _ in 0..rounds {
        for (i, (_, profiler)) in configs.iter().enumerate() {
            seconds[i].push(timed_run(*profiler)?);
        }
    }
    let store = scratch.join("store");
    let agent = AgentProcess::start(&["--store", store.to_str().unwrap()], &[])?;
    for _ in 0..rounds {
        seconds[configs.len()].push(timed_run(None)?);
    }
    agent.terminate(Duration::from_secs(60))?;
    let bare = median(&seconds[0]);
    println!("python3.11 {SITE_ROUNDS} rounds of python_sites.py, median of {rounds}:");
    let names = configs
        .iter()
        .map(|(name, _)| *name)
        .chain(["agent (defaults)"]);
    for (name, runs) in names.zip(&seconds) {
        let m = median(runs);
        println!(
            "  {name:<20} {m:>7.3} s  x{:.2} of bare   runs {runs:.3?}",
            m / bare
        );
    }
    Ok(())
}
