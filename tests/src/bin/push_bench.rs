//! What pushing costs the agent (`cargo xtask bench --parts push`): profiles per
//! second delivered to a real store and the agent's CPU per delivered profile, with 1
//! and 100 processes profiled, 1 s intervals. Stores: a real OpenTelemetry Collector
//! (OTLP/HTTP, always) and a real Pyroscope (the Connect push API, when
//! `$ALLOCBPF_PYROSCOPE` names a server binary: the Go module proxy refuses to serve
//! it, see docs/build.md).
//!
//! Each round runs the agent three times over the same processes: without push (the
//! baseline: sampling, cutting, storing), then pushing to each store. The push's own
//! cost per profile is the agent's CPU rate above the baseline's, divided by the
//! delivery rate; medians of the rounds are printed with the ratio to the baseline's
//! CPU per stored profile.

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use allocbpf_e2e::{
    agent::{agent_workload, metric, scrape_within, AgentProcess},
    bench::{cpu_seconds, median, rounds_arg},
    otelcol::{Collector, CollectorOptions},
    pyroscope::{Pyroscope, PyroscopeOptions},
    scratch_dir, Workload,
};
use anyhow::Result;

const METRICS: &str = "127.0.0.1:19498";
/// How long each measured run lasts, after its warm-up.
const MEASURED: Duration = Duration::from_secs(15);
const WARM_UP: Duration = Duration::from_secs(4);

/// One measured run: (profiles per second, agent CPU seconds per second), counting
/// delivered profiles if `pushing`, else stored ones.
fn run(store: &Path, config: &str, pushing: bool) -> Result<(f64, f64)> {
    let _ = std::fs::remove_dir_all(store);
    let config_path = store.with_extension("toml");
    std::fs::write(&config_path, config)?;
    let agent = AgentProcess::start(
        &[
            "--config",
            config_path.to_str().unwrap(),
            "--store",
            store.to_str().unwrap(),
            "--interval",
            "1s",
        ],
        &[],
    )?;
    let pid = agent.child.id();
    std::thread::sleep(WARM_UP);
    let counter = if pushing {
        "allocbpf_push_delivered_total"
    } else {
        "allocbpf_profiles_written_total"
    };
    let count = || -> Result<f64> {
        let text = scrape_within(METRICS, Duration::from_secs(5))?;
        Ok(metric(&text, counter).unwrap_or(0.0))
    };
    let (count0, cpu0, t0) = (count()?, cpu_seconds(pid)?, Instant::now());
    std::thread::sleep(MEASURED);
    let (count1, cpu1, elapsed) = (count()?, cpu_seconds(pid)?, t0.elapsed().as_secs_f64());
    agent.terminate(Duration::from_secs(60))?;
    Ok(((count1 - count0) / elapsed, (cpu1 - cpu0) / elapsed))
}

fn main() -> Result<()> {
    let rounds = rounds_arg(3)?;
    let scratch = scratch_dir("push-bench");
    let collector = Collector::start(&scratch.join("otelcol"), CollectorOptions::default())?;
    let pyroscope = match std::env::var_os("ALLOCBPF_PYROSCOPE") {
        Some(_) => Some(Pyroscope::start(
            &scratch.join("pyroscope"),
            PyroscopeOptions::default(),
        )?),
        None => {
            println!(
                "push bench: no $ALLOCBPF_PYROSCOPE: Pyroscope left out (the Go module proxy \
                 refuses github.com/grafana/pyroscope; docs/build.md)"
            );
            None
        }
    };
    let mut stores: Vec<(&str, String)> = vec![(
        "otlp collector",
        format!("otlp_endpoint = \"{}\"\n", collector.endpoint()),
    )];
    if let Some(pyroscope) = &pyroscope {
        stores.push((
            "pyroscope push",
            format!("url = \"{}\"\n", pyroscope.endpoint()),
        ));
    }
    let binary: PathBuf = agent_workload();
    for processes in [1usize, 100] {
        // 100 calls a second each (64 KiB every 10 ms): the agent's work is the
        // intervals' profiles, not the samples.
        let workloads: Vec<Workload> = (0..processes)
            .map(|_| Workload::start(&binary, &["3600", "65536", "10000"]))
            .collect::<Result<_>>()?;
        let base = format!("comm = \"^agentwl\"\nmetrics_address = \"{METRICS}\"\n");
        let mut baseline = Vec::new();
        let mut measured: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); stores.len()];
        for round in 0..rounds {
            let (stored, cpu) = run(&scratch.join(format!("base-{round}")), &base, false)?;
            baseline.push((stored, cpu));
            for (i, (_, push)) in stores.iter().enumerate() {
                let config = format!("{base}[push]\n{push}timeout = \"10s\"\n");
                let (delivered, cpu_push) =
                    run(&scratch.join(format!("push-{i}-{round}")), &config, true)?;
                measured[i].0.push(delivered);
                // The push's CPU per profile: above this round's baseline.
                measured[i]
                    .1
                    .push((cpu_push - cpu).max(0.0) / delivered.max(1e-9));
            }
        }
        let base_rate = median(&baseline.iter().map(|b| b.0).collect::<Vec<_>>());
        let base_cpu_per_profile = median(
            &baseline
                .iter()
                .map(|(stored, cpu)| cpu / stored.max(1e-9))
                .collect::<Vec<_>>(),
        );
        println!(
            "push bench, {processes} process(es), 1 s intervals, {rounds} rounds (medians):\n  \
             baseline (store only): {base_rate:.1} profiles/s stored, {:.2} ms agent CPU per stored profile",
            base_cpu_per_profile * 1e3
        );
        for ((name, _), (delivered, cpu)) in stores.iter().zip(&measured) {
            let cpu = median(cpu);
            println!(
                "  {name}: {:.1} profiles/s delivered ({:.2} of stored), push {:.2} ms agent CPU per delivered profile ({:.2}x the baseline's per stored profile)",
                median(delivered),
                median(delivered) / base_rate.max(1e-9),
                cpu * 1e3,
                cpu / base_cpu_per_profile.max(1e-12)
            );
        }
        drop(workloads);
    }
    Ok(())
}
