//! The observer effect, measured: how much slower a process works while its probes are
//! in (docs/statistics.md, "Pace").
//!
//! Time sampling weighs a window's samples by `1/d` on the premise that a process
//! allocates at the same pace inside its windows as outside. A process whose probes
//! take a real share of its time does not: inside a window a CPU-bound process spends
//! part of its CPU in traps and does that much less of its own work, so the window sees
//! fewer of its allocations per second than the rest of the interval had (cc1: an
//! estimate at ~10% of the truth without this).
//!
//! Allocations follow the work a program does, and its work is the CPU time it spends
//! outside the traps. The process's CPU clock (the kernel's `sum_exec_runtime` of the
//! thread group, in nanoseconds, read with `clock_gettime` on the process's CPU clock)
//! is read at every change of its probes (attach, detach) and at every budget check,
//! with its probe hits. Each span between two readings adds to the probed or the
//! unprobed tally: wall time, and work = CPU time less the hits' measured cost. The
//! pace ratio `r = (work_in / wall_in) / (work_out / wall_out)` is 1 for a process whose
//! work is paced by the clock or by input (the traps take idle time), and `1 - s` for a
//! CPU-bound process whose traps take a share `s` of its probed CPU. Dividing the
//! time-weighted estimate by `r` makes it estimate the whole interval again.

use super::{HitCost, Hits};

/// The least probed and unprobed wall time, each, for a pace ratio to be measured: a
/// window or two of the default budget (10 ms each) and a tenth of a period outside.
const MIN_WALL_NS: f64 = 20e6;

/// The least work (CPU time outside the traps) in each state for a ratio: below a
/// millisecond the process barely ran, and the ratio would be noise.
const MIN_WORK_NS: f64 = 1e6;

/// The least share of its probed CPU a process must spend in traps for its pace to be
/// corrected (the profiles' `probe_share` threshold): below it the traps cannot have
/// slowed it by more than that.
pub const MIN_TRAP_SHARE: f64 = 0.05;

/// The smallest pace ratio applied. A process spending over 95% of its probed time in
/// traps leaves too little work to measure against the calibrated cost of a hit (a 5%
/// error in that cost would be the whole remainder): its estimate is raised 20x at most
/// and the profile says so (`probe_share`).
pub const MIN_PACE: f64 = 0.05;

/// The CPU time a process has used so far, all its threads, ns (`None`: it is gone).
///
/// The kernel's process CPU clock (`MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)`) is the
/// thread group's `sum_exec_runtime`: nanosecond-exact, unlike `/proc/PID/stat`'s
/// utime and stime, which are clock ticks (4 ms here) and were too coarse for windows
/// of 10-30 ms. Reading another process's clock needs no permission beyond seeing it;
/// a pid reused by a new process shows as a clock that went backwards (handled by
/// [`PaceMeter::read`]).
pub fn process_cpu_ns(pid: u32) -> Option<u64> {
    // Pid 0 means the caller, and the clock id has 29 bits for the pid (pid_max is at
    // most 2^22): neither may alias this process's own clock.
    if pid == 0 || pid >= 1 << 29 {
        return None;
    }
    // MAKE_PROCESS_CPUCLOCK: the pid's complement shifted left by 3, clock 2 (SCHED).
    let clock = ((!pid) << 3 | 2) as libc::clockid_t;
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-parameter; a bad clock id fails with EINVAL.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    (rc == 0).then(|| ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
}

/// One reading of a process: when, its CPU clock and its probe hits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PaceReading {
    /// CLOCK_MONOTONIC, ns.
    pub at_ns: u64,
    /// The process's CPU clock, ns.
    pub cpu_ns: u64,
    /// Its probe hits so far.
    pub hits: Hits,
    /// Its probes from this reading on.
    pub state: ProbeState,
}

/// Whether a process's probes are in, for its pace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeState {
    /// Some image it maps has its probes in.
    Probed,
    /// None has.
    Unprobed,
    /// Probes are going in or out: an attach under way, or links closing on other
    /// threads whose breakpoints may still trap. Such spans are left out of both
    /// tallies.
    Changing,
}

/// Wall time and work of one interval, probed and unprobed.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PaceTally {
    /// Wall time with probes in, ns.
    pub probed_wall_ns: f64,
    /// Work (CPU time less the traps' cost) with probes in, ns.
    pub probed_work_ns: f64,
    /// CPU time spent in traps with probes in, ns (estimated from hits).
    pub probed_trap_ns: f64,
    /// Wall time with probes out, ns.
    pub unprobed_wall_ns: f64,
    /// Work with probes out (CPU time less the traps of detaching probes), ns.
    pub unprobed_work_ns: f64,
}

impl PaceTally {
    /// Adds one span: `wall_ns` long, `cpu_ns` of CPU time of which `trap_ns` in traps.
    pub fn add(&mut self, state: ProbeState, wall_ns: f64, cpu_ns: f64, trap_ns: f64) {
        // The trap cost is an estimate; work cannot go below nothing.
        let work = (cpu_ns - trap_ns).max(0.0);
        match state {
            ProbeState::Probed => {
                self.probed_wall_ns += wall_ns;
                self.probed_work_ns += work;
                self.probed_trap_ns += trap_ns.min(cpu_ns);
            }
            ProbeState::Unprobed => {
                self.unprobed_wall_ns += wall_ns;
                self.unprobed_work_ns += work;
            }
            ProbeState::Changing => {}
        }
    }

    /// The pace ratio: work per second probed over work per second unprobed, between
    /// [`MIN_PACE`] and 1. `None` when the traps took under [`MIN_TRAP_SHARE`] of the
    /// process's probed CPU (the correction would be noise, and the bias it leaves is
    /// at most that share), or either state was too short, or the process did too
    /// little work in either, to tell; its estimate is then left as time weighting makes
    /// it.
    ///
    /// Capped at 1: probes only ever slow a process. A measured ratio above 1 means the
    /// process's traps cost more than the calibrated hit (its sampled hits copy stacks;
    /// its caches are cold after each trap) and it absorbed them in idle time: a process
    /// paced by the clock or by its input, which its probes do not slow.
    pub fn ratio(&self) -> Option<f64> {
        if self.probed_wall_ns < MIN_WALL_NS
            || self.unprobed_wall_ns < MIN_WALL_NS
            || self.unprobed_work_ns < MIN_WORK_NS
            || self.trap_share()? < MIN_TRAP_SHARE
        {
            return None;
        }
        let inside = self.probed_work_ns / self.probed_wall_ns;
        let outside = self.unprobed_work_ns / self.unprobed_wall_ns;
        Some((inside / outside).clamp(MIN_PACE, 1.0))
    }

    /// The share of its CPU time the process spent in traps while probed.
    pub fn trap_share(&self) -> Option<f64> {
        let cpu = self.probed_work_ns + self.probed_trap_ns;
        (cpu > 0.0).then(|| self.probed_trap_ns / cpu)
    }
}

/// One process's last reading and the current interval's tally.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PaceMeter {
    last: Option<PaceReading>,
    /// The current interval's tally.
    pub tally: PaceTally,
}

impl PaceMeter {
    /// Takes a reading: the span since the last one is added to the state it began in,
    /// with the hits in it costed by `cost`. `None` readings (the process is gone) end
    /// the meter's span; a clock or hit count that went backwards (a reused pid, a
    /// re-created kernel entry) starts over from this reading.
    pub fn read(&mut self, now: Option<PaceReading>, cost: &HitCost) {
        let Some(now) = now else {
            self.last = None;
            return;
        };
        if let Some(last) = self.last {
            let forward = now.at_ns >= last.at_ns
                && now.cpu_ns >= last.cpu_ns
                && now.hits.all >= last.hits.all
                && now.hits.stepped >= last.hits.stepped;
            if forward {
                let trap_ns = cost.seconds(
                    now.hits.all - last.hits.all,
                    now.hits.stepped - last.hits.stepped,
                ) * 1e9;
                self.tally.add(
                    last.state,
                    (now.at_ns - last.at_ns) as f64,
                    (now.cpu_ns - last.cpu_ns) as f64,
                    trap_ns,
                );
            }
        }
        self.last = Some(now);
    }

    /// The state the last reading found the process in.
    pub fn state(&self) -> Option<ProbeState> {
        self.last.map(|r| r.state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COST: HitCost = HitCost {
        hit_ns: 1_000.0,
        stepped_extra_ns: 0.0,
    };

    fn reading(at_ms: u64, cpu_ms: u64, hits: u64, probed: bool) -> Option<PaceReading> {
        let state = match probed {
            true => ProbeState::Probed,
            false => ProbeState::Unprobed,
        };
        Some(PaceReading {
            at_ns: at_ms * 1_000_000,
            cpu_ns: cpu_ms * 1_000_000,
            hits: Hits {
                all: hits,
                stepped: 0,
            },
            state,
        })
    }

    /// A CPU-bound process: one CPU all the time; while probed, half of it in traps
    /// (25,000 hits of 1 us in 50 ms). It does half its work then: r = 0.5.
    #[test]
    fn a_cpu_bound_process_is_slowed_by_its_trap_share() {
        let mut meter = PaceMeter::default();
        meter.read(reading(0, 0, 0, true), &COST);
        meter.read(reading(50, 50, 25_000, false), &COST);
        meter.read(reading(1_000, 1_000, 25_000, true), &COST);
        let ratio = meter.tally.ratio().unwrap();
        assert!((ratio - 0.5).abs() < 1e-9, "{ratio}");
        assert!((meter.tally.trap_share().unwrap() - 0.5).abs() < 1e-9);
    }

    /// A process paced by the clock: 10% of a CPU of work in and out of its windows,
    /// plus its traps while probed (which take idle time, not work): r = 1.
    #[test]
    fn a_clock_paced_process_keeps_its_pace() {
        let mut meter = PaceMeter::default();
        meter.read(reading(0, 0, 0, true), &COST);
        // 50 ms probed: 5 ms of work and 5,000 hits (5 ms of traps).
        meter.read(reading(50, 10, 5_000, false), &COST);
        meter.read(reading(1_050, 110, 5_000, true), &COST);
        let ratio = meter.tally.ratio().unwrap();
        assert!((ratio - 1.0).abs() < 1e-9, "{ratio}");
        // Its traps cost twice the calibrated hit (stack copies): it seems to work
        // faster while probed, which probes never make it: capped at 1.
        let mut meter = PaceMeter::default();
        meter.read(reading(0, 0, 0, true), &COST);
        meter.read(reading(50, 15, 5_000, false), &COST);
        meter.read(reading(1_050, 115, 5_000, true), &COST);
        assert_eq!(meter.tally.ratio(), Some(1.0));
    }

    /// A process whose traps take under 5% of its probed CPU is not corrected.
    #[test]
    fn a_light_process_is_not_corrected() {
        let mut meter = PaceMeter::default();
        meter.read(reading(0, 0, 0, true), &COST);
        // 50 ms probed: 20 ms of CPU, 0.5 ms of it in 500 traps.
        meter.read(reading(50, 20, 500, false), &COST);
        meter.read(reading(1_050, 1_000, 500, true), &COST);
        assert_eq!(meter.tally.ratio(), None);
    }

    /// Too little time in either state, or too little work: no ratio. A process that
    /// spends all its probed time in traps is floored.
    #[test]
    fn ratios_need_enough_time_and_work_and_are_floored() {
        let mut meter = PaceMeter::default();
        meter.read(reading(0, 0, 0, true), &COST);
        meter.read(reading(10, 10, 10_000, false), &COST);
        meter.read(reading(1_000, 990, 10_000, true), &COST);
        assert_eq!(meter.tally.ratio(), None, "10 ms probed is too short");
        meter.read(reading(1_040, 1_030, 50_000, false), &COST);
        assert_eq!(meter.tally.ratio(), Some(MIN_PACE), "all traps: floored");

        let mut idle = PaceMeter::default();
        idle.read(reading(0, 0, 0, true), &COST);
        idle.read(reading(100, 0, 0, false), &COST);
        idle.read(reading(1_000, 0, 0, true), &COST);
        assert_eq!(idle.tally.ratio(), None, "no work anywhere");
    }

    /// A clock that went backwards (a reused pid) starts over instead of adding a
    /// negative span; a gone process ends the span.
    #[test]
    fn a_reused_pid_starts_over() {
        let mut meter = PaceMeter::default();
        meter.read(reading(0, 500, 0, true), &COST);
        meter.read(reading(100, 5, 0, true), &COST);
        assert_eq!(meter.tally, PaceTally::default());
        meter.read(None, &COST);
        meter.read(reading(200, 50, 0, false), &COST);
        assert_eq!(meter.tally, PaceTally::default());
        assert_eq!(meter.state(), Some(ProbeState::Unprobed));
    }

    /// Spans while probes go in or out count nowhere.
    #[test]
    fn changing_spans_are_left_out() {
        let mut meter = PaceMeter::default();
        meter.read(reading(0, 0, 0, true), &COST);
        let mut changing = reading(50, 50, 25_000, false).unwrap();
        changing.state = ProbeState::Changing;
        meter.read(Some(changing), &COST);
        meter.read(reading(140, 140, 30_000, false), &COST);
        assert_eq!(meter.tally.probed_wall_ns, 50e6);
        assert_eq!(meter.tally.unprobed_wall_ns, 0.0);
    }

    #[test]
    fn this_process_has_a_cpu_clock() {
        let before = process_cpu_ns(std::process::id()).unwrap();
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(std::hint::black_box(i));
        }
        std::hint::black_box(x);
        let after = process_cpu_ns(std::process::id()).unwrap();
        assert!(after > before, "{before} -> {after}");
        // No such process (pid_max is at most 2^22), and no pid that would alias
        // this process's own clock.
        assert_eq!(process_cpu_ns((1 << 22) + 1), None);
        assert_eq!(process_cpu_ns(0), None);
        assert_eq!(process_cpu_ns(u32::MAX >> 1), None);
    }
}
