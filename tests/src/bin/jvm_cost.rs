//! What profiling costs a Java program (`cargo xtask bench --parts jvm`): the JVM
//! workload (`workloads/java/AllocSites.java`: byte arrays and small objects in TLABs)
//! on Debian's OpenJDK 17 with a fixed 2 GiB heap, its loop timed by itself, bare,
//! under `allocbpf --pid` and under `allocbpf agent` at its defaults (one agent for its
//! rounds). Rounds alternate bare and `--pid`; medians of the allocation throughput
//! and their ratios to bare are printed, with the CPU the profiler spent per second of
//! the JVM's loop (`--pid`: allocbpf's own; the agent: its CPU over its rounds).

use std::time::Duration;

use allocbpf_e2e::{
    agent::AgentProcess,
    bench::{attach_profiler, cpu_seconds, median, rounds_arg},
    jvm::{output_value, start_alloc_sites, truth, Site, JDK17},
    scratch_dir,
};
use anyhow::{Context, Result};

/// Iterations of the workload's main loop per run (a few seconds).
const ITERATIONS: &str = "200000000";

/// Big arrays per run: none (their humongous allocations make the collector's pace,
/// and the loop's, vary from run to run).
const BIG_ARRAYS: &str = "0";

/// A fixed heap, touched at start: the collector's sizing and first-touch page faults
/// do not change between runs.
const JVM_OPTIONS: &[&str] = &["-Xms2g", "-Xmx2g", "-XX:+AlwaysPreTouch"];

/// One run: bytes allocated per second of the loop, the loop's seconds, and with
/// `--pid`, allocbpf's CPU seconds.
fn run(by_pid: bool) -> Result<(f64, f64, f64)> {
    let mut workload = start_alloc_sites(JDK17, JVM_OPTIONS, ITERATIONS, "1", BIG_ARRAYS)?;
    let profiler = match by_pid {
        true => Some(attach_profiler(workload.pid, &["--output", "/dev/null"])?),
        false => None,
    };
    // The profiler's CPU from the go on: its start (reading libjvm) is not the loop's.
    let cpu_at_go = match &profiler {
        Some((child, _)) => cpu_seconds(child.id())?,
        None => 0.0,
    };
    workload.go()?;
    let done = workload
        .stdout
        .wait_for("loop_ns", Duration::from_secs(600))?;
    let output = workload.stdout.seen.join("\n");
    let seconds = output_value(&done, "loop_ns").context("loop_ns")? / 1e9;
    let bytes: f64 = truth(&output)?.0.iter().map(Site::bytes).sum();
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

fn main() -> Result<()> {
    let rounds = rounds_arg(5)?;
    let scratch = scratch_dir("jvm-cost");
    let (mut bare, mut pid, mut pid_cpu) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        bare.push(run(false)?.0);
        let (rate, seconds, cpu) = run(true)?;
        pid.push(rate);
        pid_cpu.push(cpu / seconds);
    }
    let store = scratch.join("store");
    let agent = AgentProcess::start(&["--store", store.to_str().context("path")?], &[])?;
    let agent_pid = agent.child.id();
    let (mut under_agent, mut agent_cpu) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let before = cpu_seconds(agent_pid)?;
        let (rate, seconds, _) = run(false)?;
        under_agent.push(rate);
        agent_cpu.push((cpu_seconds(agent_pid)? - before) / seconds);
    }
    agent.terminate(Duration::from_secs(60))?;
    let base = median(&bare);
    println!("OpenJDK 17 AllocSites ({ITERATIONS} iterations, {BIG_ARRAYS} big arrays), median of {rounds}:");
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
