//! The accuracy harness: repeated simulated trials of known workloads through the
//! kernel's sampling code (see [`crate::simulate`]), summarised per site.
//!
//! For each site over `T` trials it reports the mean estimate against the truth in
//! standard errors, the observed spread against the variance formula
//! `Var = sum over allocations of S^2 (1-p)/p`, `p = 1 - exp(-S/R)` (0 for certain
//! allocations), and how often the 95% interval covered the truth. `cargo xtask
//! accuracy` prints all of it; `tests/tests/accuracy.rs` asserts it.

pub mod kernel;
pub mod plot;
pub mod print;
pub mod stats;
pub mod time_sampling;
pub mod workloads;

use allocbpf_profile::aggregate::StackStats;
use allocbpf_profile::estimate::Confidence;

use self::{stats::*, workloads::SimWorkload};
use crate::{
    simulate::{Alloc, Simulator},
    sites::{allocation_variance, sample_probability},
};

/// Trials per workload: with coverage c = 0.95 the observed coverage has standard
/// deviation sqrt(c(1-c)/T) = 0.22% at T = 10,000, so the 93-97% band is 9 sd wide on
/// each side of the nominal level.
pub const TRIALS: usize = 10_000;

/// Trials of each memorylessness case (one or two samples each, so more are needed).
pub const MEMORYLESS_TRIALS: usize = 50_000;

/// One site's figures over all trials.
#[derive(Clone, Debug)]
pub struct SiteSummary {
    /// Workload name.
    pub workload: String,
    /// Site name.
    pub site: String,
    /// Exact bytes.
    pub truth: f64,
    /// Mean of the estimates.
    pub mean: f64,
    /// Standard error of that mean (observed sd / sqrt(T)).
    pub standard_error: f64,
    /// (mean - truth) / standard error.
    pub z: f64,
    /// Observed standard deviation of the estimates.
    pub sd_observed: f64,
    /// Standard deviation from the variance formula.
    pub sd_predicted: f64,
    /// Observed variance / predicted variance.
    pub variance_ratio: f64,
    /// Standard deviation of that ratio under the null (from the observed kurtosis).
    pub variance_ratio_sd: f64,
    /// Fraction of trials whose 95% interval contained the truth.
    pub coverage: f64,
    /// Mean number of samples per trial.
    pub mean_samples: f64,
    /// Estimates, interval bounds, per trial (for plots).
    pub trials: Vec<(f64, f64, f64)>,
}

impl SiteSummary {
    /// True if sampling is certain for every allocation of the site (zero variance).
    pub fn is_exact(&self) -> bool {
        self.sd_predicted == 0.0
    }
}

/// Predicted variance of a site's estimate, recomputed here from the allocations.
pub fn predicted_variance(allocations: &[Alloc], site: usize, rate: u64) -> f64 {
    allocations
        .iter()
        .filter(|a| a.site == site)
        .map(|a| allocation_variance(a.size, rate))
        .sum()
}

/// Runs `trials` trials of `workload` (deterministic given `seed`) and summarises each
/// site, plus a `(total)` row for all sites together.
pub fn run_workload(workload: &SimWorkload, trials: usize, seed: u64) -> Vec<SiteSummary> {
    let sites = workload.sites.len();
    let mut per_site: Vec<Vec<StackStats>> = vec![Vec::with_capacity(trials); sites + 1];
    let mut sim = Simulator::new(workload.rate, workload.threads, sites, seed);
    for _ in 0..trials {
        sim.next_trial();
        for &a in &workload.allocations {
            sim.allocate(a);
        }
        let mut total = StackStats::default();
        for (i, stats) in sim.sites.iter().enumerate() {
            total.merge(stats);
            per_site[i].push(*stats);
        }
        per_site[sites].push(total);
    }
    let truth = workload.truth();
    let mut predicted: Vec<f64> = (0..sites)
        .map(|s| predicted_variance(&workload.allocations, s, workload.rate))
        .collect();
    predicted.push(predicted.iter().sum());
    let mut names: Vec<String> = workload.sites.iter().map(|s| s.to_string()).collect();
    names.push("(total)".into());
    let mut truths: Vec<f64> = truth.iter().map(|&t| t as f64).collect();
    truths.push(truths.iter().sum());
    (0..=sites)
        .map(|i| summarise(workload, &names[i], truths[i], predicted[i], &per_site[i]))
        .collect()
}

fn summarise(
    workload: &SimWorkload,
    site: &str,
    truth: f64,
    predicted_variance: f64,
    trials: &[StackStats],
) -> SiteSummary {
    let estimates: Vec<f64> = trials.iter().map(|t| t.estimated_bytes).collect();
    let intervals: Vec<(f64, f64, f64)> = trials
        .iter()
        .map(|t| {
            let i = t.bytes_interval(workload.rate, Confidence::DEFAULT);
            (t.estimated_bytes, i.lo, i.hi)
        })
        .collect();
    let covered = intervals
        .iter()
        .filter(|(_, lo, hi)| *lo <= truth && truth <= *hi)
        .count();
    let n = trials.len();
    let m = mean(&estimates);
    let var = variance(&estimates);
    let se = (var / n as f64).sqrt();
    SiteSummary {
        workload: workload.name.clone(),
        site: site.to_string(),
        truth,
        mean: m,
        standard_error: se,
        z: if se > 0.0 { (m - truth) / se } else { 0.0 },
        sd_observed: var.sqrt(),
        sd_predicted: predicted_variance.sqrt(),
        variance_ratio: if predicted_variance > 0.0 {
            var / predicted_variance
        } else {
            1.0
        },
        variance_ratio_sd: variance_ratio_sd(n, excess_kurtosis(&estimates)),
        coverage: covered as f64 / n as f64,
        mean_samples: trials.iter().map(|t| t.samples as f64).sum::<f64>() / n as f64,
        trials: intervals,
    }
}

/// Empirical sampling probability of one allocation size.
#[derive(Clone, Debug)]
pub struct ProbabilityCheck {
    /// Allocation size in bytes.
    pub size: u64,
    /// Mean sampling interval.
    pub rate: u64,
    /// Allocations made.
    pub allocations: u64,
    /// Fraction sampled.
    pub observed: f64,
    /// `1 - exp(-S/R)`, or 1 at and above the certain threshold.
    pub expected: f64,
    /// Binomial standard deviation of `observed`.
    pub sd: f64,
}

/// Sizes for the heapprofd check at R = 512 KiB: 4 KiB to 2 MiB, 1.5 MiB (heapprofd's
/// ">= 95%" example) and 2.5 MiB (above the certain threshold).
pub const HEAPPROFD_SIZES: [u64; 8] = [
    4 << 10,
    64 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
    3 << 19,
    2 << 20,
    5 << 19,
];

/// heapprofd's claim: P(sampled) = 1 - exp(-S/R). `allocations` allocations of each
/// size in a row on one thread (each one sees the countdown its predecessors left,
/// which by memorylessness has the same law as a fresh one).
pub fn sampling_probabilities(
    rate: u64,
    sizes: &[u64],
    allocations: u64,
    seed: u64,
) -> Vec<ProbabilityCheck> {
    let threshold = allocbpf_profile::estimate::certain_threshold(rate);
    sizes
        .iter()
        .map(|&size| {
            let mut sim = Simulator::new(rate, 1, 1, seed ^ size);
            let sampled = (0..allocations)
                .filter(|_| {
                    sim.allocate(Alloc {
                        thread: 0,
                        site: 0,
                        size,
                    })
                })
                .count();
            let expected = if size >= threshold {
                1.0
            } else {
                sample_probability(size, rate)
            };
            ProbabilityCheck {
                size,
                rate,
                allocations,
                observed: sampled as f64 / allocations as f64,
                expected,
                sd: (expected * (1.0 - expected) / allocations as f64).sqrt(),
            }
        })
        .collect()
}

/// The memorylessness check: 1 MiB as one allocation and as 1024 x 1 KiB at 512 KiB.
/// Returns (single, split) summaries over `trials` trials.
pub fn memorylessness(trials: usize, seed: u64) -> (SiteSummary, SiteSummary) {
    let rate = 512 << 10;
    let workload = |name: &str, sizes: Vec<u64>| SimWorkload {
        name: name.to_string(),
        what: "1 MiB",
        rate,
        sites: vec!["one_mib"],
        threads: 1,
        allocations: sizes
            .into_iter()
            .map(|size| Alloc {
                thread: 0,
                site: 0,
                size,
            })
            .collect(),
    };
    let single = run_workload(&workload("1 x 1 MiB", vec![1 << 20]), trials, seed);
    let split = run_workload(
        &workload("1024 x 1 KiB", vec![1024; 1024]),
        trials,
        seed + 1,
    );
    (single[0].clone(), split[0].clone())
}

/// The scales the probe's countdowns switch through in [`scaled_rates`], as
/// `(pressure level, window shift)`: raised intervals (ring pressure), denser ones
/// (observation windows) and both.
pub const SCALE_SCHEDULE: [(u32, u32); 8] = [
    (0, 0),
    (2, 0),
    (0, 3),
    (5, 0),
    (1, 2),
    (0, 4),
    (3, 0),
    (0, 0),
];

/// Allocations between two changes of scale in [`scaled_rates`].
pub const SCALE_EVERY: usize = 500;

/// Ring pressure and observation windows, through the probe's own code: one site of
/// 4,000 allocations (64 B to 64 KiB) at 64 KiB whose countdowns switch scale every
/// [`SCALE_EVERY`] allocations through [`SCALE_SCHEDULE`] (at points that do not depend
/// on the countdowns, as the kernel's levels and shifts), each sample weighed at the
/// mean interval it was drawn at. Predicted variance: each allocation's at its own
/// rate.
pub fn scaled_rates(trials: usize, seed: u64) -> SiteSummary {
    let rate = 64 << 10;
    let sizes = [64u64, 1024, 8192, 65536];
    let allocations: Vec<Alloc> = (0..4000)
        .map(|i| Alloc {
            thread: i % 2,
            site: 0,
            size: sizes[i % sizes.len()],
        })
        .collect();
    let scale_of = |i: usize| SCALE_SCHEDULE[(i / SCALE_EVERY) % SCALE_SCHEDULE.len()];
    let workload = SimWorkload {
        name: "scaled rates".into(),
        what: "64 B-64 KiB at 64 KiB, scale changing every 500 calls",
        rate,
        sites: vec!["scaled"],
        threads: 2,
        allocations,
    };
    let mut sim = Simulator::new(rate, workload.threads, 1, seed);
    let mut trials_stats = Vec::with_capacity(trials);
    for _ in 0..trials {
        sim.next_trial();
        for (i, &a) in workload.allocations.iter().enumerate() {
            let (level, window) = scale_of(i);
            sim.allocate_scaled(a, level, window);
        }
        trials_stats.push(sim.sites[0]);
    }
    let truth: f64 = workload.allocations.iter().map(|a| a.size as f64).sum();
    let predicted: f64 = workload
        .allocations
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let (level, window) = scale_of(i);
            allocation_variance(a.size, allocbpf_common::sampling_rate(rate, level, window))
        })
        .sum();
    summarise(&workload, "scaled", truth, predicted, &trials_stats)
}

/// Table-quality figures for a stream of interval draws.
#[derive(Clone, Debug)]
pub struct IntervalQuality {
    /// Draws examined.
    pub draws: usize,
    /// KS distance to floor(Exp(rate)).
    pub ks_distance: f64,
    /// KS critical distance at significance `ks_alpha`.
    pub ks_critical: f64,
    /// The significance of `ks_critical`.
    pub ks_alpha: f64,
    /// Lag-1..=5 autocorrelations of one thread's draws.
    pub autocorrelations: Vec<f64>,
    /// Correlation between two threads' i-th draws.
    pub cross_thread: f64,
    /// Mean of the draws / rate.
    pub mean_ratio: f64,
}

/// Draws intervals through table refreshes the way the probe does, for two threads
/// that alternate, and measures their law and dependence.
pub fn interval_quality(rate: u64, draws: usize, seed: u64) -> IntervalQuality {
    let mut sim = Simulator::new(rate, 2, 1, seed);
    let mut a = Vec::with_capacity(draws);
    let mut b = Vec::with_capacity(draws);
    for _ in 0..draws {
        a.push(sim.draw_interval());
        b.push(sim.draw_interval());
    }
    // Seeded: the same draws every run, so the textbook significance is enough.
    interval_quality_of(&a, &b, rate, 0.001)
}

/// Table-quality figures for two threads' observed draws (simulated or from the kernel),
/// with the KS critical distance at significance `ks_alpha`.
pub fn interval_quality_of(a: &[u64], b: &[u64], rate: u64, ks_alpha: f64) -> IntervalQuality {
    let af: Vec<f64> = a.iter().map(|&x| x as f64).collect();
    let bf: Vec<f64> = b.iter().map(|&x| x as f64).collect();
    let all: Vec<u64> = a.iter().chain(b).copied().collect();
    IntervalQuality {
        draws: all.len(),
        ks_distance: ks_distance_floor_exponential(&all, rate as f64),
        ks_critical: ks_critical(all.len(), ks_alpha),
        ks_alpha,
        autocorrelations: (1..=5).map(|k| autocorrelation(&af, k)).collect(),
        cross_thread: correlation(&af, &bf),
        mean_ratio: all.iter().map(|&x| x as f64).sum::<f64>() / all.len() as f64 / rate as f64,
    }
}

/// Interval coverage against the expected number of samples: a site of 1 KiB
/// allocations sized to expect `lambda` samples, `trials` trials per point.
/// Returns `(lambda, coverage)` pairs.
pub fn coverage_by_samples(lambdas: &[f64], trials: usize, seed: u64) -> Vec<(f64, f64)> {
    let rate = workloads::SIM_RATE;
    let size = 1024;
    lambdas
        .iter()
        .map(|&lambda| {
            let count = (lambda / sample_probability(size, rate)).round() as usize;
            let workload = SimWorkload {
                name: format!("lambda_{lambda}"),
                what: "1 KiB allocations",
                rate,
                sites: vec!["site"],
                threads: 1,
                allocations: vec![
                    Alloc {
                        thread: 0,
                        site: 0,
                        size
                    };
                    count
                ],
            };
            (lambda, run_workload(&workload, trials, seed)[0].coverage)
        })
        .collect()
}
