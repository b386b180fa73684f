//! The agent's own CPU for one process's samples, as the budget charges it.
//!
//! Resolving a sample (unwinding, a runtime's frame walk through the target's memory,
//! symbolizing) costs the agent CPU the target does not see, and a process whose
//! samples are costly to resolve must pay for them in its budget as it pays for its
//! probe hits. What a sample costs is not steady from the start, though: a process's
//! first samples, and those after it maps a new module, pay one-time work (unwind
//! tables loaded, a runtime's caches filled). Charged as it came, that warm-up makes a
//! light process look heavy for a check and windows it for nothing.
//!
//! So the cost per sample is measured over spans of [`MIN_SAMPLES`] samples. A
//! process's first span is its warm-up and is not counted; the steady cost is the mean
//! of its last [`STEADY_SPANS`] spans but the costliest, so a burst within one span
//! (a module mapped later) is left out, while the steady tail of a runtime's costs (a
//! compiler's JVM meets new methods all along: most samples cheap, some costly) is
//! counted as it comes.
//!
//! Past the process's budget, its sampling interval is raised in the kernel
//! ([`next_coarsening`], `ProcessGate::coarsening`): fewer samples, each weighed at the
//! interval it was drawn at, so estimates stay unbiased and only their intervals widen.
//! Windows would not do: inside them samples are drawn denser by the inverse of the
//! duty, so a process observed part time gives the agent as many samples as full time.

pub use allocbpf_common::MAX_COARSENING;

/// The coarsening a process's samples should have next: its sampling interval raised
/// `2^coarsening` times so that the agent's steady CPU for it, `uncoarsened_cpu` if its
/// samples were taken at its own rate (fraction of a CPU), comes within `cap`. Raised
/// at once to what the cost needs (at most [`MAX_COARSENING`]); lowered by one only
/// when the cost one step finer stays under half the cap, so that it does not swing
/// with the estimate's noise.
pub fn next_coarsening(current: u32, uncoarsened_cpu: f64, cap: f64) -> u32 {
    if !(uncoarsened_cpu.is_finite() && cap > 0.0) {
        return current;
    }
    let cost_at = |coarsening: u32| uncoarsened_cpu / f64::from(1u32 << coarsening);
    let needed = (0..=MAX_COARSENING)
        .find(|&coarsening| cost_at(coarsening) <= cap)
        .unwrap_or(MAX_COARSENING);
    if needed > current {
        return needed;
    }
    match current > 0 && cost_at(current - 1) <= cap / 2.0 {
        true => current - 1,
        false => current,
    }
}

/// Samples a span needs for its per-sample cost to count.
pub const MIN_SAMPLES: u64 = 8;
/// Spans whose per-sample cost the steady estimate averages, the costliest left out.
pub const STEADY_SPANS: usize = 6;
/// Time over which the rate of samples is smoothed, seconds: long beside a budget
/// check, so that a check with no sample (few, when coarsened) does not read as a
/// process that stopped costing.
const RATE_SMOOTHING_S: f64 = 2.0;

/// One process's agent CPU for its samples, the steady per-sample estimate, and the
/// rate of samples it would give at its own sampling interval.
#[derive(Clone, Debug, Default)]
pub struct AgentCost {
    /// CPU spent on its samples since it was first followed, nanoseconds.
    spent_ns: u64,
    /// Its samples resolved since then.
    samples: u64,
    /// `samples` at the last check.
    checked: u64,
    /// CPU and samples of the span being measured (closed at [`MIN_SAMPLES`]).
    span: (u64, u64),
    /// Per-sample cost (ns) of the last closed spans, oldest first.
    recent: [f64; STEADY_SPANS],
    /// Spans closed so far (the first, warm-up, is not in `recent`).
    closed: usize,
    /// Samples per second it would give uncoarsened (smoothed), `None` before a check.
    uncoarsened_rate: Option<f64>,
}

impl AgentCost {
    /// Adds one sample's cost.
    pub fn add_sample(&mut self, spent_ns: u64) {
        self.spent_ns = self.spent_ns.saturating_add(spent_ns);
        self.samples += 1;
        self.span = (self.span.0.saturating_add(spent_ns), self.span.1 + 1);
        if self.span.1 >= MIN_SAMPLES {
            if self.closed > 0 {
                self.recent.rotate_left(1);
                self.recent[STEADY_SPANS - 1] = self.span.0 as f64 / self.span.1 as f64;
            }
            self.closed = self.closed.saturating_add(1);
            self.span = (0, 0);
        }
    }

    /// CPU spent on its samples in all, nanoseconds.
    pub fn spent_ns(&self) -> u64 {
        self.spent_ns
    }

    /// At a budget check, `elapsed_s` after the last, its samples taken at
    /// `coarsening`: the seconds to charge for them (their count times the steady
    /// per-sample cost; none until that is known), and the fraction of a CPU the agent
    /// would spend on it uncoarsened (steady cost times its smoothed uncoarsened rate).
    pub fn check(&mut self, elapsed_s: f64, coarsening: u32) -> (f64, f64) {
        let samples = self.samples.saturating_sub(self.checked);
        self.checked = self.samples;
        if elapsed_s > 0.0 {
            let rate = samples as f64 * f64::from(1u32 << coarsening.min(31)) / elapsed_s;
            let weight = (elapsed_s / RATE_SMOOTHING_S).min(1.0);
            self.uncoarsened_rate = Some(match self.uncoarsened_rate {
                Some(smoothed) => smoothed + weight * (rate - smoothed),
                None => rate,
            });
        }
        let steady_s = self.steady_ns_per_sample() * 1e-9;
        (
            steady_s * samples as f64,
            steady_s * self.uncoarsened_rate.unwrap_or(0.0),
        )
    }

    /// The steady per-sample cost, nanoseconds (zero until the spans after the
    /// warm-up fill [`STEADY_SPANS`]).
    pub fn steady_ns_per_sample(&self) -> f64 {
        if self.closed <= STEADY_SPANS {
            return 0.0;
        }
        let costliest = self.recent.iter().copied().fold(0.0, f64::max);
        (self.recent.iter().sum::<f64>() - costliest) / (STEADY_SPANS - 1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `samples` samples of `ns_each`, then a check `elapsed_s` later at `coarsening`.
    fn check(
        cost: &mut AgentCost,
        samples: u64,
        ns_each: u64,
        elapsed_s: f64,
        c: u32,
    ) -> (f64, f64) {
        (0..samples).for_each(|_| cost.add_sample(ns_each));
        cost.check(elapsed_s, c)
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1e-9)
    }

    #[test]
    fn coarsening_follows_the_cost_with_a_gap() {
        // Nine times the cap: four doublings (16x fewer samples) at once.
        assert_eq!(next_coarsening(0, 0.09, 0.01), 4);
        // Just over: one.
        assert_eq!(next_coarsening(0, 0.011, 0.01), 1);
        // One step finer would cost 0.8 of the cap: held.
        assert_eq!(next_coarsening(3, 0.04, 0.01), 3);
        // One step finer would cost 0.4 of it: one step down; never below zero.
        assert_eq!(next_coarsening(3, 0.02, 0.01), 2);
        assert_eq!(next_coarsening(0, 0.0, 0.01), 0);
        // Capped, and nothing but numbers moves it.
        assert_eq!(next_coarsening(0, 1e6, 0.01), MAX_COARSENING);
        assert_eq!(next_coarsening(2, f64::NAN, 0.01), 2);
        assert_eq!(next_coarsening(2, 0.5, 0.0), 2);
    }

    #[test]
    fn a_warm_up_and_a_burst_are_not_charged() {
        let mut cost = AgentCost::default();
        // A first span at 1 ms a sample (warm-up), then 20 us a sample.
        assert_eq!(check(&mut cost, 8, 1_000_000, 0.2, 0).0, 0.0);
        for _ in 0..STEADY_SPANS - 1 {
            assert_eq!(check(&mut cost, 8, 20_000, 0.2, 0).0, 0.0);
        }
        let (charged, _) = check(&mut cost, 8, 20_000, 0.2, 0);
        assert!(close(charged, 8.0 * 20e-6), "{charged}");
        // A new module's warm-up in one span is left out.
        let (charged, _) = check(&mut cost, 8, 2_000_000, 0.2, 0);
        assert!(close(charged, 8.0 * 20e-6), "{charged}");
        assert_eq!(
            cost.spent_ns(),
            8 * (1_000_000 + STEADY_SPANS as u64 * 20_000 + 2_000_000)
        );
    }

    #[test]
    fn a_costly_tail_is_charged_as_it_comes() {
        let mut cost = AgentCost::default();
        check(&mut cost, 8, 1_000_000, 0.2, 0);
        // Each span: seven samples at 50 us, one at 2 ms (a new method met).
        let span = |cost: &mut AgentCost| {
            (0..7).for_each(|_| cost.add_sample(50_000));
            cost.add_sample(2_000_000);
        };
        for _ in 0..STEADY_SPANS {
            span(&mut cost);
        }
        let (charged, _) = cost.check(0.2, 0);
        let mean = (7.0 * 50e-6 + 2e-3) / 8.0;
        assert!(
            close(charged, 8.0 * STEADY_SPANS as f64 * mean),
            "{charged}"
        );
    }

    #[test]
    fn a_lasting_cost_is_charged_in_full_and_projected_uncoarsened() {
        let mut cost = AgentCost::default();
        for _ in 0..=STEADY_SPANS {
            check(&mut cost, 40, 400_000, 0.2, 0);
        }
        // 200 samples a second at 400 us: 8% of a CPU.
        let (charged, uncoarsened) = check(&mut cost, 40, 400_000, 0.2, 0);
        assert!(close(charged, 40.0 * 400e-6), "{charged}");
        assert!(close(uncoarsened, 0.08), "{uncoarsened}");
        // Coarsened 8x it gives 5 samples a check: the same projection.
        let (charged, uncoarsened) = check(&mut cost, 5, 400_000, 0.2, 3);
        assert!(close(charged, 5.0 * 400e-6), "{charged}");
        assert!(close(uncoarsened, 0.08), "{uncoarsened}");
    }

    #[test]
    fn a_check_without_samples_does_not_read_as_free() {
        let mut cost = AgentCost::default();
        for _ in 0..=STEADY_SPANS {
            check(&mut cost, 40, 400_000, 0.2, 0);
        }
        // Coarsened 16x, two checks with no sample: the projection falls by a tenth
        // each (0.2 s of the 2 s smoothing), not to zero.
        let (_, first) = check(&mut cost, 0, 0, 0.2, 4);
        let (_, second) = check(&mut cost, 0, 0, 0.2, 4);
        assert!(
            close(first, 0.072) && close(second, 0.0648),
            "{first} {second}"
        );
        assert_eq!(next_coarsening(4, second, 0.01), 4);
    }
}
