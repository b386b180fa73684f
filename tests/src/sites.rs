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
