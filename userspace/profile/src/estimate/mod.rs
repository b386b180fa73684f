//! The unbiased estimator for Poisson byte sampling.
//!
//! An allocation of `S` bytes is sampled with probability `p(S) = 1 - exp(-S/R)` at
//! mean interval `R` (.NET document, "Estimation Approach 1"; jemalloc's
//! "unbias by dividing by 1 - e^{-Z/R}"). Each sample therefore stands for
//! `S / p(S)` bytes and `1 / p(S)` objects. Samples are unbiased one by one, BEFORE
//! they are summed: summing sizes first and unbiasing the sum is badly biased for
//! stacks with small allocations (jemalloc document, "Aggregation must be done after
//! unbiasing samples").
//!
//! Allocations of at least the certain threshold (heapprofd's shortcut) are recorded
//! with probability 1, so they stand for exactly themselves.
//!
//! [`interval`] adds confidence intervals (the .NET document's approach 2); [`windows`]
//! scales samples taken in observation windows up to the whole interval.

pub mod attributed;
pub mod interval;
pub use allocbpf_sampling::interval_table;
pub mod pace;
pub mod windows;

pub use attributed::attributed_sample;
pub use interval::{Confidence, Interval, IntervalInputs};

/// Probability that an allocation of `size` bytes is sampled at mean interval `rate`.
pub fn sample_probability(size: u64, rate: u64) -> f64 {
    if size == 0 {
        return 0.0;
    }
    // -expm1(-x) = 1 - exp(-x), accurate for tiny x (small allocations, large rates).
    -(-(size as f64) / rate as f64).exp_m1()
}

pub use allocbpf_sampling::certain_threshold;

/// What one sample stands for in the population.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Weight {
    /// Estimated bytes: `S / p(S)`, or `S` for certain samples.
    pub bytes: f64,
    /// Estimated objects: `1 / p(S)`, or 1 for certain samples.
    pub objects: f64,
}

/// The unbiased weight of one sample of `size` bytes taken at mean interval `rate`.
pub fn weight(size: u64, rate: u64, certain: bool) -> Weight {
    if certain || size == 0 {
        return Weight {
            bytes: size as f64,
            objects: 1.0,
        };
    }
    let p = sample_probability(size, rate);
    Weight {
        bytes: size as f64 / p,
        objects: 1.0 / p,
    }
}

/// The expected offset of a sampled allocation of `size` bytes at mean interval `rate`:
/// the bytes before its sampling point, given that the exponential countdown ran out
/// inside it, `E[X | X < S] = R (1 - x / (e^x - 1))` with `x = S/R` (about `S/2` for
/// small allocations). For samples whose sampler does not say (a runtime's own counts):
/// with it, the interval of [`IntervalInputs`] is centred on the unbiased estimate
/// (docs/statistics.md, "Go").
pub fn expected_offset(size: u64, rate: u64) -> u64 {
    if size == 0 || rate == 0 {
        return 0;
    }
    let x = size as f64 / rate as f64;
    let expected = rate as f64 * (1.0 - x / x.exp_m1());
    (expected.round() as u64).min(size)
}

/// Variance contributed to a byte estimate by ONE allocation of `size` bytes (sampled
/// or not): `S^2 (1 - p) / p`, or 0 at and above `threshold` where sampling is certain.
/// Summed over a workload's allocations it gives the estimate's variance
/// (docs/statistics.md). The end-to-end tests recompute it independently in
/// `tests/src/sites.rs` rather than trusting this code.
pub fn variance_per_allocation(size: u64, rate: u64, threshold: u64) -> f64 {
    if size >= threshold || size == 0 {
        return 0.0;
    }
    let p = sample_probability(size, rate);
    (size as f64).powi(2) * (1.0 - p) / p
}

/// The median of `values`: the middle one, the upper of the middle two for an even
/// count (always one of the measurements); NaN for none. How every repeated
/// measurement here (calibration runs, bench rounds, the end-to-end tests' runs) is
/// summarized, since this VM is noisy.
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}

#[cfg(test)]
mod tests {
    /// The expected offset: about half a small allocation; for S = R,
    /// `R (1 - 1/(e - 1)) = 0.418 R`; and the interval's centre `rate + S - offset`
    /// equals the weight `S / p(S)` (derived in docs/statistics.md).
    #[test]
    fn expected_offsets() {
        let rate = 524_288;
        assert_eq!(super::expected_offset(64, rate), 32);
        let at_rate = super::expected_offset(rate, rate) as f64 / rate as f64;
        assert!((at_rate - 0.418).abs() < 0.001, "{at_rate}");
        for size in [16u64, 4096, 100_000, 524_288, 2_000_000] {
            let centre = (rate + size - super::expected_offset(size, rate)) as f64;
            let w = super::weight(size, rate, false).bytes;
            assert!((centre / w - 1.0).abs() < 1e-5, "{size}: {centre} vs {w}");
        }
    }

    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn probability_matches_heapprofd_figures() {
        // heapprofd: at 512 KiB, anything above 1.5 MiB is sampled at least 95% of the time.
        assert!(sample_probability(3 << 19, 512 << 10) >= 0.95);
        // An allocation equal to the rate is sampled ~63% of the time.
        let p = sample_probability(4096, 4096);
        assert!((p - (1.0 - (-1f64).exp())).abs() < 1e-12);
        assert_eq!(sample_probability(0, 4096), 0.0);
    }

    #[test]
    fn threshold_is_the_99_percent_point() {
        let rate = 512 << 10;
        let t = certain_threshold(rate);
        assert!(sample_probability(t, rate) >= 0.99);
        assert!(sample_probability(t - 1, rate) < 0.99 + 1e-6);
    }

    #[test]
    fn tiny_allocations_do_not_lose_precision() {
        // 1 byte at 1 GiB: p ~ 2^-30; the naive 1 - exp(-x) would be dominated by rounding.
        let w = weight(1, 1 << 30, false);
        assert!((w.bytes / (1u64 << 30) as f64 - 1.0).abs() < 1e-6);
    }

    #[test]
    fn certain_samples_stand_for_themselves() {
        assert_eq!(
            weight(10 << 20, 512 << 10, true),
            Weight {
                bytes: (10 << 20) as f64,
                objects: 1.0
            }
        );
    }

    /// Monte Carlo check of unbiasedness through the weight function: draw Bernoulli(p)
    /// per allocation and sum weights. 20,000 allocations of 1 KiB at R = 64 KiB:
    /// truth 20 MiB, sd = sqrt(n S^2 (1-p)/p) ~ 1.3 MiB (6.3%). The bound is 5 sd
    /// (two-sided normal tail 6e-7) and the seed is fixed, so this cannot flake.
    #[test]
    fn weighted_sum_is_unbiased() {
        let (size, rate, n) = (1024u64, 64u64 << 10, 20_000u64);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let p = sample_probability(size, rate);
        let estimate: f64 = (0..n)
            .filter(|_| rng.random::<f64>() < p)
            .map(|_| weight(size, rate, false).bytes)
            .sum();
        let truth = (n * size) as f64;
        let sd = (n as f64 * variance_per_allocation(size, rate, u64::MAX)).sqrt();
        assert!(
            (estimate - truth).abs() < 5.0 * sd,
            "estimate {estimate} truth {truth} sd {sd}"
        );
    }

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 3.0);
        assert!(median(&[]).is_nan());
    }
}
