//! Confidence intervals for estimated bytes: the .NET document's "Estimation Approach 2"
//! (negative binomial on the failed trials), with its end-point adjustment.
//!
//! Every byte an allocator hands out is a Bernoulli trial with success probability
//! `p = 1 - exp(-1/R)` (the countdown is `floor(Exp(R))`, a geometric law). For a group
//! of `s` samples (one stack, or everything), let `u` be the sum over its samples of
//! `size - offset`: the sampled byte plus the bytes after it in the same allocation,
//! which were never tried. The untried bytes are known exactly; the failed trials `F`
//! before the s-th success follow NegBin(s, p). The bytes allocated are `N = F + u`.
//!
//! Inverting the law (Clopper-Pearson style, the document's "compensating for bytes
//! allocated ... in between events"):
//! - lower bound: the `(1-C)/2` quantile of the failures for `s` successes, plus `u`;
//! - upper bound: the `(1+C)/2` quantile for `s + 1` successes (the group's bytes do not
//!   end at a sample: trials after the last sample were failures we never saw), plus
//!   `u + 1`.
//!
//! Quantiles come from the gamma law. A sum of `s` geometric countdowns
//! `floor(E_i)`, `E_i ~ Exp(R)`, lies in `(G - s, G]` where `G = sum E_i ~ Gamma(s, R)`,
//! so the negative binomial quantile lies within `s` bytes below the gamma quantile.
//! We take the gamma quantile minus `s` for the lower bound and the gamma quantile for
//! the upper bound: never narrower than the exact interval, and wider by at most `s`
//! bytes, a relative `1/R` (checked against the document's own table in the tests).
//! The regularized incomplete gamma is evaluated by `statrs`.
//!
//! Two adaptations (docs/statistics.md):
//! - threads: each thread runs its own countdown, but countdowns are memoryless, so
//!   the trials of one stack, taken across all threads in any interleaving, are still
//!   i.i.d. Bernoulli(p): samples of a group pool into one `s` and one `u`;
//! - certain samples (heapprofd's shortcut: `size >= R ln 100` is always recorded
//!   without touching the countdown) are not trials. Their bytes are known exactly and
//!   are added to both bounds.
//!
//! Finally both bounds are raised to at least the bytes the group's samples themselves
//! allocated, which the group certainly allocated; this never uncovers the truth.
//!
//! Samples taken at different mean intervals (the ring-pressure levels, observation
//! windows): the failures are then a sum of exponential countdowns of different means
//! `R_i`, no longer a gamma law. Its mean `Σ R_i` and variance `Σ R_i²` are matched by a
//! gamma of shape `(Σ R_i)² / Σ R_i²` and scale `Σ R_i² / Σ R_i` (Welch-Satterthwaite),
//! which is the exact law again when every `R_i` is the same (docs/statistics.md,
//! "Overload").

use statrs::function::gamma::gamma_lr;

/// What the interval needs to know about a group of samples. Additive: two groups'
/// inputs add up to the merged group's.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct IntervalInputs {
    /// Samples taken by the countdown (`s`).
    pub counted_samples: u64,
    /// Sum over those samples of `size - offset` (`u`).
    pub untried_bytes: u64,
    /// Sum of the sizes of those samples (a floor for the group's bytes).
    pub sampled_bytes: u64,
    /// Bytes of certain samples, known exactly.
    pub certain_bytes: u64,
    /// Sum over the counted samples of the mean interval each was drawn at (`Σ R_i`);
    /// 0 when not known (every sample at the rate [`IntervalInputs::interval`] is given).
    pub rate_sum: f64,
    /// Sum over the counted samples of the squared mean interval (`Σ R_i²`).
    pub rate_square_sum: f64,
}

impl IntervalInputs {
    /// Accounts for one sample drawn at mean interval `rate`. `offset` and `rate` are
    /// ignored for certain samples.
    pub fn add(&mut self, size: u64, offset: u64, rate: u64, certain: bool) {
        if certain {
            self.certain_bytes += size;
        } else {
            self.counted_samples += 1;
            self.untried_bytes += size.saturating_sub(offset);
            self.sampled_bytes += size;
            self.rate_sum += rate as f64;
            self.rate_square_sum += (rate as f64).powi(2);
        }
    }

    /// Accounts for `count` samples alike (a runtime's counted samples).
    pub fn add_repeated(&mut self, size: u64, offset: u64, rate: u64, count: u64) {
        // Saturating: the counts come from another process's memory.
        self.counted_samples = self.counted_samples.saturating_add(count);
        self.untried_bytes = self
            .untried_bytes
            .saturating_add(size.saturating_sub(offset).saturating_mul(count));
        self.sampled_bytes = self
            .sampled_bytes
            .saturating_add(size.saturating_mul(count));
        self.rate_sum += rate as f64 * count as f64;
        self.rate_square_sum += (rate as f64).powi(2) * count as f64;
    }

    /// The gamma law's shape and scale matched to the countdowns' sum (module docs);
    /// samples of unknown rate count at `rate`.
    fn failure_law(&self, rate: u64) -> (f64, f64) {
        let s = self.counted_samples as f64;
        if self.counted_samples == 0 || self.rate_sum <= 0.0 || self.rate_square_sum <= 0.0 {
            return (s, rate as f64);
        }
        let scale = self.rate_square_sum / self.rate_sum;
        (self.rate_sum / scale, scale)
    }

    /// Takes back one sample [`IntervalInputs::add`] accounted for (a block leaving the
    /// set in use): the inputs of the group without it.
    pub fn remove(&mut self, size: u64, offset: u64, rate: u64, certain: bool) {
        if certain {
            self.certain_bytes = self.certain_bytes.saturating_sub(size);
        } else {
            self.counted_samples = self.counted_samples.saturating_sub(1);
            self.untried_bytes = self
                .untried_bytes
                .saturating_sub(size.saturating_sub(offset));
            self.sampled_bytes = self.sampled_bytes.saturating_sub(size);
            // Sums of floats: clamped, and exactly zero when the group is empty again.
            if self.counted_samples == 0 {
                self.rate_sum = 0.0;
                self.rate_square_sum = 0.0;
            } else {
                self.rate_sum = (self.rate_sum - rate as f64).max(0.0);
                self.rate_square_sum = (self.rate_square_sum - (rate as f64).powi(2)).max(0.0);
            }
        }
    }

    /// Adds another group's inputs.
    pub fn merge(&mut self, other: &IntervalInputs) {
        self.counted_samples += other.counted_samples;
        self.untried_bytes += other.untried_bytes;
        self.sampled_bytes += other.sampled_bytes;
        self.certain_bytes += other.certain_bytes;
        self.rate_sum += other.rate_sum;
        self.rate_square_sum += other.rate_square_sum;
    }

    /// The interval for the group's bytes at level `confidence`; samples whose mean
    /// interval is not known, and the unseen tail of a group without samples, count at
    /// mean interval `rate`.
    pub fn interval(&self, rate: u64, confidence: Confidence) -> Interval {
        let s = self.counted_samples as f64;
        let tail = (1.0 - confidence.level()) / 2.0;
        let (shape, scale) = self.failure_law(rate);
        let failures_lo = if self.counted_samples == 0 {
            0.0
        } else {
            (gamma_quantile(shape, scale, tail) - s).max(0.0)
        };
        let failures_hi = gamma_quantile(shape + 1.0, scale, 1.0 - tail);
        let untried = self.untried_bytes as f64;
        let floor = self.sampled_bytes as f64;
        let exact = self.certain_bytes as f64;
        Interval {
            lo: exact + (failures_lo + untried).max(floor),
            hi: exact + (failures_hi + untried + 1.0).max(floor),
        }
    }
}

/// `q`-quantile of Gamma(shape, scale): the sum of `shape` exponential intervals of
/// mean `scale`.
fn gamma_quantile(shape: f64, scale: f64, q: f64) -> f64 {
    scale * unit_gamma_quantile(shape, q)
}

/// `q`-quantile of Gamma(shape, 1), by bisection on the regularized lower incomplete
/// gamma function to a relative precision of 1e-12.
///
/// Not `statrs`' `Gamma::inverse_cdf`: it stops early and is off by 0.2% at shape 50
/// (the test against the .NET table caught it); its CDF is accurate.
fn unit_gamma_quantile(shape: f64, q: f64) -> f64 {
    let cdf = |x: f64| gamma_lr(shape, x);
    // Bracket: the quantile lies within a few standard deviations of the mean.
    let spread = 10.0 * shape.sqrt() + 40.0;
    let (mut lo, mut hi) = ((shape - spread).max(0.0), shape + spread);
    while cdf(hi) < q {
        hi *= 2.0;
    }
    while hi - lo > 1e-12 * hi {
        let mid = 0.5 * (lo + hi);
        if cdf(mid) < q {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// A two-sided interval in bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Interval {
    /// Lower bound.
    pub lo: f64,
    /// Upper bound.
    pub hi: f64,
}

impl Interval {
    /// True if `value` lies in `[lo, hi]`.
    pub fn contains(&self, value: f64) -> bool {
        self.lo <= value && value <= self.hi
    }
}

/// A level [`Confidence::new`] refuses.
#[derive(Clone, Copy, Debug, PartialEq, thiserror::Error)]
#[error("confidence level {0} is outside 0.5..=0.9999")]
pub struct ConfidenceError(pub f64);

/// A confidence level strictly between 0 and 1: the probability that a reported
/// interval covers the true value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Confidence(f64);

impl Confidence {
    /// The default, 95%.
    pub const DEFAULT: Confidence = Confidence(0.95);

    /// A level in (0, 1); 0.5 to 0.9999 is what makes sense, and all we accept.
    pub fn new(level: f64) -> Result<Confidence, ConfidenceError> {
        if (0.5..=0.9999).contains(&level) {
            Ok(Confidence(level))
        } else {
            Err(ConfidenceError(level))
        }
    }

    /// The level as a probability.
    pub fn level(self) -> f64 {
        self.0
    }

    /// The level in percent for labels, e.g. "95" or "99.9".
    pub fn percent_label(self) -> String {
        let percent = self.0 * 100.0;
        if (percent - percent.round()).abs() < 1e-9 {
            format!("{percent:.0}")
        } else {
            format!("{}", (percent * 100.0).round() / 100.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The .NET document's table of negative binomial failed-trial quantiles at
    /// p = 1/102400 (samples, 2.5% quantile, 97.5% quantile).
    const DOTNET_TABLE: [(u64, f64, f64); 12] = [
        (1, 2591.0, 377738.0),
        (2, 24800.0, 570531.0),
        (5, 166241.0, 1048730.0),
        (8, 353666.0, 1476870.0),
        (10, 491039.0, 1749469.0),
        (20, 1250954.0, 3038270.0),
        (50, 3800118.0, 6633475.0),
        (100, 8331581.0, 12342053.0),
        (500, 46809487.0, 55783459.0),
        (1000, 96149867.0, 108842093.0),
        (5000, 497900649.0, 526283322.0),
        (10000, 1004017229.0, 1044156743.0),
    ];

    /// Our quantiles bracket the document's exact ones: the gamma quantile is at most
    /// `s` bytes above the negative binomial one (module docs). The document uses
    /// p = 1/102400 exactly, i.e. a gamma scale of -1/ln(1-p).
    #[test]
    fn gamma_quantiles_bracket_the_documents_negative_binomial_table() {
        let scale = -1.0 / (1.0 - 1.0 / 102400.0f64).ln();
        for (s, lo, hi) in DOTNET_TABLE {
            for (q, exact) in [(0.025, lo), (0.975, hi)] {
                let g = scale * unit_gamma_quantile(s as f64, q);
                // Table entries are rounded to whole trials: allow 1 either side.
                assert!(
                    g - s as f64 - 1.0 <= exact && exact <= g + 1.0,
                    "s={s} q={q}: gamma {g}, document {exact}"
                );
            }
        }
    }

    #[test]
    fn interval_follows_the_documents_worked_example() {
        // 8 samples, u = 10,908, C = 0.95 -> [353,666 + 10,908, 1,476,870 + 10,908] at
        // s = 8 for both ends in the document; our upper end uses s + 1 (end-point
        // adjustment), which is the document's 9-sample quantile, 1,614,137.
        let inputs = IntervalInputs {
            counted_samples: 8,
            untried_bytes: 10_908,
            sampled_bytes: 10_908,
            ..IntervalInputs::default()
        };
        let i = inputs.interval(102_400, Confidence::DEFAULT);
        assert!((i.lo - (353_666.0 + 10_908.0)).abs() < 20.0, "{i:?}");
        assert!((i.hi - (1_614_137.0 + 10_908.0)).abs() < 30.0, "{i:?}");
    }

    #[test]
    fn certain_bytes_are_exact_and_floors_apply() {
        let mut inputs = IntervalInputs::default();
        inputs.add(8 << 20, 0, 512 << 10, true);
        let i = inputs.interval(512 << 10, Confidence::DEFAULT);
        // No countdown samples: only the unseen-tail upper allowance remains.
        assert_eq!(i.lo, (8 << 20) as f64);
        let tail = -(0.025f64.ln()) * (512 << 10) as f64;
        assert!((i.hi - (8 << 20) as f64 - tail).abs() < 2.0, "{i:?}");

        // One sample of a 3 MiB allocation whose sampled byte came early: the group
        // allocated at least 3 MiB whatever the failure quantile says.
        let mut big = IntervalInputs::default();
        big.add(3 << 20, 10, 512 << 10, false);
        let i = big.interval(512 << 10, Confidence::DEFAULT);
        assert!(i.lo >= (3 << 20) as f64);
        assert!(i.hi > i.lo);
    }

    #[test]
    fn merging_adds_inputs() {
        let mut a = IntervalInputs::default();
        a.add(100, 20, 64, false);
        let mut b = IntervalInputs::default();
        b.add(300, 0, 128, false);
        b.add(1 << 30, 0, 64, true);
        a.merge(&b);
        assert_eq!(
            a,
            IntervalInputs {
                counted_samples: 2,
                untried_bytes: 380,
                sampled_bytes: 400,
                certain_bytes: 1 << 30,
                rate_sum: 192.0,
                rate_square_sum: 64.0 * 64.0 + 128.0 * 128.0,
            }
        );
    }

    #[test]
    fn lower_levels_give_narrower_intervals() {
        let inputs = IntervalInputs {
            counted_samples: 50,
            untried_bytes: 50 * 512,
            sampled_bytes: 50 * 1024,
            ..IntervalInputs::default()
        };
        let wide = inputs.interval(65536, Confidence::new(0.99).unwrap());
        let narrow = inputs.interval(65536, Confidence::new(0.9).unwrap());
        assert!(wide.lo < narrow.lo && narrow.hi < wide.hi);
        assert!(Confidence::new(1.0).is_err());
        assert!(Confidence::new(0.2).is_err());
        assert_eq!(Confidence::new(0.9).unwrap().percent_label(), "90");
        assert_eq!(Confidence::new(0.999).unwrap().percent_label(), "99.9");
    }

    #[test]
    fn one_rate_known_or_not_gives_the_same_interval() {
        let mut known = IntervalInputs::default();
        for i in 0..20 {
            known.add(1000 + i, 10, 65536, false);
        }
        let unknown = IntervalInputs {
            rate_sum: 0.0,
            rate_square_sum: 0.0,
            ..known
        };
        let (a, b) = (
            known.interval(65536, Confidence::DEFAULT),
            unknown.interval(65536, Confidence::DEFAULT),
        );
        assert!((a.lo - b.lo).abs() < 1e-6 * a.lo && (a.hi - b.hi).abs() < 1e-6 * a.hi);
    }

    /// Coverage with mixed rates: a stream of 64-byte allocations sampled by a
    /// countdown whose mean switches between R, 4R and 32R (as ring pressure would),
    /// the interval computed from the samples' own rates. 2,000 trials at 95%: the
    /// number of misses is Binomial(2000, 0.05) for an exact interval (mean 100, sd
    /// 9.7); the bound of 160 misses is 6 sd above, and the seed is fixed.
    #[test]
    fn mixed_rates_keep_coverage() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(26);
        let base = 4096.0f64;
        let (size, allocations) = (64u64, 20_000u64);
        let truth = (size * allocations) as f64;
        let mut misses = 0;
        for _ in 0..2000 {
            let mut inputs = IntervalInputs::default();
            let draw = |rng: &mut rand_chacha::ChaCha8Rng, mean: f64| {
                (-mean * (1.0 - rng.random::<f64>()).ln()).floor() as u64
            };
            let mut level = 0u32;
            let mut remaining = draw(&mut rng, base);
            for i in 0..allocations {
                // The level changes at points that do not depend on the countdown.
                if i % 2500 == 0 {
                    level = [0, 2, 5][rng.random_range(0..3)];
                    remaining = draw(&mut rng, base * f64::from(1u32 << level));
                }
                let rate = (base as u64) << level;
                if remaining < size {
                    inputs.add(size, remaining, rate, false);
                    remaining = draw(&mut rng, rate as f64);
                } else {
                    remaining -= size;
                }
            }
            if !inputs
                .interval(base as u64, Confidence::DEFAULT)
                .contains(truth)
            {
                misses += 1;
            }
        }
        assert!(misses < 160, "{misses} misses of 2000");
    }
}
