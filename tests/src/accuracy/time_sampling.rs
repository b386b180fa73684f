//! Time sampling in simulation (docs/statistics.md, "Time sampling"): workloads that
//! allocate over `K` periods are observed in one window per period, of `d·P` ticks at a
//! uniformly random phase (circular, as the agent's `WindowSchedule` places them);
//! the allocations inside a window go through the kernel's sampling decision, and the
//! samples through the profile model's own estimator (`Aggregate` with a
//! `SampleWindow`, `TimeSampling::interval`). Each trial's estimate of the WHOLE
//! interval is compared with the truth, and its interval checked for coverage.
//!
//! The windows are re-implemented here from their definition rather than taken from
//! the engine: the harness checks the estimator against the law, not against itself.

use std::ops::Range;

use allocbpf_common::sampler::{decide, Decision};
use allocbpf_profile::{
    aggregate::{Aggregate, SampledAllocation, StackKey},
    estimate::{
        certain_threshold,
        pace::{PaceCorrection, PaceTally, ProbeState},
        windows::{SampleWindow, TimeSampling},
        Confidence,
    },
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::stats::{mean, variance};
use crate::simulate::IntervalSource;

/// Ticks per period.
pub const PERIOD: u64 = 1_000;

/// Periods per trial (a one-minute agent interval at the default 1 s period).
pub const PERIODS: u64 = 60;

/// How a simulated process allocates over time.
#[derive(Clone, Copy, Debug)]
pub enum Pattern {
    /// One allocation of `size` bytes every tick.
    Steady {
        /// Bytes per allocation.
        size: u64,
    },
    /// On/off: while on (entered with probability `1/mean_off` per tick, left with
    /// `1/mean_on`), one allocation of `size` bytes every tick; nothing while off.
    Bursty {
        /// Bytes per allocation.
        size: u64,
        /// Mean length of a burst, ticks.
        mean_on: u64,
        /// Mean pause between bursts, ticks.
        mean_off: u64,
    },
    /// CPU-bound and slowed by its probes (the observer effect, docs/statistics.md
    /// "Pace"): it runs every tick, `work` ticks of its own work before each allocation
    /// of `size` bytes; inside a window each allocation costs `trap` ticks more. Its
    /// pace while probed is `work / (work + trap)`; the estimate is corrected by the
    /// pace its CPU ticks show (`PaceTally`, as the collector measures it), with the
    /// traps counted at their calibrated cost: `trap · 100 / in_place_percent`.
    /// A short job: it lives `life` ticks from a start drawn uniformly in the
    /// interval, and allocates `size` bytes every tick of three bursts, the first,
    /// middle and last fifths of its life; nothing outside it.
    Short {
        /// Bytes per allocation.
        size: u64,
        /// Ticks it lives.
        life: u64,
    },
    CpuBound {
        /// Bytes per allocation.
        size: u64,
        /// Ticks of work before each allocation.
        work: u64,
        /// Ticks each allocation costs inside a window.
        trap: u64,
        /// What a trap really costs in place, percent of its calibrated cost (100:
        /// the calibration is right; 120: the process's traps cost it 1.2x).
        in_place_percent: u64,
    },
}

/// A tick in nanoseconds (a 1 s period of 1,000 ticks), for the pace's spans.
const TICK_NS: f64 = 1e6;

/// What many trials of one pattern at one duty showed.
#[derive(Clone, Debug)]
pub struct TimeSamplingSummary {
    /// The pattern.
    pub pattern: Pattern,
    /// The duty (inclusion probability).
    pub duty: f64,
    /// Mean truth per trial.
    pub truth: f64,
    /// Mean of (estimate - truth).
    pub mean_error: f64,
    /// Its standard error.
    pub standard_error: f64,
    /// Fraction of trials whose interval (time sampling included, widened for the
    /// pace's in-place hit cost) covered the truth.
    pub coverage: f64,
    /// The same without the pace's widening (the sampling errors only).
    pub sampling_coverage: f64,
    /// Fraction of trials whose byte-sampling-only interval covered the truth.
    pub byte_only_coverage: f64,
    /// Observed sd of the estimates / truth.
    pub relative_sd: f64,
}

/// Runs `trials` trials of `pattern` observed at duty `duty` and sampled at `rate`.
pub fn run(
    pattern: Pattern,
    duty: f64,
    rate: u64,
    trials: usize,
    seed: u64,
) -> TimeSamplingSummary {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut source = IntervalSource::new(rate, seed ^ 0x7173);
    let window = (duty * PERIOD as f64) as u64;
    let level = Confidence::DEFAULT;
    let mut errors = Vec::with_capacity(trials);
    let mut truths = Vec::with_capacity(trials);
    let mut covered = 0usize;
    let mut sampling_covered = 0usize;
    let mut byte_covered = 0usize;
    let mut process = Process::new(pattern);
    for _ in 0..trials {
        let (aggregate, truth) = simulate_trial(&mut process, &mut rng, &mut source, rate, window);
        let trial = judge_trial(&aggregate, &process, truth, duty, rate, level);
        sampling_covered += usize::from(trial.sampling_covered);
        covered += usize::from(trial.covered);
        byte_covered += usize::from(trial.byte_covered);
        errors.push(trial.estimate - truth);
        truths.push(truth);
    }
    let truth = mean(&truths);
    TimeSamplingSummary {
        pattern,
        duty,
        truth,
        mean_error: mean(&errors),
        standard_error: variance(&errors).sqrt() / (trials as f64).sqrt(),
        coverage: covered as f64 / trials as f64,
        sampling_coverage: sampling_covered as f64 / trials as f64,
        byte_only_coverage: byte_covered as f64 / trials as f64,
        relative_sd: variance(&errors).sqrt() / truth,
    }
}

/// A simulated process: what it allocates at each tick, and the state its pattern
/// keeps between ticks.
struct Process {
    pattern: Pattern,
    /// Bursty: in a burst (carried from one trial into the next).
    on: bool,
    /// CpuBound: ticks to its next allocation.
    work_left: u64,
    /// CpuBound: ticks of trap left.
    trap_left: u64,
    /// CpuBound: per state (out, in), wall ticks and trap ticks.
    spans: [(u64, u64); 2],
    /// A short job's life, in ticks since the interval's start.
    life: Range<u64>,
}

impl Process {
    /// A process of `pattern`, before its first trial.
    fn new(pattern: Pattern) -> Self {
        Process {
            pattern,
            on: false,
            work_left: 1,
            trap_left: 0,
            spans: [(0, 0); 2],
            life: 0..PERIODS * PERIOD,
        }
    }

    /// Starts a trial: its CPU-bound state afresh and, for a short job, its life drawn.
    fn start_trial(&mut self, rng: &mut ChaCha8Rng) {
        (self.work_left, self.trap_left) = (1, 0);
        self.spans = [(0, 0); 2];
        self.life = match self.pattern {
            Pattern::Short { life, .. } => {
                let start = rng.random_range(0..PERIODS * PERIOD - life);
                start..start + life
            }
            _ => 0..PERIODS * PERIOD,
        };
    }

    /// The bytes it allocates at tick `t` of the interval, if it allocates then
    /// (`in_window`: inside an observation window, where a CPU-bound one is slowed).
    fn allocation(&mut self, rng: &mut ChaCha8Rng, t: u64, in_window: bool) -> Option<u64> {
        match self.pattern {
            Pattern::Steady { size } => Some(size),
            Pattern::Bursty {
                size,
                mean_on,
                mean_off,
            } => {
                let flip = if self.on { mean_on } else { mean_off };
                if rng.random_range(0..flip) == 0 {
                    self.on = !self.on;
                }
                self.on.then_some(size)
            }
            Pattern::Short { size, life: length } => {
                if !self.life.contains(&t) {
                    return None;
                }
                // Bursts in fifths 0, 2 and 4 of its life.
                let fifth = (t - self.life.start) * 5 / length;
                if fifth % 2 == 1 {
                    return None;
                }
                Some(size)
            }
            Pattern::CpuBound {
                size, work, trap, ..
            } => {
                let span = &mut self.spans[usize::from(in_window)];
                span.0 += 1;
                if self.trap_left > 0 {
                    self.trap_left -= 1;
                    span.1 += 1;
                    return None;
                }
                self.work_left -= 1;
                if self.work_left > 0 {
                    return None;
                }
                self.work_left = work;
                if in_window {
                    self.trap_left = trap;
                }
                Some(size)
            }
        }
    }
}

/// One trial of `process`: every tick of the interval, its allocations inside a window
/// of `window` ticks a period (at a random phase) through the kernel's sampling
/// decision at `rate`, the samples into an aggregate. Returns it and the truth.
fn simulate_trial(
    process: &mut Process,
    rng: &mut ChaCha8Rng,
    source: &mut IntervalSource,
    rate: u64,
    window: u64,
) -> (Aggregate, f64) {
    let threshold = certain_threshold(rate);
    let mut aggregate = Aggregate::default();
    let mut countdown = source.next_interval();
    let mut truth = 0.0;
    process.start_trial(rng);
    for period in 0..PERIODS {
        let phase = rng.random_range(0..PERIOD);
        for tick in 0..PERIOD {
            // Circular window: every tick of the period is in with probability duty.
            let in_window = (tick + PERIOD - phase) % PERIOD < window;
            let Some(size) = process.allocation(rng, period * PERIOD + tick, in_window) else {
                continue;
            };
            truth += size as f64;
            if !in_window {
                continue;
            }
            let (offset, certain) =
                match decide(&mut countdown, size, threshold, || source.next_interval()) {
                    Decision::Skip => continue,
                    Decision::Sampled { offset, .. } => (offset, false),
                    Decision::Certain => (0, true),
                };
            let sample = SampledAllocation {
                sample_id: 0,
                size,
                offset,
                rate,
                certain,
                timestamp_ns: period * PERIOD + tick,
                window: Some(SampleWindow {
                    period,
                    inclusion: window as f64 / PERIOD as f64,
                }),
            };
            aggregate.add(
                StackKey {
                    pid: 1,
                    frames: Vec::new(),
                },
                &sample,
            );
        }
    }
    (aggregate, truth)
}

/// A trial's estimate, and whether each interval covered the truth.
struct Trial {
    /// The estimate of the whole interval (pace-corrected).
    estimate: f64,
    /// The interval with time sampling and the pace's widening.
    covered: bool,
    /// The same without the pace's widening.
    sampling_covered: bool,
    /// The byte-sampling-only interval.
    byte_covered: bool,
}

/// Estimates a trial's whole interval from its `aggregate`, as the report does (the
/// pace corrected, time sampling's interval where the process lived two periods or
/// more), and checks each interval against the `truth`.
fn judge_trial(
    aggregate: &Aggregate,
    process: &Process,
    truth: f64,
    duty: f64,
    rate: u64,
    level: Confidence,
) -> Trial {
    let life = &process.life;
    let pace = pace_of(process);
    let factor = pace.map_or(1.0, |pace| pace.factor);
    let estimate = aggregate.totals.estimated_bytes * factor;
    let mut totals = aggregate.periods.clone();
    totals.scale(factor);
    // The periods it lived in (the engine's first and last period of a process).
    let periods = life.start / PERIOD..=(life.end - 1) / PERIOD;
    let mut time = TimeSampling {
        observed_fraction: duty,
        periods,
        totals,
        probe_share: None,
        pace,
        paced_processes: u32::from(pace.is_some()),
        pace_slack: Default::default(),
    };
    let bytes = aggregate.totals.bytes_interval(rate, level);
    // Nothing sampled in its windows: the byte interval on nothing, scaled up by
    // the share of time observed (as the report does).
    let unseen = match aggregate.totals.observed_bytes <= 0.0 {
        true => 1.0 / duty,
        false => 1.0,
    };
    let bytes = allocbpf_profile::estimate::Interval {
        lo: bytes.lo * factor * unseen,
        hi: bytes.hi * factor * unseen,
    };
    // As `Report::total_interval`: time sampling's interval where a process lived
    // two periods or more, else byte sampling's.
    let sampling_only = time.interval(estimate, level).unwrap_or(bytes);
    if let Some(pace) = pace {
        time.pace_slack = pace.slack(estimate);
    }
    let interval = time
        .interval(estimate, level)
        .unwrap_or_else(|| time.widen(bytes));
    Trial {
        estimate,
        covered: interval.contains(truth),
        sampling_covered: sampling_only.contains(truth),
        byte_covered: bytes.contains(truth),
    }
}

/// The pace of a CPU-bound `process`, from its CPU ticks as the collector measures
/// them (CPU = wall: it never sleeps), with its traps at their calibrated cost.
fn pace_of(process: &Process) -> Option<PaceCorrection> {
    match process.pattern {
        Pattern::CpuBound {
            in_place_percent, ..
        } => {
            let mut tally = PaceTally::default();
            for (state, (wall, trap)) in [ProbeState::Unprobed, ProbeState::Probed]
                .into_iter()
                .zip(process.spans)
            {
                let wall = wall as f64 * TICK_NS;
                let calibrated = trap as f64 * TICK_NS * 100.0 / in_place_percent as f64;
                tally.add(state, wall, wall, calibrated);
            }
            tally.correction()
        }
        _ => None,
    }
}
