//! The agent soak bench (`cargo xtask soak`): `allocbpf agent` runs system-wide at a
//! high sampling rate while a steady allocator runs and short-lived processes churn
//! (a new one every 100 ms, each living ~50 ms). Every 10 s it records the agent's
//! resident memory and its metrics; at the end it prints the series and whether RSS
//! stayed flat (last-third median within 10% of the second-third median, after the
//! first third's warm-up) and the drops the kernel counted.
//!
//! Adversaries run through the churn: every 15 s a `swapexe` process (tests/workloads)
//! turns its executable's path into a FIFO, a symlink to `/dev/zero` or to libc, or keeps
//! swapping it with libc while being an allocator itself (each lives 10 s); and every
//! 5 s 64 idle connections are opened to `/metrics` (four times the agent's limit). Open
//! descriptors and the kernel's per-process map entries are recorded with RSS, and must
//! stay flat too.

use std::{
    path::PathBuf,
    process::{Command, Stdio},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use allocbpf_e2e::{
    agent::{metric, scrape_within, stored_profiles, AgentProcess},
    bench::median,
    compile_workload, scratch_dir, status_bytes,
};
use anyhow::{Context, Result};

/// Median of the last third over the median of the middle third, minus one.
fn growth(series: &[f64]) -> f64 {
    let third = series.len() / 3;
    median(&series[2 * third..]) / median(&series[third..2 * third]) - 1.0
}

/// Scrapes the agent's metrics, retrying while idle connections hold its slots.
fn scrape_retrying(address: &str) -> String {
    for _ in 0..20 {
        if let Ok(text) = scrape_within(address, Duration::from_secs(5)) {
            if text.contains("allocbpf_samples_total") {
                return text;
            }
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    String::new()
}

/// Runs the hostile processes and idle connections until `stop`.
fn adversaries(stop: Arc<AtomicBool>, address: String) -> Result<std::thread::JoinHandle<u64>> {
    let plain = compile_workload("swapexe", &["-O1"])?;
    let own_malloc = compile_workload("swapexe", &["-O1", "-DOWN_MALLOC"])?;
    Ok(std::thread::spawn(move || {
        let modes = ["fifo", "zero", "libc", "race"];
        let mut started = 0u64;
        let mut hostile: Option<(std::process::Child, Instant)> = None;
        let mut last_hostile = Instant::now() - Duration::from_secs(15);
        let mut idle = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            if last_hostile.elapsed() >= Duration::from_secs(15) {
                last_hostile = Instant::now();
                let mode = modes[started as usize % modes.len()];
                let source = if mode == "race" { &own_malloc } else { &plain };
                let copy = scratch_dir(&format!("soak-hostile-{started}")).join("swapexe");
                let _ = std::fs::remove_file(&copy);
                if std::fs::copy(source, &copy).is_ok() {
                    if let Ok(child) = Command::new(&copy).arg(mode).stdout(Stdio::null()).spawn() {
                        hostile = Some((child, Instant::now()));
                        started += 1;
                    }
                }
            }
            if let Some((child, since)) = hostile.as_mut() {
                if since.elapsed() >= Duration::from_secs(10) {
                    let _ = child.kill();
                    let _ = child.wait();
                    hostile = None;
                }
            }
            idle.clear();
            for _ in 0..64 {
                if let Ok(stream) = std::net::TcpStream::connect(&address) {
                    idle.push(stream);
                }
            }
            std::thread::sleep(Duration::from_secs(5));
        }
        if let Some((mut child, _)) = hostile {
            let _ = child.kill();
            let _ = child.wait();
        }
        started
    }))
}

fn open_descriptors(pid: u32) -> f64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(f64::NAN, |d| d.count() as f64)
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
    let churn = churn(stop.clone(), spawned.clone(), workload.clone());

    let adversary = adversaries(stop.clone(), address.to_string())?;

    let series = record(agent_pid, address, total, &spawned);
    stop.store(true, Ordering::Relaxed);
    churn.join().ok();
    let hostile = adversary.join().unwrap_or(0);
    let _ = steady.kill();
    let _ = steady.wait();
    let log = agent.terminate(Duration::from_secs(60))?;

    println!(
        "soak: {} short-lived processes started, {hostile} hostile ones",
        spawned.load(Ordering::Relaxed)
    );
    print_summary(&series);
    println!(
        "soak: store {} profiles; agent: {}",
        stored_profiles(&store).len(),
        log.lines().last().unwrap_or("")
    );
    Ok(())
}

/// Starts the churn until `stop`: a short-lived `workload` (~50 ms) every 100 ms,
/// each counted in `spawned`.
fn churn(
    stop: Arc<AtomicBool>,
    spawned: Arc<AtomicU64>,
    workload: PathBuf,
) -> std::thread::JoinHandle<()> {
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
}

/// What the soak recorded every 10 s, and the agent's last metrics.
struct Series {
    /// The agent's resident memory, MiB.
    rss: Vec<f64>,
    /// Its open descriptors.
    fds: Vec<f64>,
    /// The kernel's per-process map entries.
    kernel: Vec<f64>,
    /// The last scrape that answered.
    last_metrics: String,
}

/// Records the agent's (`agent_pid`, metrics at `address`) RSS, descriptors and
/// metrics every 10 s for `total`, printing a line each time (`spawned`: the churn's
/// count so far).
fn record(agent_pid: u32, address: &str, total: Duration, spawned: &AtomicU64) -> Series {
    println!(
        "{:>7} {:>9} {:>5} {:>7} {:>10} {:>8} {:>9} {:>8} {:>8}",
        "t (s)", "RSS MiB", "fds", "kernel", "samples", "drops", "processes", "churned", "tracked"
    );
    let started = Instant::now();
    let (mut rss_series, mut fd_series, mut kernel_series) = (Vec::new(), Vec::new(), Vec::new());
    let mut last_metrics = String::new();
    while started.elapsed() < total {
        std::thread::sleep(Duration::from_secs(10).min(total.saturating_sub(started.elapsed())));
        let rss = status_bytes(agent_pid, "VmRSS").unwrap_or(0) as f64 / (1 << 20) as f64;
        let fds = open_descriptors(agent_pid);
        let text = scrape_retrying(address);
        let m = |name: &str| metric(&text, name).unwrap_or(f64::NAN);
        let t = started.elapsed().as_secs_f64();
        println!(
            "{t:>7.0} {rss:>9.1} {fds:>5.0} {:>7.0} {:>10.0} {:>8.0} {:>9.0} {:>8} {:>8.0}",
            m("allocbpf_kernel_process_entries"),
            m("allocbpf_samples_total"),
            m("allocbpf_ring_buffer_drops_total"),
            m("allocbpf_exit_events_total"),
            spawned.load(Ordering::Relaxed),
            m("allocbpf_tracked_processes"),
        );
        rss_series.push(rss);
        fd_series.push(fds);
        kernel_series.push(m("allocbpf_kernel_process_entries"));
        if !text.is_empty() {
            last_metrics = text;
        }
    }
    Series {
        rss: rss_series,
        fds: fd_series,
        kernel: kernel_series,
        last_metrics,
    }
}

/// Prints whether each series stayed flat and the agent's last figures.
fn print_summary(series: &Series) {
    let m = |name: &str| metric(&series.last_metrics, name).unwrap_or(f64::NAN);
    let flat = |g: f64| if g.abs() <= 0.10 { "flat" } else { "NOT flat" };
    for (what, series) in [
        ("agent RSS", &series.rss),
        ("open descriptors", &series.fds),
        ("kernel process entries", &series.kernel),
    ] {
        let g = growth(series);
        println!(
            "soak: {what}: last third vs middle third (medians) {:+.1}% ({}); max {:.1}",
            g * 100.0,
            flat(g),
            series.iter().copied().fold(f64::NAN, f64::max)
        );
    }
    println!(
        "soak: samples {:.0}, ring-buffer drops {:.0} ({:.2}%), filtered {:.0}, exec events {:.0}, exits {:.0}, windows opened {:.0}, agent CPU {:.1} s",
        m("allocbpf_samples_total"),
        m("allocbpf_ring_buffer_drops_total"),
        100.0 * m("allocbpf_ring_buffer_drops_total")
            / (m("allocbpf_samples_total") + m("allocbpf_ring_buffer_drops_total")),
        m("allocbpf_filtered_samples_total"),
        m("allocbpf_exec_events_total"),
        m("allocbpf_exit_events_total"),
        m("allocbpf_window_attaches_total"),
        m("allocbpf_cpu_seconds"),
    );
    println!(
        "soak: ring buffer peak {:.1} MiB waiting at one read; images released {:.0}",
        m("allocbpf_ring_buffer_peak_bytes") / (1 << 20) as f64,
        m("allocbpf_released_images_total"),
    );
}
