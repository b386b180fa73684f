//! The end-to-end coverage check: `workloads/coverage.c` (4,000 sites with known truth,
//! two threads) profiled by the real allocbpf through real uprobes, then compared with
//! the truth the workload prints. Used by `tests/tests/coverage.rs` (assertions) and
//! `cargo xtask accuracy` (figures).

use std::{collections::HashMap, path::Path, time::Duration};

use anyhow::{ensure, Context, Result};
use serde_json::Value;

use super::{interval_quality_of, stats, IntervalQuality};
use crate::{
    compile_workload, scratch_dir,
    sites::{allocation_variance, sample_probability},
    Profiler, Workload,
};

/// Mean sampling interval of the run: the workload sizes its sites for it.
pub const COVERAGE_RATE: u64 = 64 * 1024;

/// Sites in the workload.
pub const COVERAGE_SITES: usize = 4000;

/// One site: truth from the workload, estimate and interval from allocbpf.
#[derive(Clone, Debug)]
pub struct SiteResult {
    /// Block size.
    pub size: u64,
    /// Calls made.
    pub calls: u64,
    /// Exact bytes.
    pub truth: f64,
    /// Samples allocbpf received.
    pub samples: u64,
    /// Estimated bytes.
    pub estimate: f64,
    /// 95% interval.
    pub interval: (f64, f64),
    /// Standard deviation of the estimate from the variance formula.
    pub sd: f64,
}

/// Everything the run measured.
#[derive(Clone, Debug)]
pub struct KernelCoverage {
    /// Sites the workload reported.
    pub sites: usize,
    /// Sites found as exactly one stack in the profile (the others are left out).
    pub results: Vec<SiteResult>,
    /// Fraction of those whose interval contained the truth.
    pub coverage: f64,
    /// Mean of (estimate - truth) / sd over sites; ~N(0, 1/n) if unbiased.
    pub z_mean: f64,
    /// Variance of those standardized errors; ~1 if the variance formula holds.
    pub z_variance: f64,
    /// Per size band: (band label, observed samples, expected samples, sd).
    pub probability_bands: Vec<(String, f64, f64, f64)>,
    /// The kernel's interval picks, two threads.
    pub intervals: IntervalQuality,
    /// Ring-buffer drops reported by allocbpf.
    pub drops: u64,
    /// Samples in the profile.
    pub samples: u64,
}

/// Runs the workload under allocbpf and measures coverage.
pub fn run_coverage_workload() -> Result<KernelCoverage> {
    let binary = compile_workload(
        "coverage",
        &["-O1", "-g", "-fno-omit-frame-pointer", "-pthread", "-lm"],
    )?;
    let dir = scratch_dir("coverage");
    let profile_path = dir.join("coverage.json");
    let raw_path = dir.join("raw.jsonl");
    let mut workload = Workload::start(&binary, &[])?;
    let pid = workload.pid.to_string();
    let rate = COVERAGE_RATE.to_string();
    let profiler = Profiler::attach(&[
        "--pid",
        &pid,
        "--rate",
        &rate,
        "--format",
        "json",
        "--output",
        profile_path.to_str().context("path")?,
        "--raw-samples",
        raw_path.to_str().context("path")?,
        // ~4,000 samples per burst: frame-pointer stacks (the workload has them) keep
        // events small enough that the ring buffer never drops one.
        "--unwind",
        "fp",
    ])?;
    workload.go()?;
    workload.wait(Duration::from_secs(120))?;
    let output = workload.stdout.rest(Duration::from_secs(5));
    let finished = profiler.finish(Duration::from_secs(60))?;
    ensure!(
        finished.code == Some(0),
        "allocbpf failed: {}",
        finished.stderr
    );
    let profile: Value = serde_json::from_slice(&std::fs::read(&profile_path)?)?;
    analyse(&output, &profile, &raw_path)
}

/// `truth site_N size calls` lines -> site name -> (size, calls).
fn parse_truth(output: &str) -> HashMap<String, (u64, u64)> {
    output
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            (words.next()? == "truth").then_some(())?;
            let name = words.next()?.to_string();
            let size = words.next()?.parse().ok()?;
            let calls = words.next()?.parse().ok()?;
            Some((name, (size, calls)))
        })
        .collect()
}

fn analyse(output: &str, profile: &Value, raw_path: &Path) -> Result<KernelCoverage> {
    let truth = parse_truth(output);
    ensure!(
        truth.len() == COVERAGE_SITES,
        "workload reported {} sites",
        truth.len()
    );
    // Stacks per site: the site function is the allocation's immediate caller.
    let mut stacks: HashMap<&str, Vec<&Value>> = HashMap::new();
    for stack in profile["stacks"].as_array().context("stacks")? {
        let frames = stack["frames"].as_array().context("frames")?;
        if let Some(site) = frames
            .iter()
            .filter_map(Value::as_str)
            .find(|f| truth.contains_key(*f))
        {
            stacks.entry(site).or_default().push(stack);
        }
    }
    let threshold = allocbpf_profile::estimate::certain_threshold(COVERAGE_RATE);
    let mut results = Vec::new();
    for (name, &(size, calls)) in &truth {
        ensure!(
            size < threshold,
            "site sizes must be below the certain threshold"
        );
        let [stack] = stacks.get(name.as_str()).map(Vec::as_slice).unwrap_or(&[]) else {
            continue;
        };
        let ci = stack["bytes_ci95"].as_array().context("bytes_ci95")?;
        results.push(SiteResult {
            size,
            calls,
            truth: (size * calls) as f64,
            samples: stack["samples"].as_u64().unwrap_or(0),
            estimate: stack["estimated_bytes"].as_f64().unwrap_or(0.0),
            interval: (
                ci[0].as_f64().unwrap_or(f64::NAN),
                ci[1].as_f64().unwrap_or(f64::NAN),
            ),
            sd: (calls as f64 * allocation_variance(size, COVERAGE_RATE)).sqrt(),
        });
    }
    // Left out above: sites split over several stacks (a failed stack walk) and sites
    // without a sample (P = e^-60 at ~60 expected samples). The test bounds how many.
    let covered = results
        .iter()
        .filter(|r| r.interval.0 <= r.truth && r.truth <= r.interval.1)
        .count();
    let z: Vec<f64> = results
        .iter()
        .map(|r| (r.estimate - r.truth) / r.sd)
        .collect();

    let bands: [(&str, u64, u64); 4] = [
        ("1-4 KiB", 1024, 4096),
        ("4-16 KiB", 4096, 16384),
        ("16-64 KiB", 16384, 65536),
        ("64-192 KiB", 65536, 192 * 1024 + 1),
    ];
    let probability_bands = bands
        .iter()
        .map(|&(label, lo, hi)| {
            let in_band = results.iter().filter(|r| (lo..hi).contains(&r.size));
            let (mut observed, mut expected, mut variance) = (0.0, 0.0, 0.0);
            for r in in_band {
                let p = sample_probability(r.size, COVERAGE_RATE);
                observed += r.samples as f64;
                expected += r.calls as f64 * p;
                variance += r.calls as f64 * p * (1.0 - p);
            }
            (label.to_string(), observed, expected, variance.sqrt())
        })
        .collect();

    Ok(KernelCoverage {
        sites: truth.len(),
        coverage: covered as f64 / results.len().max(1) as f64,
        z_mean: stats::mean(&z),
        z_variance: stats::variance(&z),
        results,
        probability_bands,
        intervals: kernel_interval_picks(raw_path)?,
        drops: profile["totals"]["drops"].as_u64().unwrap_or(u64::MAX),
        samples: profile["totals"]["samples"].as_u64().unwrap_or(0),
    })
}

/// The intervals the kernel drew (`next_interval` of each countdown sample), for the
/// two threads with the most samples, in arrival order.
fn kernel_interval_picks(raw_path: &Path) -> Result<IntervalQuality> {
    let text = std::fs::read_to_string(raw_path)?;
    let mut by_thread: HashMap<u64, Vec<u64>> = HashMap::new();
    for line in text.lines() {
        let sample: Value = serde_json::from_str(line)?;
        if sample["certain"] == Value::Bool(true) {
            continue;
        }
        let tid = sample["tid"].as_u64().context("tid")?;
        let next = sample["next_interval"].as_u64().context("next_interval")?;
        by_thread.entry(tid).or_default().push(next);
    }
    let mut threads: Vec<Vec<u64>> = by_thread.into_values().collect();
    threads.sort_by_key(|t| std::cmp::Reverse(t.len()));
    ensure!(
        threads.len() >= 2,
        "raw samples from {} threads",
        threads.len()
    );
    let n = threads[0].len().min(threads[1].len());
    // The kernel's draws are not seeded, so every run is a new trial: at the textbook
    // 0.001 a correct sampler would fail one CI run in a thousand. At 1e-6 the critical
    // distance is 2.69/sqrt(n) (0.0054 for ~250,000 draws), which still rejects a mean
    // off by 2% (KS distance 0.02/e = 0.0074) or a table pick that is not uniform.
    Ok(interval_quality_of(
        &threads[0][..n],
        &threads[1][..n],
        COVERAGE_RATE,
        1e-6,
    ))
}
