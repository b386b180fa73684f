//! The precomputed table of exponential sampling intervals.
//!
//! The kernel cannot evaluate `ln`, so userspace fills an array map with
//! [`INTERVAL_TABLE_LEN`] draws from Exp(mean = rate) and the probe picks an entry with
//! `bpf_get_prandom_u32()` each time a thread needs a new interval.
//!
//! The table is *stratified*: entry `i` is the inverse CDF at `(i + U_i) / N` with
//! `U_i ~ Uniform[0, 1)`, so the table's empirical distribution is within `1/N` of the
//! exponential everywhere (Kolmogorov distance), and its mean is within a fraction of
//! a percent of the rate, where N plain draws would be off by `1/sqrt(N)` (0.4%). A
//! uniformly random pick from it is then a draw from (almost exactly) the exponential.
//! Refreshing the jitter `U_i` periodically (see `REFRESH_INTERVAL`) removes any
//! residual dependence on one particular table. docs/design.md has the argument.

use allocbpf_common::INTERVAL_TABLE_LEN;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

/// How often userspace rewrites the table with fresh jitter.
pub const REFRESH_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

/// Generates interval tables for one rate.
pub struct IntervalTable {
    rate: u64,
    rng: ChaCha20Rng,
}

impl IntervalTable {
    /// A generator for mean interval `rate` bytes, seeded from the OS.
    pub fn new(rate: u64) -> Self {
        Self::with_seed(rate, rand::rng().random())
    }

    /// A generator with a fixed seed (tests and reproducible simulations).
    pub fn with_seed(rate: u64, seed: u64) -> Self {
        Self {
            rate,
            rng: ChaCha20Rng::seed_from_u64(seed),
        }
    }

    /// A fresh table of [`INTERVAL_TABLE_LEN`] intervals in bytes, in random order.
    ///
    /// The order does not matter to the kernel (it picks entries at random), but a
    /// shuffled table is also safe for any future sequential reader.
    pub fn generate(&mut self) -> Vec<u64> {
        let n = INTERVAL_TABLE_LEN as usize;
        let rate = self.rate as f64;
        let mut table: Vec<u64> = (0..n)
            .map(|i| {
                let u = (i as f64 + self.rng.random::<f64>()) / n as f64;
                // Inverse CDF of Exp(rate); floor so that P(interval < S) = 1 - exp(-S/R)
                // holds exactly for integer S. `u < 1` always, so the log is finite.
                (-rate * (-u).ln_1p()).floor() as u64
            })
            .collect();
        // Fisher-Yates.
        for i in (1..n).rev() {
            let j = self.rng.random_range(0..=i);
            table.swap(i, j);
        }
        table
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kolmogorov-Smirnov distance between the table and Exp(rate).
    fn ks_distance(table: &[u64], rate: f64) -> f64 {
        let mut sorted = table.to_vec();
        sorted.sort_unstable();
        let n = sorted.len() as f64;
        sorted
            .iter()
            .enumerate()
            .map(|(i, &x)| {
                // Continuous CDF at x+1 (values are floors).
                let cdf = 1.0 - (-(x as f64 + 1.0) / rate).exp();
                let lo = (cdf - i as f64 / n).abs();
                let hi = (cdf - (i + 1) as f64 / n).abs();
                lo.max(hi)
            })
            .fold(0.0, f64::max)
    }

    #[test]
    fn table_follows_the_exponential() {
        let rate = 512 * 1024;
        let table = IntervalTable::with_seed(rate, 1).generate();
        assert_eq!(table.len(), INTERVAL_TABLE_LEN as usize);
        // Stratification bounds the KS distance by 1/N (+ flooring, < 1/rate); the
        // critical value for N plain draws at alpha = 0.001 would be 1.95/sqrt(N) = 0.0076.
        let d = ks_distance(&table, rate as f64);
        assert!(d <= 1.0 / table.len() as f64 + 1e-5, "KS distance {d}");
        // Mean of floor(Exp(R)) is R - 1/2 in expectation; stratified sd is tiny.
        let mean = table.iter().map(|&x| x as f64).sum::<f64>() / table.len() as f64;
        assert!(
            (mean / rate as f64 - 1.0).abs() < 0.002,
            "mean {mean} vs rate {rate}"
        );
    }

    #[test]
    fn refreshes_differ_and_are_shuffled() {
        let mut generator = IntervalTable::with_seed(4096, 2);
        let a = generator.generate();
        let b = generator.generate();
        assert_ne!(a, b);
        // Consecutive entries of a shuffled table are not ordered: about half ascend.
        let ascending = a.windows(2).filter(|w| w[0] < w[1]).count() as f64;
        let fraction = ascending / (a.len() - 1) as f64;
        assert!((fraction - 0.5).abs() < 0.02, "fraction {fraction}");
    }
}
