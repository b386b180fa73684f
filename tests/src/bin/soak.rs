//! The agent soak bench (`cargo xtask soak`): `allocbpf agent` runs system-wide at a
//! high sampling rate while a steady allocator runs and short-lived processes churn
//! (a new one every 100 ms, each living ~50 ms). Every 10 s it records the agent's
//! resident memory and its metrics; at the end it prints the series and whether RSS
//! stayed flat (last-third median within 10% of the second-third median, after the
//! first third's warm-up) and the drops the kernel counted.

use std::{
    process::{Command, Stdio},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use allocbpf_e2e::{
    agent::{metric, scrape, stored_profiles, AgentProcess},
    compile_workload, scratch_dir,
};
use anyhow::{Context, Result};

fn rss_bytes(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str, default: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
            .unwrap_or_else(|| default.to_string())
    };
    let minutes: f64 = arg("--minutes", "10").parse().context("--minutes")?;
    let rate = arg("--rate", "16KiB");
    let total = Duration::from_secs_f64(minutes * 60.0);
    let scratch = scratch_dir("soak");
    let store = scratch.join("store");
    let workload = compile_workload("agentwl", &["-O1", "-g", "-fno-omit-frame-pointer"])?;
    let address = "127.0.0.1:19466";
    let agent = AgentProcess::start(
        &[
            "--store",
            store.to_str().unwrap(),
            "--interval",
            "10s",
            "--rate",
            &rate,
            "--metrics-address",
            address,
        ],
        &[],
    )?;
    let agent_pid = agent.child.id();
    println!(
        "soak: agent pid {agent_pid}, rate {rate}, {minutes} min, churn: one process every 100 ms"
    );
    let seconds = format!("{}", total.as_secs() + 5);
    let mut steady = Command::new(&workload)
        .arg(&seconds)
        .stdout(Stdio::null())
        .spawn()?;

    let stop = Arc::new(AtomicBool::new(false));
    let spawned = Arc::new(AtomicU64::new(0));
    let churn = {
        let (stop, spawned, workload) = (stop.clone(), spawned.clone(), workload.clone());
        std::thread::spawn(move || {
            let mut children = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                if let Ok(child) = Command::new(&workload)
                    .arg("0.05")
                    .stdout(Stdio::null())
                    .spawn()
                {
                    children.push(child);
                    spawned.fetch_add(1, Ordering::Relaxed);
                }
                children.retain_mut(|c| c.try_wait().ok().flatten().is_none());
                std::thread::sleep(Duration::from_millis(100));
            }
            for mut child in children {
                let _ = child.wait();
            }
        })
    };

    println!(
        "{:>7} {:>9} {:>10} {:>8} {:>9} {:>8} {:>8}",
        "t (s)", "RSS MiB", "samples", "drops", "processes", "churned", "tracked"
    );
    let started = Instant::now();
    let mut series: Vec<(f64, f64)> = Vec::new();
    let mut last_metrics = String::new();
    while started.elapsed() < total {
        std::thread::sleep(Duration::from_secs(10).min(total.saturating_sub(started.elapsed())));
        let rss = rss_bytes(agent_pid) as f64 / (1 << 20) as f64;
        let text = scrape(address).unwrap_or_default();
        let m = |name: &str| metric(&text, name).unwrap_or(f64::NAN);
        let t = started.elapsed().as_secs_f64();
        println!(
            "{t:>7.0} {rss:>9.1} {:>10.0} {:>8.0} {:>9.0} {:>8} {:>8.0}",
            m("allocbpf_samples_total"),
            m("allocbpf_ring_buffer_drops_total"),
            m("allocbpf_exit_events_total"),
            spawned.load(Ordering::Relaxed),
            m("allocbpf_tracked_processes"),
        );
        series.push((t, rss));
        last_metrics = text;
    }
    stop.store(true, Ordering::Relaxed);
    churn.join().ok();
    let _ = steady.kill();
    let _ = steady.wait();
    let log = agent.terminate(Duration::from_secs(60))?;

    let third = series.len() / 3;
    let mut middle: Vec<f64> = series[third..2 * third].iter().map(|s| s.1).collect();
    let mut last: Vec<f64> = series[2 * third..].iter().map(|s| s.1).collect();
    let (middle, last) = (median(&mut middle), median(&mut last));
    let growth = last / middle - 1.0;
    let m = |name: &str| metric(&last_metrics, name).unwrap_or(f64::NAN);
    println!(
        "soak: {} short-lived processes started",
        spawned.load(Ordering::Relaxed)
    );
    println!(
        "soak: agent RSS median {middle:.1} MiB (middle third) -> {last:.1} MiB (last third): {:+.1}% ({})",
        growth * 100.0,
        if growth.abs() <= 0.10 { "flat" } else { "NOT flat" }
    );
    println!(
        "soak: samples {:.0}, ring-buffer drops {:.0} ({:.2}%), filtered {:.0}, exec events {:.0}, exits {:.0}, budget back-offs {:.0}, agent CPU {:.1} s",
        m("allocbpf_samples_total"),
        m("allocbpf_ring_buffer_drops_total"),
        100.0 * m("allocbpf_ring_buffer_drops_total")
            / (m("allocbpf_samples_total") + m("allocbpf_ring_buffer_drops_total")),
        m("allocbpf_filtered_samples_total"),
        m("allocbpf_exec_events_total"),
        m("allocbpf_exit_events_total"),
        m("allocbpf_budget_backoffs_total"),
        m("allocbpf_cpu_seconds"),
    );
    println!(
        "soak: ring buffer peak {:.1} MiB waiting at one read; images released {:.0}",
        m("allocbpf_ring_buffer_peak_bytes") / (1 << 20) as f64,
        m("allocbpf_released_images_total"),
    );
    println!(
        "soak: store {} profiles; agent: {}",
        stored_profiles(&store).len(),
        log.lines().last().unwrap_or("")
    );
    Ok(())
}
