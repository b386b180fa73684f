//! The truth about `workloads/sites.c`, and the statistical bounds derived from it.
//!
//! # Derivation of the bounds
//!
//! allocbpf samples each allocation of `S` bytes independently with probability
//! `p(S) = 1 - exp(-S/R)` (Poisson byte sampling with a memoryless countdown; allocations
//! of at least the certain threshold `T = ceil(R ln 100)` with probability 1), and a
//! sample stands for `S / p(S)` bytes. For one allocation the estimate `X` is
//! `S/p` with probability `p` and 0 otherwise, so
//!
//! ```text
//! E[X]   = S                                  (unbiased)
//! Var[X] = p (S/p)^2 - S^2 = S^2 (1 - p) / p   (0 when p = 1)
//! ```
//!
//! Allocations are sampled independently, so a site's estimate has mean equal to its
//! true bytes and variance `sum over its allocations of S^2 (1 - p) / p`. Every sampled
//! site below expects at least 240 samples at `TEST_RATE` (site_large's 16 are certain,
//! variance 0), where the sum of independent terms is close to normal (CLT); a bound of 5 standard deviations is exceeded with
//! probability about 6e-7 per check, so a correct sampler essentially never fails.
//! The number of samples taken is checked the same way: it is a sum of independent
//! Bernoulli(p) variables with mean `sum p` and variance `sum p (1 - p)`.

use serde_json::Value;

use crate::{estimated_bytes, stacks_with};

/// Mean sampling interval the tests use: small enough for hundreds of samples per site.
pub const TEST_RATE: u64 = 64 * 1024;

/// One allocation site of `sites.c`.
#[derive(Clone, Debug)]
pub struct Site {
    /// Function name (the innermost frame of its stacks).
    pub function: &'static str,
    /// (size in bytes, number of calls) of what the site allocates.
    pub allocations: &'static [(u64, u64)],
    /// Calls the site makes that allocate nothing (calloc overflow).
    pub empty_calls: u64,
}

/// Every site of `sites.c`, with what it allocates.
pub const SITES: &[Site] = &[
    Site {
        function: "site_small",
        allocations: &[(1024, 100_000)],
        empty_calls: 0,
    },
    Site {
        function: "site_large",
        allocations: &[(4 << 20, 16)],
        empty_calls: 0,
    },
    Site {
        function: "site_calloc",
        allocations: &[(1024, 20_000)],
        empty_calls: 0,
    },
    Site {
        function: "site_realloc",
        allocations: &[(512, 10_000), (2048, 10_000), (8192, 10_000)],
        empty_calls: 0,
    },
    Site {
        function: "site_reallocarray",
        allocations: &[(1600, 10_000)],
        empty_calls: 0,
    },
    Site {
        function: "site_aligned",
        allocations: &[(2048, 10_000), (8192, 5_000)],
        empty_calls: 0,
    },
    Site {
        function: "site_overflow",
        allocations: &[],
        empty_calls: 1,
    },
];

/// Checks a `--format json` profile of one run of `workloads/sites.c` at
/// [`TEST_RATE`]: exact totals to the byte and the call, no drop, every site named with
/// complete stacks (`site < run_sites < main`), its estimate and its sample count within
/// 5 standard deviations of the truth (the derivation above), and ordered intervals.
pub fn check_sites(json: &Value) {
    check_sites_counting_rejected(json, true);
}

/// [`check_sites`], where `rejected_counted` says whether the `calloc` that
/// `site_overflow` makes (its size overflows, so it fails before allocating) is
/// counted. It is where `calloc` is probed; musl's `calloc` checks the size and then
/// calls `malloc`, so it is left unprobed (every block it returns comes from `malloc`)
/// and a call it rejects reaches no probe.
pub fn check_sites_counting_rejected(json: &Value, rejected_counted: bool) {
    assert_eq!(json["rate"], TEST_RATE);
    // Exact totals count each call once, even where glibc forwards one probed function
    // to another (realloc(NULL) -> malloc, reallocarray -> realloc -> malloc).
    let (bytes, calls) = totals();
    let calls = calls - u64::from(!rejected_counted);
    assert_eq!(json["totals"]["exact_bytes"], bytes, "{:#}", json["totals"]);
    assert_eq!(json["totals"]["exact_calls"], calls, "{:#}", json["totals"]);
    assert_eq!(json["totals"]["drops"], 0);
    let total_ci = json["totals"]["bytes_ci95"]
        .as_array()
        .expect("totals.bytes_ci95");
    assert!(total_ci[0].as_f64() <= total_ci[1].as_f64());
    assert_eq!(json["confidence"], 0.95);
    check_site_list(json, SITES);
}

pub fn check_site_list(json: &Value, sites: &[Site]) {
    for site in sites {
        let stacks = stacks_with(json, site.function);
        let estimated = estimated_bytes(&stacks);
        let samples: u64 = stacks.iter().map(|s| s["samples"].as_u64().unwrap()).sum();
        let truth = site.bytes() as f64;
        let sd = site.estimate_sd(TEST_RATE);
        let (mean_samples, sd_samples) = site.samples_mean_sd(TEST_RATE);
        println!(
            "{:<18} truth {:>11} estimated {:>13.0} ({:+.2} sd)  samples {:>5} (expected {:.0})",
            site.function,
            truth,
            estimated,
            if sd > 0.0 {
                (estimated - truth) / sd
            } else {
                0.0
            },
            samples,
            mean_samples
        );
        if site.bytes() == 0 {
            assert!(stacks.is_empty(), "{} allocates nothing", site.function);
            continue;
        }
        assert!(
            !stacks.is_empty(),
            "{} missing from the profile",
            site.function
        );
        // Bound: 5 standard deviations of the estimator (derivation in src/sites.rs).
        assert!(
            (estimated - truth).abs() <= 5.0 * sd + 0.5,
            "{}: estimated {estimated}, truth {truth}, sd {sd}",
            site.function
        );
        // The count's law assumes the fixed rate: a run whose reader fell behind had
        // its intervals raised for a while (each sample weighed at its own, so the
        // estimate above still holds), and fewer samples.
        if json["counters"]["pressure_raises"].as_u64() == Some(0) {
            assert!(
                (samples as f64 - mean_samples).abs() <= 5.0 * sd_samples + 0.5,
                "{}: {samples} samples, expected {mean_samples} +- {sd_samples}",
                site.function
            );
        }
        // Every stack carries an ordered 95% interval; a site of certain allocations
        // only (site_large) has its exact bytes as the lower end.
        for stack in &stacks {
            let ci = stack["bytes_ci95"].as_array().expect("bytes_ci95");
            let (lo, hi) = (ci[0].as_f64().unwrap(), ci[1].as_f64().unwrap());
            assert!(0.0 < lo && lo <= hi, "{stack:#}");
            if sd == 0.0 {
                assert_eq!(lo, truth, "{stack:#}");
            }
        }
        // Every stack of the site is complete: site < run_sites < main.
        for stack in &stacks {
            let frames: Vec<&str> = stack["frames"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| f.as_str().unwrap())
                .collect();
            let at = frames.iter().position(|f| *f == site.function).unwrap();
            assert!(at >= 2, "{frames:?}");
            assert_eq!(&frames[at - 2..at], ["main", "run_sites"], "{frames:?}");
            // The site is innermost, or followed only by an allocation entry that
            // forwards to the probed one (libstdc++'s operator new to malloc, musl's
            // calloc to malloc, posix_memalign to memalign...), which is counted
            // where it lands.
            assert!(
                frames[at + 1..].iter().all(|f| is_forwarding_entry(f)),
                "allocation site is innermost: {frames:?}"
            );
        }
    }
}

/// A frame of an allocation entry that forwards to another: C++'s `operator new`, or
/// a C entry under any allocator prefix (`__posix_memalign`, `mi_posix_memalign`...).
fn is_forwarding_entry(frame: &str) -> bool {
    let name = frame.trim_start_matches('_');
    let name = ["mi_", "je_", "tc_", "libc_"]
        .iter()
        .find_map(|p| name.strip_prefix(p))
        .unwrap_or(name);
    frame.starts_with("operator new")
        || matches!(
            name,
            "calloc" | "posix_memalign" | "reallocarray" | "memalign" | "valloc" | "pvalloc"
        )
}

/// `p(S)` at `rate`, with heapprofd's certain threshold.
pub fn sample_probability(size: u64, rate: u64) -> f64 {
    let threshold = (rate as f64 * 100f64.ln()).ceil() as u64;
    if size >= threshold {
        1.0
    } else {
        1.0 - (-(size as f64) / rate as f64).exp()
    }
}

/// Variance contributed to a byte estimate by ONE allocation of `size` bytes:
/// `S^2 (1 - p) / p`, 0 for certain allocations (p = 1) and for empty calls.
pub fn allocation_variance(size: u64, rate: u64) -> f64 {
    if size == 0 {
        return 0.0;
    }
    let p = sample_probability(size, rate);
    (size as f64).powi(2) * (1.0 - p) / p
}

impl Site {
    /// True bytes.
    pub fn bytes(&self) -> u64 {
        self.allocations.iter().map(|(s, n)| s * n).sum()
    }

    /// True calls.
    pub fn calls(&self) -> u64 {
        self.allocations.iter().map(|(_, n)| n).sum::<u64>() + self.empty_calls
    }

    /// Standard deviation of the byte estimate (see the module docs).
    pub fn estimate_sd(&self, rate: u64) -> f64 {
        self.allocations
            .iter()
            .map(|&(size, n)| n as f64 * allocation_variance(size, rate))
            .sum::<f64>()
            .sqrt()
    }

    /// Mean and standard deviation of the number of samples.
    pub fn samples_mean_sd(&self, rate: u64) -> (f64, f64) {
        let (mean, var) = self
            .allocations
            .iter()
            .fold((0.0, 0.0), |(m, v), &(size, n)| {
                let p = sample_probability(size, rate);
                (m + n as f64 * p, v + n as f64 * p * (1.0 - p))
            });
        (mean, var.sqrt())
    }
}

/// Total true bytes and calls of the workload.
pub fn totals() -> (u64, u64) {
    SITES
        .iter()
        .fold((0, 0), |(b, c), s| (b + s.bytes(), c + s.calls()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truth_matches_the_c_source() {
        assert_eq!(totals(), (374_948_864, 175_017));
        // Every sampled site has enough expected samples for the normal approximation.
        for site in SITES.iter().filter(|s| s.bytes() > 0) {
            let (mean, _) = site.samples_mean_sd(TEST_RATE);
            assert!(
                mean >= 16.0 && (mean >= 240.0 || site.estimate_sd(TEST_RATE) == 0.0),
                "{} expects {mean} samples",
                site.function
            );
        }
    }
}
