//! `cargo xtask bench --parts latency`: how fast `allocbpf --pid` goes in and out.
//!
//! For a native target (tests/workloads/steady.c on the host's libc) and Debian's
//! python3 (its allocation entries, its inlined small-object sites and libc), each
//! round runs `allocbpf --pid PID --duration 1s` and times, from allocbpf's start:
//! - **in**: until its start-up line, which it prints once every probe is attached;
//! - **out**: from the end of the duration (the start-up line plus one second: the
//!   duration is counted from there) until allocbpf has exited, profile written.
//!
//! Medians of the rounds, with the spread. The targets keep running throughout.

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use allocbpf_harness::Workload;
use allocbpf_profile::estimate::median;
use anyhow::{bail, Context, Result};

use crate::util::compile_c;

/// Debian's interpreter (inlined `PyObject_Malloc` sites), not a pyenv one on PATH.
const DEBIAN_PYTHON: &str = "/usr/bin/python3";

/// A Python loop that allocates lists, tuples and bytearrays forever.
const PYTHON_LOOP: &str = "import time\nwhile True:\n    x = [bytearray(1000) for _ in range(100)]\n    y = [(i, i) for i in range(100)]\n    time.sleep(0.01)\n";

/// Runs `rounds` rounds on each target and prints the medians.
pub fn latency(allocbpf: &Path, rounds: usize) -> Result<()> {
    let steady = compile_c("steady", &["-O1"])?;
    // One hour: the rounds stop it long before.
    let native = Workload::start(&steady, &["3600", "4096", "1000", "1"])?;
    measure(allocbpf, "native (steady.c, glibc)", native.pid, rounds)?;
    drop(native);
    if !Path::new(DEBIAN_PYTHON).exists() {
        bail!("{DEBIAN_PYTHON} is missing (cargo xtask setup installs python3)");
    }
    let mut python = Command::new(DEBIAN_PYTHON)
        .args(["-c", PYTHON_LOOP])
        .stdout(Stdio::null())
        .spawn()
        .context("starting python3")?;
    // Let it import what it imports before it is examined.
    std::thread::sleep(Duration::from_millis(300));
    let result = measure(allocbpf, "Debian python3", python.id(), rounds);
    let _ = python.kill();
    let _ = python.wait();
    result
}

/// Times `rounds` runs of `allocbpf --pid pid --duration 1s` and prints the medians.
fn measure(allocbpf: &Path, name: &str, pid: u32, rounds: usize) -> Result<()> {
    let (mut ins, mut outs) = (Vec::new(), Vec::new());
    let mut probes = String::new();
    for _ in 0..rounds {
        let started = Instant::now();
        let mut child = Command::new(allocbpf)
            .args(["--pid", &pid.to_string(), "--duration", "1s"])
            .args(["--format", "json", "--output", "/dev/null"])
            .stderr(Stdio::piped())
            .spawn()
            .context("starting allocbpf")?;
        let mut live = None;
        for line in BufReader::new(child.stderr.take().context("stderr")?).lines() {
            let line = line?;
            if live.is_none() && line.starts_with("allocbpf: profiling pid") {
                live = Some(started.elapsed());
                probes = line
                    .rsplit_once(": ")
                    .map(|(_, tail)| tail.split(',').next().unwrap_or_default().to_string())
                    .unwrap_or_default();
            }
        }
        let status = child.wait()?;
        let ended = started.elapsed();
        let Some(live) = live else {
            bail!("allocbpf did not attach to {name} (pid {pid}): {status}");
        };
        if !status.success() {
            bail!("allocbpf failed on {name}: {status}");
        }
        ins.push(live.as_secs_f64());
        outs.push((ended - live).as_secs_f64() - 1.0);
    }
    let spread = |v: &[f64]| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        format!("{lo:.3}-{hi:.3}")
    };
    println!(
        "latency {name} ({probes}): probes live {:.3} s after start ({}), returned {:.3} s after the duration ({}); medians of {rounds}",
        median(&ins),
        spread(&ins),
        median(&outs),
        spread(&outs),
    );
    Ok(())
}
