//! The agent burst bench (`cargo xtask soak --burst`): `allocbpf agent` at its defaults
//! (5 s cuts) while a burst of real programs starts at once: three Python loops
//! allocating 70 KB objects as fast as they can, a `gcc -g` compile of a generated
//! 3,000-function file, and redis-benchmark against a new redis-server (whose jemalloc
//! the agent must examine and attach meanwhile). After 20 s it prints the samples, the
//! drops, the ring's and the reader queue's peaks and the agent's resident memory (at
//! the end, and the most seen), for each round.

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use allocbpf_e2e::{
    agent::{metric, scrape_within, AgentProcess},
    bench::{rounds_arg, write_malloc_heavy_source},
    scratch_dir, status_bytes,
};
use anyhow::{Context, Result};

fn spawn(program: &str, args: &[&str], dir: &std::path::Path) -> Result<Child> {
    Command::new(program)
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {program} (cargo xtask setup installs it)"))
}

fn round(number: usize) -> Result<()> {
    let scratch = scratch_dir(&format!("burst-{number}"));
    write_malloc_heavy_source(&scratch, 3000)?;
    let address = "127.0.0.1:19498";
    let store = scratch.join("store");
    let agent = AgentProcess::start_storing(&store, "5s", address)?;
    let agent_pid = agent.child.id();
    std::thread::sleep(Duration::from_secs(2));
    let python = "import time\nt = time.time()\nwhile time.time() - t < 15:\n    l = [bytearray(70000) for _ in range(100)]\n";
    let mut children = Vec::new();
    for _ in 0..3 {
        children.push(spawn("python3", &["-c", python], &scratch)?);
    }
    children.push(spawn(
        "gcc",
        &["-g", "-O1", "-c", "big.c", "-o", "big.o"],
        &scratch,
    )?);
    let mut redis = spawn(
        "redis-server",
        &["--port", "16398", "--save", "", "--appendonly", "no"],
        &scratch,
    )?;
    std::thread::sleep(Duration::from_millis(500));
    children.push(spawn(
        "redis-benchmark",
        &["-p", "16398", "-q", "-n", "200000"],
        &scratch,
    )?);
    let started = Instant::now();
    let mut peak_rss = 0;
    while started.elapsed() < Duration::from_secs(20) {
        peak_rss = peak_rss.max(status_bytes(agent_pid, "VmRSS").unwrap_or(0));
        std::thread::sleep(Duration::from_millis(200));
    }
    let text = scrape_within(address, Duration::from_secs(5)).unwrap_or_default();
    let m = |name: &str| metric(&text, name).unwrap_or(f64::NAN);
    let (samples, drops) = (
        m("allocbpf_samples_total"),
        m("allocbpf_ring_buffer_drops_total"),
    );
    println!(
        "burst round {number}: {samples:.0} samples, {drops:.0} dropped ({:.2}%), ring peak {:.1} MB, queue peak {:.1} MB, agent RSS {:.1} MiB at the end, {:.1} MiB at most",
        100.0 * drops / (samples + drops),
        m("allocbpf_ring_buffer_peak_bytes") / 1e6,
        m("allocbpf_event_queue_peak_bytes") / 1e6,
        m("allocbpf_resident_memory_bytes") / (1 << 20) as f64,
        peak_rss as f64 / (1 << 20) as f64,
    );
    for mut child in children {
        let _ = child.kill();
        let _ = child.wait();
    }
    let _ = redis.kill();
    let _ = redis.wait();
    agent.terminate(Duration::from_secs(60))?;
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(())
}

fn main() -> Result<()> {
    let rounds = rounds_arg(3)?;
    for number in 1..=rounds {
        round(number)?;
    }
    Ok(())
}
