//! What profiling costs a Python program (`cargo xtask bench --parts python`): Debian's
//! python3.11 running `workloads/python_sites.py` (objects under and over 512 bytes,
//! through pymalloc and malloc), timed from its go to its exit, bare, under
//! `allocbpf --pid`, under `allocbpf --pid --budget 1%`, under `allocbpf --pid --live`
//! and under `allocbpf agent` at its defaults. Rounds alternate the first four;
//! medians and their ratios to bare are printed.
//!
//! Then the cost of a probe at a site where the interpreter inlined `PyObject_Malloc`
//! (the executable is link-time optimised): a loop making one new int (`BIG + i`) per
//! iteration, timed inside the interpreter, bare, under `--pid --empty-probes` (the
//! trap's floor: every probe runs an empty program) and under `--pid`; ns per
//! iteration, the probe hits per iteration (allocbpf's exact call count), and the ratio
//! allocbpf/floor of the time each adds to bare. Then the same with `--live`, a loop
//! making and dropping one 25-item tuple per iteration: allocated where the interpreter
//! inlined `PyObject_Malloc` and freed where it inlined `PyObject_Free`, both probed.

use std::{
    path::Path,
    process::Child,
    time::{Duration, Instant},
};

use allocbpf_e2e::{
    agent::AgentProcess,
    bench::{attach_profiler, median, rounds_arg},
    scratch_dir, workspace_root, Lines, Workload,
};
use anyhow::{Context, Result};

/// Rounds of the workload's three sites (100 objects each) per run.
const SITE_ROUNDS: &str = "20000";

/// allocbpf profiling `pid` with `output` and `extra` flags, once it says it profiles.
fn attach(pid: u32, output: &[&str], extra: &[&str]) -> Result<(Child, Lines)> {
    attach_profiler(pid, &[output, extra].concat())
}

/// One timed run of the workload, with allocbpf attached as `profiler` says.
fn timed_run(profiler: Option<&[&str]>) -> Result<f64> {
    let script = workspace_root().join("tests/workloads/python_sites.py");
    let mut workload = Workload::start(
        Path::new("/usr/bin/python3.11"),
        &[script.to_str().context("path")?, SITE_ROUNDS],
    )?;
    let attached = profiler
        .map(|extra| attach(workload.pid, &["--output", "/dev/null"], extra))
        .transpose()?;
    let started = Instant::now();
    workload.go()?;
    workload.wait(Duration::from_secs(600))?;
    let seconds = started.elapsed().as_secs_f64();
    if let Some((mut child, _)) = attached {
        child.wait()?;
    }
    Ok(seconds)
}

/// Iterations of the inlined-site loop.
const INLINED_ITERATIONS: u64 = 2_000_000;

/// An inlined-site loop: prints its pid, waits for a line, runs `STATEMENT`
/// [`INLINED_ITERATIONS`] times, prints ns per iteration.
const INLINED_LOOP: &str = "import os, sys, time\n\
BIG = 10**20\n\
xs = list(range(25))\n\
print(os.getpid(), flush=True)\n\
sys.stdin.readline()\n\
n = int(sys.argv[1])\n\
start = time.perf_counter_ns()\n\
for i in range(n):\n\
\x20   STATEMENT\n\
print((time.perf_counter_ns() - start) / n, flush=True)\n";

/// A loop's statement, what it says it does, and the flags of its floor and allocbpf
/// runs.
struct InlinedLoop {
    statement: &'static str,
    what: &'static str,
    floor: &'static [&'static str],
    allocbpf: &'static [&'static str],
}

/// The loops: a new int a iteration (an inlined allocation; its free is the exported
/// `PyObject_Free`, not probed without `--live`), and with `--live` a new 25-item tuple
/// dropped a iteration (an inlined allocation and an inlined free).
const LOOPS: [InlinedLoop; 2] = [
    InlinedLoop {
        statement: "x = BIG + i",
        what: "an int from an inlined PyObject_Malloc each",
        floor: &["--empty-probes"],
        allocbpf: &[],
    },
    InlinedLoop {
        statement: "x = tuple(xs)",
        what: "with --live, a tuple from an inlined PyObject_Malloc dropped through an \
               inlined PyObject_Free each",
        floor: &["--empty-probes", "--live"],
        allocbpf: &["--live"],
    },
];

/// One run of the inlined-site loop with allocbpf attached as `profiler` says: ns per
/// iteration, and with a profile written, the exact calls it counted.
fn inlined_run(
    statement: &str,
    profiler: Option<&[&str]>,
    profile: &Path,
) -> Result<(f64, Option<f64>)> {
    let iterations = INLINED_ITERATIONS.to_string();
    let code = INLINED_LOOP.replace("STATEMENT", statement);
    let mut workload = Workload::start(
        Path::new("/usr/bin/python3.11"),
        &["-c", &code, &iterations],
    )?;
    let _ = std::fs::remove_file(profile);
    let output = profile.to_str().context("path")?;
    let attached = profiler
        .map(|extra| {
            attach(
                workload.pid,
                &["--format", "json", "--output", output],
                extra,
            )
        })
        .transpose()?;
    workload.go()?;
    let line = workload.stdout.wait_for(".", Duration::from_secs(600))?;
    workload.wait(Duration::from_secs(60))?;
    let ns: f64 = line.trim().parse().context("the loop's ns per iteration")?;
    let mut calls = None;
    if let Some((mut child, _)) = attached {
        child.wait()?;
        if let Ok(bytes) = std::fs::read(profile) {
            let json: serde_json::Value = serde_json::from_slice(&bytes)?;
            calls = json["totals"]["exact_calls"].as_f64();
        }
    }
    Ok((ns, calls))
}

/// The inlined-site part, per loop: bare, floor and allocbpf alternate for `rounds`
/// rounds.
fn inlined_sites(rounds: usize, scratch: &Path, inlined: &InlinedLoop) -> Result<()> {
    let profile = scratch.join("inlined.json");
    let configs: [(&str, Option<&[&str]>); 3] = [
        ("bare", None),
        ("floor", Some(inlined.floor)),
        ("allocbpf", Some(inlined.allocbpf)),
    ];
    let mut ns: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    let mut hits = Vec::new();
    for _ in 0..rounds {
        for (i, (_, profiler)) in configs.iter().enumerate() {
            let (per_iteration, calls) = inlined_run(inlined.statement, *profiler, &profile)?;
            ns[i].push(per_iteration);
            if let (2, Some(calls)) = (i, calls) {
                hits.push(calls / INLINED_ITERATIONS as f64);
            }
        }
    }
    let [bare, floor, allocbpf] = [median(&ns[0]), median(&ns[1]), median(&ns[2])];
    println!(
        "python3.11 `{}` ({INLINED_ITERATIONS} iterations, {}), median of {rounds}:",
        inlined.statement, inlined.what
    );
    for ((name, _), runs) in configs.iter().zip(&ns) {
        println!(
            "  {name:<9} {:>8.1} ns/iteration   runs {runs:.1?}",
            median(runs)
        );
    }
    println!(
        "  allocation probe hits per iteration {:.2}; added to bare: floor {:.1} ns, \
         allocbpf {:.1} ns, allocbpf/floor {:.3} (whole iterations: {:.3})",
        median(&hits),
        floor - bare,
        allocbpf - bare,
        (allocbpf - bare) / (floor - bare),
        allocbpf / floor,
    );
    Ok(())
}

fn main() -> Result<()> {
    let rounds = rounds_arg(5)?;
    let scratch = scratch_dir("python-cost");
    let configs: [(&str, Option<&[&str]>); 4] = [
        ("bare", None),
        ("--pid", Some(&[])),
        ("--pid --budget 1%", Some(&["--budget", "1%"])),
        ("--pid --live", Some(&["--live"])),
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
    for inlined in &LOOPS {
        inlined_sites(rounds, &scratch, inlined)?;
    }
    Ok(())
}
