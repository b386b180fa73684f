//! The observer effect: how much slower a process works while its probes are in
//! (docs/statistics.md, "Pace").
//!
//! Time sampling weighs a window's samples by `1/d` on the premise that a process
//! allocates at the same pace inside its windows as outside. A process whose probes
//! take a real share of its time does not: inside a window a CPU-bound process spends
//! part of its CPU in traps and does that much less of its own work, so the window sees
//! fewer of its allocations per second than the rest of the interval had.
//!
//! Allocations follow the work a program does, and its work is the CPU time it spends
//! outside the traps. A [`PaceTally`] sums, over an interval, the wall time and the
//! work of a process with its probes in and with them out; the pace ratio
//! `r = (work_in / wall_in) / (work_out / wall_out)` is 1 for a process whose work is
//! paced by the clock or by its input (the traps take idle time), and `1 - s` for a
//! CPU-bound process whose traps take a share `s` of its probed CPU. Scaling the
//! time-weighted estimate by [`PaceCorrection::factor`] (`q + (1 - q)/r` for a process
//! probed a share `q` of the time) makes it estimate the whole interval again. The collector measures the spans (the
//! process's CPU clock and probe hits at every probe change).

/// The least probed and unprobed wall time, each, for a pace ratio to be measured: a
/// window or two of the default budget (10 ms each) and a tenth of a period outside.
const MIN_WALL_NS: f64 = 20e6;

/// The least work (CPU time outside the traps) unprobed for a ratio: below a
/// millisecond the process barely ran, and the ratio would be noise. (Probed, a
/// process may do almost no work at all: its traps took it, and the ratio is floored.)
const MIN_WORK_NS: f64 = 1e6;

/// The least share of its probed CPU a process must spend in traps for its pace to be
/// corrected (the profiles' `probe_share` threshold): below it the traps cannot have
/// slowed it by more than that.
pub const MIN_TRAP_SHARE: f64 = 0.05;

/// The share of its CPUs a process must keep busy while probed for its pace to be
/// corrected. A CPU-bound process is at ~1 (measured: `busy.c` and cc1 0.99-1.0); the
/// light allocators of the tests, paced by the clock, at 0.02-0.15. Below it the traps
/// are taken as absorbed by idle time.
pub const SATURATED: f64 = 0.75;

/// The smallest pace ratio applied. A process spending over 99% of its probed time in
/// traps leaves too little work to measure against the calibrated cost of a hit (a 1%
/// error in that cost would be the whole remainder): its estimate is raised 100x at
/// most and the profile says so (`probe_share`). Probes on every small object of an
/// interpreter slow a tight loop of allocations to a few percent of its pace
/// (docs/statistics.md, "Pace"), so the floor is below that.
pub const MIN_PACE: f64 = 0.01;

/// What a hit may cost a process in place, as multiples of its calibrated cost: the
/// range its profile's interval allows for. The calibration times hits in a small hot
/// loop; in place a hit meets the process's cold caches, and its own code runs slower
/// after each trap, the more so the larger its code (an interpreter's dispatch loop, a
/// compiler). The measured range is in docs/statistics.md ("Pace"); the top is the
/// largest seen with a margin, the bottom the smallest.
pub const IN_PLACE_COST: (f64, f64) = (0.85, 2.0);

/// Whether a process's probes are in, for its pace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeState {
    /// Every image it maps has its probes in: as in its observation windows.
    Probed,
    /// None has, and none is being detached.
    Unprobed,
    /// In between: some images in and others out, an attach under way, or links closing
    /// on other threads whose breakpoints may still trap. Such spans count in the
    /// interval's totals only, not in either rate.
    Changing,
}

/// The observer effect measured over an interval, and what its estimates are scaled by.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PaceCorrection {
    /// Work per second probed over work per second unprobed, in `[MIN_PACE, 1]`.
    pub ratio: f64,
    /// What the time-weighted estimates are multiplied by: the process's mean work
    /// per second over the interval over its work per second where the samples were
    /// taken (probed), at least 1.
    pub factor: f64,
    /// The least the factor would be for a hit costing the process anywhere in
    /// [`IN_PLACE_COST`] times its calibrated cost (at most `factor`).
    pub factor_low: f64,
    /// The most it would be (at least `factor`).
    pub factor_high: f64,
}

impl PaceCorrection {
    /// What the correction did, in a sentence's words for the text and pprof outputs:
    /// the factor, its range for an in-place hit cost in [`IN_PLACE_COST`] (which the
    /// total's interval includes) and the pace.
    pub fn summary(&self) -> String {
        let (low, high) = IN_PLACE_COST;
        format!(
            "estimates scaled by {:.3} for the pace measured while probed, {:.3} of the pace \
             unprobed (observer effect corrected; it would be {:.3} to {:.3} had a hit cost {low}x to \
             {high}x its calibrated cost in place, a range the total's CI includes)",
            self.factor, self.ratio, self.factor_low, self.factor_high
        )
    }

    /// How far below and above `estimate` (already scaled by `factor`) the estimate
    /// could lie for a hit cost anywhere in [`IN_PLACE_COST`], bytes: what its interval
    /// is widened by.
    pub fn slack(&self, estimate: f64) -> PaceSlack {
        PaceSlack {
            below: estimate * (1.0 - self.factor_low / self.factor),
            above: estimate * (self.factor_high / self.factor - 1.0),
        }
    }
}

/// How far an estimate corrected for its pace could lie from where the calibrated hit
/// cost put it, bytes: a systematic error, added to the sampling interval's ends.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PaceSlack {
    /// Below the estimate.
    pub below: f64,
    /// Above the estimate.
    pub above: f64,
}

impl PaceSlack {
    /// Both processes' slack (their estimates add up, so do their errors).
    pub fn add(&mut self, other: PaceSlack) {
        self.below += other.below;
        self.above += other.above;
    }
}

/// Wall time, CPU time and traps of one interval, probed and unprobed. A span's trap
/// time is at most its CPU time, so its work (CPU time outside the traps) is the
/// difference.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PaceTally {
    /// Wall time with probes in, ns.
    pub probed_wall_ns: f64,
    /// CPU time with probes in, ns.
    pub probed_cpu_ns: f64,
    /// CPU time spent in traps with probes in, ns (estimated from hits).
    pub probed_trap_ns: f64,
    /// Wall time with probes out, ns.
    pub unprobed_wall_ns: f64,
    /// CPU time with probes out, ns.
    pub unprobed_cpu_ns: f64,
    /// CPU time spent in the traps of detaching probes with probes out, ns.
    pub unprobed_trap_ns: f64,
    /// Wall time of every span, whatever its state, ns.
    pub total_wall_ns: f64,
    /// CPU time of every span, whatever its state, ns.
    pub total_cpu_ns: f64,
    /// CPU time spent in traps over every span, ns.
    pub total_trap_ns: f64,
    /// The CPUs the process could use: its most threads seen, at most the host's CPUs
    /// (0: not seen).
    pub capacity: f64,
}

impl PaceTally {
    /// Adds one span: `wall_ns` long, `cpu_ns` of CPU time of which `trap_ns` in traps.
    pub fn add(&mut self, state: ProbeState, wall_ns: f64, cpu_ns: f64, trap_ns: f64) {
        // The trap cost is an estimate; work cannot go below nothing.
        let trap = trap_ns.min(cpu_ns).max(0.0);
        self.total_wall_ns += wall_ns;
        self.total_cpu_ns += cpu_ns;
        self.total_trap_ns += trap;
        match state {
            ProbeState::Probed => {
                self.probed_wall_ns += wall_ns;
                self.probed_cpu_ns += cpu_ns;
                self.probed_trap_ns += trap;
            }
            ProbeState::Unprobed => {
                self.unprobed_wall_ns += wall_ns;
                self.unprobed_cpu_ns += cpu_ns;
                self.unprobed_trap_ns += trap;
            }
            ProbeState::Changing => {}
        }
    }

    /// Records that the process could use `cpus` CPUs (its threads, at most the
    /// host's): the largest seen counts.
    pub fn saw_capacity(&mut self, cpus: f64) {
        self.capacity = self.capacity.max(cpus);
    }

    /// True if the process kept its CPUs busy while probed (at least
    /// [`SATURATED`] of its capacity): only then do its traps take time from its work
    /// rather than from its idle time. Capacity unknown: assumed.
    pub fn saturated(&self) -> bool {
        if self.capacity <= 0.0 || self.probed_wall_ns <= 0.0 {
            return true;
        }
        self.probed_cpu_ns / self.probed_wall_ns >= SATURATED * self.capacity
    }

    /// The pace ratio and the factor its estimates are scaled by. `None` when the traps
    /// took under [`MIN_TRAP_SHARE`] of the process's probed CPU (the correction would
    /// be noise, and the bias it leaves is at most that share), or either state was too
    /// short, or the process did too little work unprobed, to tell; or when it was not
    /// saturated while probed ([`PaceTally::saturated`]): a process with idle time
    /// absorbs its traps there (paced by the clock or its input), and its measured
    /// ratio would be noise around 1, which the cap would turn into an upward lean. Its
    /// estimate is then left as time weighting makes it.
    ///
    /// The ratio is work per second probed over work per second unprobed, floored at
    /// [`MIN_PACE`] and capped at 1: probes only ever slow a process. A measured ratio
    /// above 1 means the process's traps cost more than the calibrated hit (its sampled
    /// hits copy stacks; its caches are cold after each trap) and it absorbed them in
    /// idle time: a process paced by the clock or by its input, which its probes do not
    /// slow (factor 1).
    ///
    /// The factor is measured, not modelled: the windows saw the process allocating at
    /// its probed work rate, and over the interval it did `total_work` of work in all,
    /// so `Σ S/(p d)` (which stands for the probed rate over the whole interval) is
    /// scaled by its mean work rate over its probed one. Under a pace `r` while probed a
    /// share `q` of the time, that is `q + (1 - q)/r` (docs/statistics.md, "Pace").
    ///
    /// The work is CPU time less the calibrated cost of the hits; `factor_low` and
    /// `factor_high` are the factor with every hit costing the ends of
    /// [`IN_PLACE_COST`] times that instead (the same spans, the same gates).
    pub fn correction(&self) -> Option<PaceCorrection> {
        if self.probed_wall_ns < MIN_WALL_NS
            || self.unprobed_wall_ns < MIN_WALL_NS
            || self.unprobed_cpu_ns - self.unprobed_trap_ns < MIN_WORK_NS
            || self.trap_share()? < MIN_TRAP_SHARE
            || !self.saturated()
        {
            return None;
        }
        let (ratio, factor) = self.pace_at(1.0);
        let (low, high) = IN_PLACE_COST;
        // The factor rises with the cost until the ratio reaches its floor, then falls
        // (the floored ratio no longer follows the work it loses): its extremes over
        // the range are at the ends or where the ratio meets the floor.
        let factors: Vec<f64> = [Some(low), Some(high), self.floor_cost()]
            .into_iter()
            .flatten()
            .filter(|cost| (low..=high).contains(cost))
            .map(|cost| self.pace_at(cost).1)
            .collect();
        Some(PaceCorrection {
            ratio,
            factor,
            factor_low: factors.iter().copied().fold(factor, f64::min),
            factor_high: factors.iter().copied().fold(factor, f64::max),
        })
    }

    /// The hit cost (times the calibrated one) at which the pace ratio reaches
    /// [`MIN_PACE`]: `inside(c) = MIN_PACE · outside(c)`, linear in `c`. `None` if the
    /// two never meet.
    fn floor_cost(&self) -> Option<f64> {
        let probed = |ns: f64| ns / self.probed_wall_ns;
        let unprobed = |ns: f64| ns / self.unprobed_wall_ns;
        let slope = probed(self.probed_trap_ns) - MIN_PACE * unprobed(self.unprobed_trap_ns);
        (slope > 0.0).then(|| {
            (probed(self.probed_cpu_ns) - MIN_PACE * unprobed(self.unprobed_cpu_ns)) / slope
        })
    }

    /// The slack of an estimate NOT corrected for its pace (`correction` gave none) of
    /// this process, bytes: if its probes took a share `s` of its probed CPU (at least
    /// [`MIN_TRAP_SHARE`]) and it was not measured keeping idle time then (a process
    /// that did absorbs its traps there: [`PaceTally::saturated`]), it may have worked
    /// at as little as `1 - c·s` of its pace while probed, `c` the top of
    /// [`IN_PLACE_COST`] (floored at [`MIN_PACE`]): the truth may be up to
    /// `1/(1 - c·s)` times `estimate` (conservative: as if probed all the time).
    /// Nothing below.
    pub fn uncorrected_slack(&self, estimate: f64) -> PaceSlack {
        match self.trap_share() {
            Some(share) if share >= MIN_TRAP_SHARE && self.saturated() => {
                let pace = (1.0 - IN_PLACE_COST.1 * share).clamp(MIN_PACE, 1.0);
                PaceSlack {
                    below: 0.0,
                    above: estimate * (1.0 / pace - 1.0),
                }
            }
            _ => PaceSlack::default(),
        }
    }

    /// The pace ratio and the factor with every hit costing `cost` times its
    /// calibrated cost: work is CPU time less that, floored at nothing.
    fn pace_at(&self, cost: f64) -> (f64, f64) {
        let work = |cpu: f64, trap: f64| (cpu - cost * trap).max(0.0);
        let outside = work(self.unprobed_cpu_ns, self.unprobed_trap_ns) / self.unprobed_wall_ns;
        if outside <= 0.0 {
            // At this cost its detaching probes' traps would have taken all its CPU out
            // of the windows too (only above the calibrated cost, and only for traps
            // over 3/4 of its unprobed CPU): no pace to tell; the cap's factor, the
            // most a correction ever applies.
            return (MIN_PACE, 1.0 / MIN_PACE);
        }
        let inside = work(self.probed_cpu_ns, self.probed_trap_ns) / self.probed_wall_ns;
        let ratio = (inside / outside).clamp(MIN_PACE, 1.0);
        if ratio >= 1.0 {
            return (ratio, 1.0);
        }
        let mean = work(self.total_cpu_ns, self.total_trap_ns) / self.total_wall_ns;
        (ratio, (mean / (ratio * outside)).max(1.0))
    }

    /// The pace ratio alone ([`PaceTally::correction`]).
    pub fn ratio(&self) -> Option<f64> {
        self.correction().map(|c| c.ratio)
    }

    /// The share of its CPU time the process spent in traps while probed.
    pub fn trap_share(&self) -> Option<f64> {
        (self.probed_cpu_ns > 0.0).then(|| self.probed_trap_ns / self.probed_cpu_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: f64 = 1e6;

    /// A CPU-bound process: one CPU all the time; while probed, half of it in traps.
    /// It does half its work then: r = 0.5.
    #[test]
    fn a_cpu_bound_process_is_slowed_by_its_trap_share() {
        let mut tally = PaceTally::default();
        tally.add(ProbeState::Probed, 50.0 * MS, 50.0 * MS, 25.0 * MS);
        tally.add(ProbeState::Unprobed, 950.0 * MS, 950.0 * MS, 0.0);
        assert!((tally.ratio().unwrap() - 0.5).abs() < 1e-9);
        assert!((tally.trap_share().unwrap() - 0.5).abs() < 1e-9);
        // Probed 5% of the time at half its pace: 0.05 + 0.95 / 0.5 = 1.95.
        let factor = tally.correction().unwrap().factor;
        assert!((factor - 1.95).abs() < 1e-9, "{factor}");
        // Had each hit cost 2x its calibrated cost, its traps would have taken all its
        // probed CPU: the ratio meets its floor at 50 - 25c = MIN_PACE · 50, where the
        // factor peaks, with 1,000 - 25c ms of work in all. At 0.85x, 28.75 ms
        // (r = 0.575) and 978.75 ms: 0.97875 / 0.575.
        let pace = tally.correction().unwrap();
        let floor = (50.0 - MIN_PACE * 50.0) / 25.0;
        let high = (1_000.0 - 25.0 * floor) / 1_000.0 / MIN_PACE;
        assert!((pace.factor_high - high).abs() < 1e-9, "{pace:?}");
        assert!((pace.factor_low - 0.97875 / 0.575).abs() < 1e-9, "{pace:?}");
        // The slack of an estimate of 1,950 bytes: 1,950 (1 - low/1.95) below and
        // 1,950 (high/1.95 - 1) above.
        let slack = pace.slack(1_950.0);
        assert!((slack.below - (1_950.0 - 1_000.0 * pace.factor_low)).abs() < 1e-6);
        assert!((slack.above - (1_000.0 * pace.factor_high - 1_950.0)).abs() < 1e-6);
        // A span in between (an attach under way) counts in the totals only: the mean
        // work rate, and so the factor, follow what the process really did.
        tally.add(ProbeState::Changing, 100.0 * MS, 100.0 * MS, 25.0 * MS);
        assert!((tally.ratio().unwrap() - 0.5).abs() < 1e-9);
        let mean = (25.0 + 950.0 + 75.0) / 1_100.0;
        let factor = tally.correction().unwrap().factor;
        assert!((factor - mean / 0.5).abs() < 1e-9, "{factor}");
    }

    /// A process paced by the clock: 10% of a CPU of work in and out of its windows,
    /// plus its traps while probed (which take idle time, not work): r = 1. And when
    /// its traps cost more than the calibrated hit, it seems to work faster while
    /// probed, which probes never make it: capped at 1.
    #[test]
    fn a_clock_paced_process_keeps_its_pace() {
        let mut tally = PaceTally::default();
        tally.add(ProbeState::Probed, 50.0 * MS, 10.0 * MS, 5.0 * MS);
        tally.add(ProbeState::Unprobed, 1_000.0 * MS, 100.0 * MS, 0.0);
        assert!((tally.ratio().unwrap() - 1.0).abs() < 1e-9);
        tally.add(ProbeState::Probed, 50.0 * MS, 25.0 * MS, 5.0 * MS);
        assert_eq!(
            tally.correction(),
            Some(PaceCorrection {
                ratio: 1.0,
                factor: 1.0,
                factor_low: 1.0,
                factor_high: 1.0,
            }),
            "a hit costing 2x still leaves it faster probed: 15 ms of work in 100"
        );
    }

    /// A process with idle time while probed (10% of one CPU it could use) is not
    /// corrected, whatever its ratio measured: its traps took idle time.
    #[test]
    fn an_unsaturated_process_is_not_corrected() {
        let mut tally = PaceTally::default();
        tally.add(ProbeState::Probed, 100.0 * MS, 10.0 * MS, 3.0 * MS);
        tally.add(ProbeState::Unprobed, 900.0 * MS, 90.0 * MS, 0.0);
        assert!(
            tally.correction().is_some(),
            "capacity unknown: assumed saturated"
        );
        tally.saw_capacity(1.0);
        assert_eq!(tally.correction(), None);
        let mut busy = PaceTally::default();
        busy.add(ProbeState::Probed, 100.0 * MS, 100.0 * MS, 30.0 * MS);
        busy.add(ProbeState::Unprobed, 900.0 * MS, 900.0 * MS, 0.0);
        busy.saw_capacity(1.0);
        assert!((busy.ratio().unwrap() - 0.7).abs() < 1e-9);
    }

    /// cc1's regime: traps take 80% of its probed CPU at the calibrated cost, so at
    /// 1.25x they would take it all and the ratio is floored. The factor peaks where the
    /// ratio meets the floor, inside the range, not at its end; the range holds the
    /// factor at every cost in it.
    #[test]
    fn the_factor_range_holds_its_peak_inside_the_cost_range() {
        let mut tally = PaceTally::default();
        tally.add(ProbeState::Probed, 100.0 * MS, 100.0 * MS, 80.0 * MS);
        tally.add(ProbeState::Unprobed, 900.0 * MS, 900.0 * MS, 0.0);
        let pace = tally.correction().unwrap();
        // The ratio meets its floor where 100 - 80c = 100 MIN_PACE.
        let floor = (100.0 - 100.0 * MIN_PACE) / 80.0;
        let peak = tally.pace_at(floor).1;
        assert!((tally.floor_cost().unwrap() - floor).abs() < 1e-9);
        assert!(
            peak > tally.pace_at(1.3).1,
            "past the floor the factor falls"
        );
        assert!((pace.factor_high - peak).abs() < 1e-9, "{pace:?} {peak}");
        for step in 0..=115 {
            let cost = 0.85 + 0.01 * f64::from(step);
            let factor = tally.pace_at(cost).1;
            assert!(
                pace.factor_low <= factor + 1e-12 && factor <= pace.factor_high + 1e-12,
                "{cost}: {factor} outside {pace:?}"
            );
        }
    }

    /// Not corrected: a saturated process (or one whose CPUs are unknown) with a 20%
    /// trap share may be low by up to 1/(1 - c·0.2), `c` the top of [`IN_PLACE_COST`]; one that kept idle time while
    /// probed, or whose traps were light, has no slack.
    #[test]
    fn an_uncorrected_process_has_an_upper_slack_only_if_it_may_be_slowed() {
        let mut busy = PaceTally::default();
        busy.add(ProbeState::Probed, 10.0 * MS, 10.0 * MS, 2.0 * MS);
        assert_eq!(busy.correction(), None, "10 ms probed: too short");
        let slack = busy.uncorrected_slack(1_000.0);
        assert_eq!(slack.below, 0.0);
        let pace = 1.0 - IN_PLACE_COST.1 * 0.2;
        assert!((slack.above - 1_000.0 * (1.0 / pace - 1.0)).abs() < 1e-9);
        busy.saw_capacity(1.0);
        assert_eq!(busy.uncorrected_slack(1_000.0), slack, "1 CPU busy");

        let mut idle = PaceTally::default();
        idle.add(ProbeState::Probed, 10.0 * MS, 1.0 * MS, 0.2 * MS);
        idle.saw_capacity(1.0);
        assert_eq!(idle.uncorrected_slack(1_000.0), PaceSlack::default());
        let mut light = PaceTally::default();
        light.add(ProbeState::Probed, 10.0 * MS, 10.0 * MS, 0.2 * MS);
        assert_eq!(light.uncorrected_slack(1_000.0), PaceSlack::default());
    }

    /// Under a 5% trap share: not corrected. Too short in either state: no ratio. All
    /// traps: floored. Changing spans count nowhere.
    #[test]
    fn ratios_need_a_trap_share_enough_time_and_work() {
        let mut light = PaceTally::default();
        light.add(ProbeState::Probed, 50.0 * MS, 20.0 * MS, 0.5 * MS);
        light.add(ProbeState::Unprobed, 1_000.0 * MS, 980.0 * MS, 0.0);
        assert_eq!(light.ratio(), None);

        let mut short = PaceTally::default();
        short.add(ProbeState::Probed, 10.0 * MS, 10.0 * MS, 10.0 * MS);
        short.add(ProbeState::Unprobed, 990.0 * MS, 980.0 * MS, 0.0);
        assert_eq!(short.ratio(), None, "10 ms probed is too short");
        short.add(ProbeState::Probed, 40.0 * MS, 40.0 * MS, 40.0 * MS);
        assert_eq!(short.ratio(), Some(MIN_PACE), "all traps: floored");

        let mut idle = PaceTally::default();
        idle.add(ProbeState::Probed, 100.0 * MS, 0.0, 0.0);
        idle.add(ProbeState::Unprobed, 900.0 * MS, 0.0, 0.0);
        assert_eq!(idle.ratio(), None, "no work anywhere");

        let before = light;
        light.add(ProbeState::Changing, 90.0 * MS, 90.0 * MS, 5.0 * MS);
        assert_eq!(light.probed_wall_ns, before.probed_wall_ns);
        assert_eq!(light.unprobed_wall_ns, before.unprobed_wall_ns);
        assert_eq!(light.total_wall_ns, before.total_wall_ns + 90.0 * MS);
    }
}
