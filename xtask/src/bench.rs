//! `cargo xtask bench`: nanoseconds per malloc(32)+free pair for
//! - `none`: no probe;
//! - `floor`: an empty eBPF program on the same functions (`allocbpf --empty-probes`),
//!   the cost of the uprobe trap itself, below which no uprobe design can go;
//! - `allocbpf`: the real sampler at 512 KiB.
//!
//! The configurations alternate within each round so that drift of this noisy VM hits
//! all three alike; medians over rounds are reported, and the ratio allocbpf/floor is
//! taken per round and its median printed (target: <= 1.10).

use std::{path::Path, process::Command};

use anyhow::{bail, Context, Result};

use crate::{
    setup,
    util::{attach, build_allocbpf, compile_c, finish, is_root, Workload},
};

#[derive(Clone, Copy, PartialEq)]
enum Config {
    None,
    Floor,
    Allocbpf,
}

impl Config {
    fn name(self) -> &'static str {
        match self {
            Config::None => "no probe",
            Config::Floor => "empty uprobe program (floor)",
            Config::Allocbpf => "allocbpf --rate 512KiB",
        }
    }
}

/// One run of the bench workload under `config`; returns ns per malloc+free pair.
fn measure(config: Config, bench: &Path, allocbpf: &Path, iterations: u64) -> Result<f64> {
    let mut workload = Workload::start(Command::new(bench).arg(iterations.to_string()))?;
    let pid = workload.pid.clone();
    let profiler = match config {
        Config::None => None,
        Config::Floor => Some(attach(
            allocbpf,
            &["--pid", &pid, "--output", "/dev/null", "--empty-probes"],
            false,
        )?),
        Config::Allocbpf => Some(attach(
            allocbpf,
            &[
                "--pid",
                &pid,
                "--output",
                "/dev/null",
                "--rate",
                "512KiB",
                "--format",
                "json",
            ],
            false,
        )?),
    };
    workload.go()?;
    let result = workload.stdout.next().context("bench result")??;
    workload.child.wait()?;
    if let Some((child, stderr)) = profiler {
        finish(child, stderr, false)?;
    }
    result.trim().parse().context("bench output")
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// Runs the benchmark and prints figures and ratios.
pub fn bench(rounds: usize, iterations: u64) -> Result<()> {
    setup::ensure()?;
    if !is_root() {
        bail!("the benchmark attaches uprobes: run `sudo cargo xtask bench`");
    }
    let allocbpf = build_allocbpf()?;
    let bench = compile_c("bench", &["-O2"])?;
    let configs = [Config::None, Config::Floor, Config::Allocbpf];
    let mut results: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    for round in 0..rounds {
        for (i, &config) in configs.iter().enumerate() {
            let ns = measure(config, &bench, &allocbpf, iterations)?;
            eprintln!("round {}: {:<30} {ns:>9.1} ns", round + 1, config.name());
            results[i].push(ns);
        }
    }
    let mut ratios: Vec<f64> = results[2]
        .iter()
        .zip(&results[1])
        .map(|(a, f)| a / f)
        .collect();
    println!();
    println!("malloc(32)+free pairs, {iterations} per run, {rounds} rounds (median [min, max])");
    for (config, values) in configs.iter().zip(results.iter_mut()) {
        let (min, max) = values
            .iter()
            .fold((f64::MAX, f64::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        println!(
            "  {:<30} {:>9.1} ns  [{min:.1}, {max:.1}]",
            config.name(),
            median(values)
        );
    }
    let ratio = median(&mut ratios);
    println!(
        "  allocbpf / floor (median of per-round ratios): {ratio:.3}  (target <= 1.10: {})",
        if ratio <= 1.10 { "met" } else { "NOT met" }
    );
    println!(
        "  allocbpf - floor: {:.1} ns per call in the sampler program",
        median(&mut results[2].clone()) - median(&mut results[1].clone())
    );
    Ok(())
}
