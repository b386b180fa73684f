//! What the default agent costs real programs (`cargo xtask bench --parts agent`): a
//! `gcc -O2` compile of a generated 3,000-function file (cc1 is malloc-heavy) and
//! redis-benchmark against a new redis-server, each bare and then under
//! `allocbpf agent` at its defaults (only the store and the metrics address set), or
//! with `--cpu-percent P` its per-process budget set to P% of a CPU. Prints every
//! compile's time, the ratios to the bare median, the compiles' system time per user
//! second (the probes' cost, steadier than wall time on a noisy VM), how many of the
//! compiles' cc1 processes have a profile in the store with samples and the fraction of
//! time they were observed, the redis throughput ratio and redis-server's observed
//! fraction, and the agent's window counters.

use std::{
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

use allocbpf_e2e::{
    agent::{metric, scrape_within, AgentProcess},
    bench::{
        compile_big, cpu_seconds, high_water_kib, median, observed, rounds_arg,
        write_malloc_heavy_source, CompileTimes,
    },
    scratch_dir,
};
use anyhow::{bail, Context, Result};

const METRICS: &str = "127.0.0.1:19497";
const REDIS_PORT: &str = "16397";

/// redis-benchmark SET+GET requests per second against the bench's redis-server.
fn redis_benchmark() -> Result<f64> {
    let output = Command::new("redis-benchmark")
        .args(["-p", REDIS_PORT, "-q", "-t", "set,get", "-n", "200000"])
        .stderr(Stdio::null())
        .output()
        .context("redis-benchmark (cargo xtask setup installs it)")?;
    let text = String::from_utf8_lossy(&output.stdout);
    // Lines end "...: 98765.43 requests per second, p50=..." (\r-separated progress).
    let total: f64 = text
        .split(['\r', '\n'])
        .filter_map(|line| line.split_once("requests per second")?.0.rsplit(' ').nth(1))
        .filter_map(|n| n.parse::<f64>().ok())
        .sum();
    if total == 0.0 {
        bail!("no figures from redis-benchmark: {text}");
    }
    Ok(total)
}

/// The `--cpu-percent P` argument, if given.
fn cpu_percent_arg() -> Result<Option<f64>> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == "--cpu-percent")
        .map(|i| {
            args.get(i + 1)
                .and_then(|v| v.parse().ok())
                .context("--cpu-percent takes a number")
        })
        .transpose()
}

fn main() -> Result<()> {
    let rounds = rounds_arg(3)?;
    let cpu_percent = cpu_percent_arg()?;
    let scratch = scratch_dir("agent-cost");
    write_malloc_heavy_source(&scratch, 3000)?;
    let mut redis = Command::new("redis-server")
        .args(["--port", REDIS_PORT, "--save", "", "--appendonly", "no"])
        .current_dir(&scratch)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("redis-server (cargo xtask setup installs it)")?;
    std::thread::sleep(Duration::from_millis(500));

    let (bare, bare_rps) = run_rounds(rounds, &scratch)?;
    let store = scratch.join("store");
    let agent = start_agent(&scratch, &store, cpu_percent)?;
    let agent_pid = agent.child.id();
    let agent_before = cpu_seconds(agent_pid)?;
    let started = std::time::Instant::now();
    let (profiled, profiled_rps) = run_rounds(rounds, &scratch)?;
    let agent_cpu = cpu_seconds(agent_pid)? - agent_before;
    let elapsed = started.elapsed().as_secs_f64();
    let agent_rss = high_water_kib(agent_pid);
    let text = scrape_within(METRICS, Duration::from_secs(5)).unwrap_or_default();
    let m = |name: &str| metric(&text, name).unwrap_or(f64::NAN);
    agent.terminate(Duration::from_secs(60))?;
    let _ = redis.kill();
    let _ = redis.wait();
    let cc1 = observed(&store, "cc1");
    let (_, _, redis_observed) = observed(&store, "redis_server");

    print_compile_costs(cpu_percent, rounds, &bare, &profiled, cc1);
    println!(
        "redis-benchmark SET+GET, agent / none (medians of {rounds}): {:.3} ({:.0} vs {:.0} requests/s); redis-server observed {:.2}% of the time",
        median(&profiled_rps) / median(&bare_rps),
        median(&profiled_rps),
        median(&bare_rps),
        redis_observed * 100.0
    );
    println!(
        "agent budget: {:.0} windows opened, {:.0} blind, {:.0} samples outside their window; {:.0} samples, {:.0} dropped",
        m("allocbpf_window_attaches_total"),
        m("allocbpf_window_blind_spots_total"),
        m("allocbpf_unplaced_samples_total"),
        m("allocbpf_samples_total"),
        m("allocbpf_ring_buffer_drops_total"),
    );
    println!(
        "agent's own CPU while profiled rounds ran: {agent_cpu:.2} s in {elapsed:.1} s ({:.1}% of a CPU), {:.0} us per sample taken; its memory high-water {:.1} MiB",
        agent_cpu / elapsed * 100.0,
        agent_cpu / m("allocbpf_samples_total") * 1e6,
        agent_rss / 1024.0
    );
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(())
}

/// `rounds` rounds of a compile in `scratch` then a redis-benchmark: the compiles'
/// times and the benchmark's requests per second.
fn run_rounds(rounds: usize, scratch: &Path) -> Result<(Vec<CompileTimes>, Vec<f64>)> {
    let mut compiles = Vec::new();
    let mut rps = Vec::new();
    for _ in 0..rounds {
        compiles.push(compile_big(scratch)?);
        rps.push(redis_benchmark()?);
    }
    Ok((compiles, rps))
}

/// Starts the agent at its defaults (its store in `store`, its metrics at
/// [`METRICS`]), with a per-process budget of `cpu_percent` if given.
fn start_agent(scratch: &Path, store: &Path, cpu_percent: Option<f64>) -> Result<AgentProcess> {
    let config = scratch.join("agent.toml");
    let budget = match cpu_percent {
        Some(percent) => format!("[budget]\ncpu_percent = {percent}\n"),
        None => String::new(),
    };
    std::fs::write(&config, budget).context("writing the agent config")?;
    AgentProcess::start(
        &[
            "--config",
            config.to_str().unwrap(),
            "--store",
            store.to_str().unwrap(),
            "--metrics-address",
            METRICS,
        ],
        &[],
    )
}

/// Prints the compiles' times bare and under the agent (budget `cpu_percent`), their
/// ratios and system time per user second, and what the store holds of their cc1
/// processes (`cc1`: processes, samples, mean observed fraction).
fn print_compile_costs(
    cpu_percent: Option<f64>,
    rounds: usize,
    bare: &[CompileTimes],
    profiled: &[CompileTimes],
    cc1: (usize, u64, f64),
) {
    let (cc1s, cc1_samples, cc1_observed) = cc1;
    let (bare_system, profiled_system) = (
        CompileTimes::systems_per_user(bare),
        CompileTimes::systems_per_user(profiled),
    );
    let (bare, profiled) = (CompileTimes::walls(bare), CompileTimes::walls(profiled));
    let base = median(&bare);
    let which = match cpu_percent {
        Some(percent) => format!("agent with a {percent}% per-process budget"),
        None => "default agent (1% per-process budget)".to_string(),
    };
    println!("{which} vs none, gcc -O2 of a 3,000-function file ({rounds} compiles each):");
    let list = |values: &mut dyn Iterator<Item = f64>| {
        values
            .map(|v| format!("{v:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "  bare compiles (s):          {}",
        list(&mut bare.iter().copied())
    );
    println!(
        "  under the agent (s):        {}",
        list(&mut profiled.iter().copied())
    );
    println!(
        "  ratios to the bare median:  {}",
        list(&mut profiled.iter().map(|s| s / base))
    );
    println!(
        "  compile time, agent / none (medians): {:.3}",
        median(&profiled) / base
    );
    println!(
        "  system s per user s (traps run in the kernel; noise stretches both alike): bare {}, under the agent {}; medians {:.3} vs {:.3}, +{:.3}",
        list(&mut bare_system.iter().copied()),
        list(&mut profiled_system.iter().copied()),
        median(&bare_system),
        median(&profiled_system),
        median(&profiled_system) - median(&bare_system)
    );
    if profiled.len() > 2 {
        println!(
            "  after the first compile (its cold start): compile time x{:.3}, system s per user s +{:.3} (medians)",
            median(&profiled[1..]) / base,
            median(&profiled_system[1..]) - median(&bare_system)
        );
    }
    println!(
        "  cc1 processes with a stored profile: {cc1s} of {rounds}, {cc1_samples} samples; observed {:.2}% of the time (mean over their profiles)",
        cc1_observed * 100.0
    );
}
