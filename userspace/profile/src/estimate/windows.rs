//! Time sampling: estimates for a whole interval from the observation windows inside it
//! (docs/statistics.md, "Time sampling").
//!
//! Under an overhead budget a process is observed in one window per period: a window
//! of `d·P` seconds at a uniformly random phase of each period `P` (circular, so every
//! instant of the period is observed with probability exactly `d`), or, where moving
//! probes costs the agent too much, a window of `d·P/q` in a random share `q` of the
//! periods (the same probability `d`). A sample taken in
//! a window stands for `1/d` times its byte weight (Horvitz-Thompson): the sum estimates
//! what was allocated over the whole interval, unbiased whatever the process does,
//! because the phases are drawn independently of it.
//!
//! The variance of that total, byte sampling and time sampling together, is estimated
//! from the per-period totals `y_k` with successive differences (Wolter's estimator for
//! systematic samples, one per stratum): `K/(2(K-1)) · Σ (y_k − y_{k−1})²`. Its expectation
//! is the true variance plus the squared changes of the period means, so it errs on the
//! wide side for a process whose rate drifts, and needs no model of the process. Its
//! degrees of freedom are those of the periods with samples.

use std::collections::BTreeMap;

use statrs::distribution::{ContinuousCDF, StudentsT};

use super::{
    pace::{PaceCorrection, PaceSlack},
    Confidence, Interval,
};

/// Where a sample was taken in the time sampling: its period and the probability that
/// its instant was observed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleWindow {
    /// Index of the period (counted from the schedule's origin).
    pub period: u64,
    /// Probability that the sample's instant lay in an observation window, in (0, 1].
    pub inclusion: f64,
}

impl SampleWindow {
    /// What one observed byte stands for: `1 / inclusion`.
    pub fn time_weight(&self) -> f64 {
        1.0 / self.inclusion
    }
}

/// The per-period totals of time-weighted samples of one interval (bytes).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PeriodTotals {
    totals: BTreeMap<u64, f64>,
}

impl PeriodTotals {
    /// Adds `bytes` (already time-weighted) to `period`.
    pub fn add(&mut self, period: u64, bytes: f64) {
        *self.totals.entry(period).or_insert(0.0) += bytes;
    }

    /// Adds another process's totals (the windows are common to every process, so the
    /// sum of the per-period totals is the combined sequence).
    pub fn merge(&mut self, other: &PeriodTotals) {
        for (&period, &bytes) in &other.totals {
            self.add(period, bytes);
        }
    }

    /// Multiplies every period's total by `factor` (the pace correction).
    pub fn scale(&mut self, factor: f64) {
        self.totals.values_mut().for_each(|y| *y *= factor);
    }

    /// Forgets everything (a new interval).
    pub fn clear(&mut self) {
        self.totals.clear();
    }

    /// The first period with samples.
    pub fn first(&self) -> Option<u64> {
        self.totals.keys().next().copied()
    }

    /// Periods with samples.
    pub fn len(&self) -> usize {
        self.totals.len()
    }

    /// Periods of `periods` with samples.
    pub fn count_in(&self, periods: std::ops::RangeInclusive<u64>) -> usize {
        self.totals.range(periods).count()
    }

    /// True if no period has samples.
    pub fn is_empty(&self) -> bool {
        self.totals.is_empty()
    }

    /// The successive-difference variance of the sum over `periods` (first and last
    /// included; periods without samples count as 0). `None` for fewer than two periods.
    pub fn variance(&self, periods: std::ops::RangeInclusive<u64>) -> Option<f64> {
        let (first, last) = (*periods.start(), *periods.end());
        let count = last.checked_sub(first)? + 1;
        if count < 2 {
            return None;
        }
        let mut sum = 0.0;
        let mut previous = (first, 0.0);
        let mut started = false;
        for (&period, &y) in self.totals.range(first..=last) {
            let (at, before) = previous;
            if !started && period > first {
                // Leading periods without samples: one step up from 0.
                sum += y * y;
            } else if started {
                // Periods between without samples: down to 0, then up to y.
                if period > at + 1 {
                    sum += before * before + y * y;
                } else {
                    sum += (y - before) * (y - before);
                }
            }
            started = true;
            previous = (period, y);
        }
        if started && previous.0 < last {
            sum += previous.1 * previous.1;
        }
        let count = count as f64;
        Some(count / (2.0 * (count - 1.0)) * sum)
    }
}

/// What the whole-interval estimate of a time-sampled profile rests on.
#[derive(Clone, Debug, PartialEq)]
pub struct TimeSampling {
    /// Expected fraction of the interval observed (the mean inclusion probability).
    pub observed_fraction: f64,
    /// The interval's first and last periods.
    pub periods: std::ops::RangeInclusive<u64>,
    /// Time-weighted bytes per period.
    pub totals: PeriodTotals,
    /// The share of the process's CPU time the probes took while it was probed, when
    /// it is large (from 5%): a CPU-bound process is slowed that much inside its
    /// windows (the observer effect; docs/statistics.md, "Pace").
    pub probe_share: Option<f64>,
    /// The process's measured pace while probed relative to unprobed and the factor its
    /// estimates were scaled by (`None`: not measured, estimates not corrected; or a
    /// merged report of several processes).
    pub pace: Option<PaceCorrection>,
    /// How many processes' estimates were corrected for their pace (1 or 0 for one
    /// process; in a merged report, the processes whose own profiles say so).
    pub paced_processes: u32,
    /// How far the pace-corrected estimates could lie from the total for a hit cost
    /// anywhere in its in-place range (`PaceCorrection::slack`, summed over the
    /// processes), bytes: added to the interval's ends.
    pub pace_slack: PaceSlack,
}

impl TimeSampling {
    /// An interval around `estimate` with the successive-difference variance (byte and
    /// time sampling together), Student's t with one degree of freedom per period with
    /// samples less one: the variance is itself estimated from those periods; its ends moved
    /// out by the pace slack ([`TimeSampling::widen`]). `None` for fewer than two
    /// periods, or without any sample.
    pub fn interval(&self, estimate: f64, confidence: Confidence) -> Option<Interval> {
        if self.totals.is_empty() {
            // No sample in any window: every period total is 0, and so would be the
            // variance; that says nothing of what the windows missed.
            return None;
        }
        let variance = self.totals.variance(self.periods.clone())?;
        // The variance rests on the periods with samples: where most have none (windows
        // in a share of the periods only, a bursty or sparse process), its degrees of
        // freedom are about theirs, not one per period (docs/statistics.md,
        // "Activation").
        let differences = (self.periods.end() - self.periods.start()) as f64;
        let sampled = self.totals.count_in(self.periods.clone()) as f64;
        let freedom = (sampled - 1.0).clamp(1.0, differences.max(1.0));
        let t = StudentsT::new(0.0, 1.0, freedom)
            .ok()?
            .inverse_cdf(0.5 + confidence.level() / 2.0);
        let half = t * variance.sqrt();
        Some(self.widen(Interval {
            lo: estimate - half,
            hi: estimate + half,
        }))
    }

    /// `interval` with its ends moved out by the pace slack: the sampling error and the
    /// systematic one of a hit cost unknown within its range, added (not in
    /// quadrature: the second is a range, not a random error). Floored at 0.
    pub fn widen(&self, interval: Interval) -> Interval {
        Interval {
            lo: (interval.lo - self.pace_slack.below).max(0.0),
            hi: interval.hi + self.pace_slack.above,
        }
    }

    /// What the profile says of the observer effect (docs/statistics.md, "Pace"), one
    /// sentence for the text output and the pprof comment alike: the probes' share of
    /// the process's CPU when large, and the pace correction applied (or why none
    /// was). `None`: nothing to say.
    pub fn observer_effect(&self) -> Option<String> {
        let share = self.probe_share.map(|share| {
            format!(
                "the probes took ~{:.0}% of this process's CPU while it was probed",
                share * 100.0
            )
        });
        let effect = match self.pace {
            Some(pace) => pace.summary(),
            None if self.paced_processes > 1 => format!(
                "estimates of {} processes scaled for their own pace while probed (observer \
                 effect corrected; each one's own profile gives it)",
                self.paced_processes
            ),
            None if share.is_some() && self.pace_slack.above > 0.0 => {
                "its pace could not be measured: if it is CPU-bound its estimates are low, and \
                 the total's CI reaches as high as that could make them (observer effect not \
                 corrected)"
                    .to_string()
            }
            None if share.is_some() => "its pace could not be measured; it did not keep its \
                 CPUs busy while probed, so its traps took idle time, not work (observer effect \
                 not corrected)"
                .to_string(),
            None => return None,
        };
        Some(match share {
            Some(share) => format!("{share}; {effect}"),
            None => effect,
        })
    }

    /// Combines the time sampling of processes profiled over the same interval.
    pub fn merge(&mut self, other: &TimeSampling) {
        let count = |t: &TimeSampling| (t.periods.end() - t.periods.start() + 1) as f64;
        let (a, b) = (count(self), count(other));
        self.observed_fraction =
            (self.observed_fraction * a + other.observed_fraction * b) / (a + b);
        self.periods = *self.periods.start().min(other.periods.start())
            ..=*self.periods.end().max(other.periods.end());
        self.totals.merge(&other.totals);
        // Per process: a merged report keeps the largest, as a flag.
        self.probe_share = match (self.probe_share, other.probe_share) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        // One process's pace says nothing of the others': a merged report keeps it only
        // when one process alone was corrected, and counts them.
        self.pace = match self.paced_processes + other.paced_processes {
            1 => self.pace.or(other.pace),
            _ => None,
        };
        self.paced_processes += other.paced_processes;
        self.pace_slack.add(other.pace_slack);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn totals(values: &[(u64, f64)]) -> PeriodTotals {
        let mut t = PeriodTotals::default();
        for &(k, y) in values {
            t.add(k, y);
        }
        t
    }

    /// The gaps are zeros: the same figure as the dense sequence.
    #[test]
    fn missing_periods_count_as_zero() {
        let sparse = totals(&[(3, 5.0), (4, 1.0), (7, 2.0)]);
        let dense: Vec<f64> = vec![0.0, 5.0, 1.0, 0.0, 0.0, 2.0, 0.0];
        let sum: f64 = dense.windows(2).map(|w| (w[1] - w[0]).powi(2)).sum();
        let expected = 7.0 / 12.0 * sum;
        let got = sparse.variance(2..=8).unwrap();
        assert!((got - expected).abs() < 1e-9, "{got} {expected}");
        assert_eq!(sparse.variance(5..=5), None);
    }

    /// A steady sequence has no successive differences: no variance.
    #[test]
    fn steady_totals_have_no_variance() {
        let steady = totals(&(0..10).map(|k| (k, 4.0)).collect::<Vec<_>>());
        assert_eq!(steady.variance(0..=9), Some(0.0));
    }

    /// Merged processes add their pace slack; the interval moves out by it; the
    /// observer-effect sentence follows what was corrected.
    #[test]
    fn pace_slack_widens_and_merges() {
        let pace = PaceCorrection {
            ratio: 0.5,
            factor: 2.0,
            factor_low: 1.5,
            factor_high: 4.0,
        };
        let mut one = TimeSampling {
            observed_fraction: 0.1,
            periods: 0..=3,
            totals: totals(&[(0, 10.0), (1, 10.0), (2, 10.0), (3, 10.0)]),
            probe_share: Some(0.4),
            pace: Some(pace),
            paced_processes: 1,
            pace_slack: pace.slack(40.0),
        };
        // 40 could have been 30 or 80: steady periods, so that is the interval.
        let interval = one.interval(40.0, Confidence::DEFAULT).unwrap();
        assert_eq!((interval.lo, interval.hi), (30.0, 80.0));
        let effect = one.observer_effect().unwrap();
        assert!(effect.starts_with("the probes took ~40%"), "{effect}");
        assert!(effect.contains("scaled by 2.000"), "{effect}");

        let other = one.clone();
        one.merge(&other);
        assert_eq!(one.pace_slack.below, 20.0);
        assert_eq!(one.pace_slack.above, 80.0);
        assert_eq!(one.pace, None, "two processes: no single pace");
        assert!(one.observer_effect().unwrap().contains("of 2 processes"));

        let uncorrected = TimeSampling {
            pace: None,
            paced_processes: 0,
            ..other.clone()
        };
        assert!(uncorrected
            .observer_effect()
            .unwrap()
            .contains("the total's CI reaches as high"));
        let idle = TimeSampling {
            pace_slack: PaceSlack::default(),
            ..uncorrected.clone()
        };
        assert!(idle.observer_effect().unwrap().contains("took idle time"));
        let quiet = TimeSampling {
            probe_share: None,
            ..uncorrected
        };
        assert_eq!(quiet.observer_effect(), None);
    }
}
