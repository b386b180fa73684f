//! `cargo xtask bench`: nanoseconds per malloc(32)+free pair for
//! - `none`: no probe;
//! - `floor`: an empty eBPF program on the allocation functions (`allocbpf
//!   --empty-probes`), the cost of the uprobe trap itself, below which no uprobe design
//!   can go;
//! - `allocbpf`: the real sampler at 512 KiB (default `--unwind auto`: user-stack copies
//!   unwound in userspace), and with `--unwind fp` (frame pointers walked in the kernel);
//! - `floor (malloc+free)`: the empty program on the allocation functions AND on free
//!   (at the same emulated instruction `--live` uses): the floor for live tracking;
//! - `--live`: the sampler with live tracking through uprobe session links;
//! - `--live (uretprobe)`: live tracking with a uretprobe on every allocation call, the
//!   classic design (bcc memleak's), for comparison;
//! - `system-wide`: `allocbpf` without `--pid` (every process, the agent's mode): the
//!   same sampler plus the per-process gate lookup and hit count.
//!
//! The configurations alternate within each round so that drift of this noisy VM hits
//! all alike; medians over rounds are reported, and each ratio is taken per round and
//! its median printed (targets: allocbpf/floor <= 1.10, --live/floor(malloc+free) <= 1.25).
//!
//! Then every probed entry point of every allocator family, and redis-benchmark
//! throughput (`bench_entries.rs`).

use std::{path::Path, process::Command};

use allocbpf_harness::Workload;
use allocbpf_profile::estimate::median;
use anyhow::{bail, Context, Result};

use crate::{
    setup,
    util::{attach, build_allocbpf, compile_c, finish, finish_collecting, is_root, RESULT_TIMEOUT},
};

/// One benchmark configuration: a name and allocbpf's extra arguments (`None`: no
/// profiler at all).
struct Config {
    name: &'static str,
    args: Option<&'static [&'static str]>,
}

/// Marks a configuration that runs allocbpf system-wide (no `--pid`).
const SYSTEM_WIDE: &str = "SYSTEM-WIDE";

const CONFIGS: [Config; 8] = [
    Config {
        name: "no probe",
        args: None,
    },
    Config {
        name: "empty program (floor)",
        args: Some(&["--empty-probes"]),
    },
    Config {
        name: "allocbpf --rate 512KiB",
        args: Some(&["--rate", "512KiB"]),
    },
    Config {
        name: "allocbpf --unwind fp",
        args: Some(&["--rate", "512KiB", "--unwind", "fp"]),
    },
    Config {
        name: "empty program, malloc+free (floor)",
        args: Some(&["--empty-probes", "--live"]),
    },
    Config {
        name: "allocbpf --live (session links)",
        args: Some(&["--rate", "512KiB", "--live"]),
    },
    Config {
        name: "allocbpf --live (uretprobe)",
        args: Some(&[
            "--rate",
            "512KiB",
            "--live",
            "--live-mechanism",
            "uretprobe",
        ]),
    },
    Config {
        name: "allocbpf system-wide (no --pid)",
        args: Some(&[SYSTEM_WIDE, "--rate", "512KiB"]),
    },
];

/// (numerator, denominator, label, target) over `CONFIGS` indices; an infinite
/// target is a figure without a target.
const RATIOS: [(usize, usize, &str, f64); 6] = [
    (2, 1, "allocbpf / floor", 1.10),
    (7, 2, "system-wide / --pid", f64::INFINITY),
    (3, 1, "allocbpf --unwind fp / floor", 1.10),
    (2, 3, "auto (stack copies) / fp", f64::INFINITY),
    (5, 4, "--live / floor (malloc+free)", 1.25),
    (
        6,
        4,
        "--live (uretprobe) / floor (malloc+free)",
        f64::INFINITY,
    ),
];

/// One run of the bench workload under `config`; returns ns per malloc+free pair.
fn measure(config: &Config, bench: &Path, allocbpf: &Path, iterations: u64) -> Result<f64> {
    let mut workload = Workload::start(bench, &[&iterations.to_string()])?;
    let pid = workload.pid.to_string();
    let profiler = match config.args {
        None => None,
        Some([SYSTEM_WIDE, extra @ ..]) => {
            let mut args = vec!["--output", "/dev/null", "--format", "json"];
            args.extend_from_slice(extra);
            Some(attach(allocbpf, &args, false)?)
        }
        Some(extra) => {
            let mut args = vec!["--pid", &pid, "--output", "/dev/null", "--format", "json"];
            args.extend_from_slice(extra);
            Some(attach(allocbpf, &args, false)?)
        }
    };
    workload.go()?;
    let result = workload
        .stdout
        .wait_for("", RESULT_TIMEOUT)
        .context("bench result")?;
    workload.child.wait()?;
    if let Some((child, stderr)) = profiler {
        if config.args.is_some_and(|a| a.first() == Some(&SYSTEM_WIDE)) {
            // System-wide mode runs until told to stop.
            Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status()?;
        }
        finish(child, stderr, false)?;
    }
    result.trim().parse().context("bench output")
}

/// A part of the benchmark (`--parts`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Part {
    /// malloc(32)+free pairs under every configuration, and unwinding throughput.
    Pairs,
    /// Every probed entry point of every allocator family.
    Entries,
    /// redis-benchmark against Debian's redis-server.
    Redis,
    /// The agent's cost to real programs: gcc -O2 compiles and redis-benchmark, bare
    /// and under the agent at its default budget, raised (5%) and lowered (0.25%)
    /// (tests/src/bin/agent_cost.rs); a Java compile in one JVM and an npm minifier
    /// (real_programs_cost.rs); and a host of 200 light processes
    /// (light_host_cost.rs). Also named `budget`.
    #[value(alias = "budget")]
    Agent,
    /// A Python program's runtime (Debian's python3.11, objects through pymalloc and
    /// malloc) bare, under `--pid`, `--pid --budget 1%` and the default agent
    /// (tests/src/bin/python_cost.rs). The cost per Python entry point is in `entries`
    /// (family `cpython`).
    Python,
    /// Reading Go programs' heap profiles: one read's CPU and bytes against the number
    /// of buckets, and a Go program's throughput with and without allocbpf reading it
    /// every second (tests/src/bin/go_cost.rs).
    Go,
    /// A Java program's allocation throughput (OpenJDK 17, TLABs and big arrays) bare,
    /// under `--pid` and under the default agent, and the profiler's CPU per second of
    /// it (tests/src/bin/jvm_cost.rs).
    Jvm,
    /// A Node.js program's JS heap allocation throughput (Node.js 20: small objects,
    /// large arrays, Buffers) bare, under `--pid` and under the default agent, and the
    /// profiler's CPU per second of it (tests/src/bin/node_cost.rs).
    Node,
    /// How fast `allocbpf --pid` goes in and out: probes live after start, and exit
    /// after the duration, on a native target and Debian's python3 (medians;
    /// bench_latency.rs).
    Latency,
    /// The HTML report: page size, time to write it, and in headless Chromium the time
    /// to first paint, to load and to the drawn page's paint, for 100, 1,000 and 10,000
    /// stacks against an empty page (tests/src/bin/report_bench.rs).
    Report,
    /// A read of another process's memory: bare, judged by the kernel's mapping query
    /// and made at once, and sent to the deadline reader thread, on one CPU and on any
    /// (userspace/images/examples/read_cost.rs).
    Reads,
    /// Pushing: profiles per second delivered to a real OpenTelemetry Collector (and a
    /// real Pyroscope when `$ALLOCBPF_PYROSCOPE` names one) and the agent's CPU per
    /// delivered profile, at 1 and 100 processes (tests/src/bin/push_bench.rs).
    Push,
}

/// Runs the benchmark and prints figures and ratios. `families`: the allocator
/// families the entries part measures (empty: all).
pub fn bench(rounds: usize, iterations: u64, parts: &[Part], families: &[String]) -> Result<()> {
    setup::ensure()?;
    if !is_root() {
        bail!("the benchmark attaches uprobes: run `sudo cargo xtask bench`");
    }
    let allocbpf = build_allocbpf()?;
    if parts.contains(&Part::Pairs) {
        pairs(&allocbpf, rounds, iterations)?;
    }
    if parts.contains(&Part::Entries) {
        crate::bench_entries::entries(&allocbpf, rounds, 150_000, families)?;
    }
    if parts.contains(&Part::Redis) {
        crate::bench_entries::redis(&allocbpf, rounds.min(3), 200_000)?;
    }
    if parts.contains(&Part::Agent) {
        // The default budget, then raised and lowered.
        for percent in [None, Some("5"), Some("0.25")] {
            let mut command = crate::setup::e2e_bin("agent_cost")?;
            // Five: the first compile under a new agent pays its cold start, and the
            // median of what follows should not rest on two compiles.
            command.args(["--rounds", &rounds.min(5).to_string()]);
            if let Some(percent) = percent {
                command.args(["--cpu-percent", percent]);
            }
            crate::util::run(&mut command)?;
        }
        let mut command = crate::setup::e2e_bin("real_programs_cost")?;
        command.args(["--rounds", &rounds.min(5).to_string()]);
        crate::util::run(&mut command)?;
        crate::util::run(&mut crate::setup::e2e_bin("light_host_cost")?)?;
    }
    if parts.contains(&Part::Python) {
        let mut command = crate::setup::e2e_bin("python_cost")?;
        command.args(["--rounds", &rounds.min(5).to_string()]);
        crate::util::run(&mut command)?;
    }
    if parts.contains(&Part::Go) {
        let mut command = crate::setup::e2e_bin("go_cost")?;
        command.args(["--rounds", &rounds.min(5).to_string()]);
        crate::util::run(&mut command)?;
    }
    if parts.contains(&Part::Jvm) {
        let mut command = crate::setup::e2e_bin("jvm_cost")?;
        command.args(["--rounds", &rounds.min(5).to_string()]);
        crate::util::run(&mut command)?;
    }
    if parts.contains(&Part::Node) {
        let mut command = crate::setup::e2e_bin("node_cost")?;
        command.args(["--rounds", &rounds.min(5).to_string()]);
        crate::util::run(&mut command)?;
    }
    if parts.contains(&Part::Latency) {
        crate::bench_latency::latency(&allocbpf, rounds.max(5))?;
    }
    if parts.contains(&Part::Report) {
        let mut command = crate::setup::e2e_bin("report_bench")?;
        command.args(["--rounds", &rounds.clamp(3, 9).to_string()]);
        crate::util::run(&mut command)?;
    }
    if parts.contains(&Part::Reads) {
        for cpus in [&[][..], &["--one-cpu"][..]] {
            let example = ["run", "--quiet", "--release", "-p", "allocbpf-images"];
            crate::util::run(
                Command::new("cargo")
                    .args(example)
                    .args(["--example", "read_cost", "--"])
                    .args(cpus),
            )?;
        }
    }
    if parts.contains(&Part::Push) {
        let mut command = crate::setup::e2e_bin("push_bench")?;
        command.args(["--rounds", &rounds.min(3).to_string()]);
        crate::util::run(&mut command)?;
    }
    Ok(())
}

/// malloc(32)+free pairs under every configuration, then unwinding throughput.
fn pairs(allocbpf: &Path, rounds: usize, iterations: u64) -> Result<()> {
    let allocbpf = allocbpf.to_path_buf();
    let bench = compile_c("bench", &["-O2"])?;
    let mut results: Vec<Vec<f64>> = vec![Vec::new(); CONFIGS.len()];
    for round in 0..rounds {
        for (i, config) in CONFIGS.iter().enumerate() {
            let ns = measure(config, &bench, &allocbpf, iterations)?;
            eprintln!("round {}: {:<42} {ns:>9.1} ns", round + 1, config.name);
            results[i].push(ns);
        }
    }
    println!();
    println!("malloc(32)+free pairs, {iterations} per run, {rounds} rounds (median [min, max])");
    for (config, values) in CONFIGS.iter().zip(results.iter()) {
        let (min, max) = values
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        println!(
            "  {:<42} {:>9.1} ns  [{min:.1}, {max:.1}]",
            config.name,
            median(values)
        );
    }
    for (num, den, label, target) in RATIOS {
        let ratios: Vec<f64> = results[num]
            .iter()
            .zip(&results[den])
            .map(|(a, f)| a / f)
            .collect();
        let ratio = median(&ratios);
        let verdict = if target.is_finite() {
            format!(
                "  (target <= {target:.2}: {})",
                if ratio <= target { "met" } else { "NOT met" }
            )
        } else {
            String::new()
        };
        println!("  {label} (median of per-round ratios): {ratio:.3}{verdict}");
    }
    throughput(&allocbpf)
}

/// Userspace unwinding and symbolization throughput: the stacks workload (no frame
/// pointers, 6-frame chains) at a 4 KiB rate, figures from allocbpf's own log.
fn throughput(allocbpf: &Path) -> Result<()> {
    let stacks = compile_c("stacks", &["-O2", "-fomit-frame-pointer", "-g"])?;
    let mut workload = Workload::start(&stacks, &[])?;
    let pid = workload.pid.to_string();
    let (child, stderr) = attach(
        allocbpf,
        &[
            "--pid",
            &pid,
            "--rate",
            "4KiB",
            "--output",
            "/dev/null",
            "-v",
        ],
        false,
    )?;
    workload.go()?;
    workload.child.wait()?;
    let lines = finish_collecting(child, stderr, false)?;
    // "... unwound N stacks in Xs (...)" / "... symbolized S stacks of N samples in Ys"
    let figure = |word: &str| -> Option<(f64, f64)> {
        let line = lines.iter().find(|l| l.contains(word))?;
        let words: Vec<&str> = line.split_whitespace().collect();
        let at = words.iter().position(|w| *w == word)?;
        let count: f64 = words.get(at + 1)?.parse().ok()?;
        let within = words[at..].iter().position(|w| *w == "in")? + at;
        let secs: f64 = words.get(within + 1)?.trim_end_matches('s').parse().ok()?;
        Some((count, secs))
    };
    let (Some((unwound, unwind_s)), Some((_, symbolize_s))) =
        (figure("unwound"), figure("symbolized"))
    else {
        bail!("no unwinding/symbolization figures in allocbpf's log: {lines:?}");
    };
    println!();
    println!("userspace, {unwound:.0} samples of stacks without frame pointers, one core:");
    println!(
        "  unwinding {:.0} samples/s; symbolization {:.3}s at the end; together {:.0} samples/s",
        unwound / unwind_s,
        symbolize_s,
        unwound / (unwind_s + symbolize_s)
    );
    // Ring-buffer records carry an 8-byte header each.
    let header = std::mem::size_of::<allocbpf_common::SampleEvent>() + 8;
    println!(
        "  ring buffer bytes per sample: fp {header}, auto/dwarf {} (default 16 KiB copy)",
        header + 16384
    );
    Ok(())
}
