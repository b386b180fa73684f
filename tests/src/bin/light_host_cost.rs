//! What the default agent costs on a host of many light processes (`cargo xtask bench
//! --parts agent`): 100 C processes (`workloads/steady.c`, 1 KiB a call every 10 ms)
//! and 100 CPython ones (Debian's python3, a 1 KiB bytes object every 10 ms), each
//! allocating ~100 KB a second, started before the agent. Prints the agent's CPU (a
//! share of one core) and its memory (resident now and high-water) over a measured
//! span, after its start-up scan, beside what the 200 processes themselves used.

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use allocbpf_e2e::{
    agent::{metric, scrape_within, AgentProcess},
    bench::{cpu_seconds, high_water_kib, resident_kib},
    compile_workload, scratch_dir,
};
use anyhow::{Context, Result};

const METRICS: &str = "127.0.0.1:19499";
/// Processes of each kind.
const EACH: usize = 100;
/// The span measured, after the agent's start.
const MEASURED: Duration = Duration::from_secs(20);
/// Time left to the agent's start-up scan before the span.
const SETTLE: Duration = Duration::from_secs(10);

const PYTHON_LOOP: &str = "import time\nkeep = []\nwhile True:\n    keep.append(bytes(1024))\n    if len(keep) > 64: keep.clear()\n    time.sleep(0.01)\n";

/// CPU seconds the `children` used so far (those still readable).
fn children_cpu(children: &[Child]) -> f64 {
    children
        .iter()
        .filter_map(|child| cpu_seconds(child.id()).ok())
        .sum()
}

fn main() -> Result<()> {
    let steady = compile_workload("steady", &["-O1", "-g", "-fno-omit-frame-pointer"])?;
    let scratch = scratch_dir("light-host-cost");
    let mut children = Vec::new();
    for _ in 0..EACH {
        children.push(
            Command::new(&steady)
                .args(["3600", "1024", "10000"])
                .stdout(Stdio::null())
                .spawn()
                .context("starting steady")?,
        );
        children.push(
            Command::new("python3")
                .args(["-c", PYTHON_LOOP])
                .spawn()
                .context("starting python3")?,
        );
    }
    // Past their start-up (200 interpreters importing on two cores).
    std::thread::sleep(SETTLE);
    let bare_before = children_cpu(&children);
    let bare_started = Instant::now();
    std::thread::sleep(MEASURED);
    let bare_cpu = children_cpu(&children) - bare_before;
    let bare_elapsed = bare_started.elapsed().as_secs_f64();

    let store = scratch.join("store");
    let agent = AgentProcess::start_default(&store, METRICS)?;
    let pid = agent.child.id();
    std::thread::sleep(SETTLE);
    let (agent_before, children_before) = (cpu_seconds(pid)?, children_cpu(&children));
    let started = Instant::now();
    std::thread::sleep(MEASURED);
    let agent_cpu = cpu_seconds(pid)? - agent_before;
    let profiled_cpu = children_cpu(&children) - children_before;
    let elapsed = started.elapsed().as_secs_f64();
    let (resident, high_water) = (resident_kib(pid), high_water_kib(pid));
    let text = scrape_within(METRICS, Duration::from_secs(5)).unwrap_or_default();
    let m = |name: &str| metric(&text, name).unwrap_or(f64::NAN);
    let samples = m("allocbpf_samples_total");
    let (windows, own_links) = (
        m("allocbpf_window_attaches_total"),
        m("allocbpf_own_link_attaches_total"),
    );
    let share = m("allocbpf_budget_periods_with_windows_percent");
    let queue_peak = m("allocbpf_event_queue_peak_bytes");
    agent.terminate(Duration::from_secs(60))?;
    for child in &mut children {
        let _ = child.kill();
        let _ = child.wait();
    }
    println!(
        "default agent on a host of {EACH} C and {EACH} CPython processes, each allocating ~100 KB/s ({:.0} s measured, after {:.0} s of start-up):",
        MEASURED.as_secs_f64(),
        SETTLE.as_secs_f64()
    );
    println!(
        "  agent's CPU: {agent_cpu:.2} s in {elapsed:.1} s ({:.2}% of a core); {samples:.0} samples since its start",
        agent_cpu / elapsed * 100.0
    );
    println!(
        "  since its start: {windows:.0} windows opened (windows in {share:.0}% of periods now), {own_links:.0} processes given their own links"
    );
    println!(
        "  agent's memory: resident {:.1} MiB, high-water {:.1} MiB; its event queue's peak {:.1} MiB",
        resident / 1024.0,
        high_water / 1024.0,
        queue_peak / f64::from(1 << 20)
    );
    println!(
        "  the 200 processes' CPU: bare {:.2}% of a core, under the agent {:.2}% (x{:.3})",
        bare_cpu / bare_elapsed * 100.0,
        profiled_cpu / elapsed * 100.0,
        (profiled_cpu / elapsed) / (bare_cpu / bare_elapsed)
    );
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(())
}
