//! Measuring the observer effect (docs/statistics.md, "Pace"): every process's CPU
//! clock and probe hits, read at each probe change, make the spans of its
//! [`PaceTally`] (the model and the ratio are `allocbpf_profile::estimate::pace`).
//!
//! The process's CPU clock is the kernel's `sum_exec_runtime` of the thread group, in
//! nanoseconds, read with `clock_gettime` on the process's CPU clock. Each span between
//! two readings adds to the state it began in: wall time, CPU time, and the CPU time
//! its hits cost at the calibrated price of a hit.

use allocbpf_profile::estimate::pace::{PaceTally, ProbeState};

use allocbpf_probe::sampler::clock_ns;

use super::{HitCost, Hits};

/// The CPU time a process has used so far, all its threads, ns (`None`: it is gone).
///
/// The kernel's process CPU clock (`MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)`) is the
/// thread group's `sum_exec_runtime`: nanosecond-exact, unlike `/proc/PID/stat`'s
/// utime and stime, which are clock ticks (4 ms here) and were too coarse for windows
/// of 10-30 ms. Reading another process's clock needs no permission beyond seeing it;
/// a pid reused by a new process shows as a clock that went backwards (handled by
/// [`PaceMeter::read`]).
pub fn process_cpu_ns(pid: u32) -> Option<u64> {
    // Pid 0 means the caller, and the clock id keeps 29 bits of the pid, so 2^29 - 1
    // would too: pid_max is at most 2^22, and nothing above it is a process.
    if pid == 0 || pid > 1 << 22 {
        return None;
    }
    // MAKE_PROCESS_CPUCLOCK: the pid's complement shifted left by 3, clock 2 (SCHED).
    clock_ns(((!pid) << 3 | 2) as libc::clockid_t)
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
            self.restart();
            return;
        };
        if let Some(last) = self.last {
            let forward = now.at_ns >= last.at_ns
                && now.cpu_ns >= last.cpu_ns
                && now.hits.all >= last.hits.all
                && now.hits.stepped >= last.hits.stepped
                && now.hits.sample_ns >= last.hits.sample_ns;
            if forward {
                let trap_ns = cost.seconds(&last.hits, &now.hits) * 1e9;
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

    /// Forgets the last reading: the next one starts a new span (after an exec, or an
    /// exit, whose spans would mix two programs or a reused pid).
    pub fn restart(&mut self) {
        self.last = None;
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
                sample_ns: 0,
            },
            state,
        })
    }

    /// Readings make spans: a CPU-bound process at half its pace while probed.
    #[test]
    fn readings_make_spans_of_the_state_they_begin_in() {
        let mut meter = PaceMeter::default();
        meter.read(reading(0, 0, 0, true), &COST);
        meter.read(reading(50, 50, 25_000, false), &COST);
        meter.read(reading(1_000, 1_000, 25_000, true), &COST);
        let ratio = meter.tally.ratio().unwrap();
        assert!((ratio - 0.5).abs() < 1e-9, "{ratio}");
        assert_eq!(meter.tally.probed_wall_ns, 50e6);
        assert_eq!(meter.tally.unprobed_wall_ns, 950e6);
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
        assert_eq!(meter.last.map(|r| r.state), Some(ProbeState::Unprobed));
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
        assert_eq!(process_cpu_ns((1 << 29) - 1), None);
    }
}
