//! The finished profile every exporter reads: symbolized stacks with estimates, and the
//! exact totals the kernel counted.

use std::time::Duration;

use crate::aggregate::{Aggregate, LeakStats, LiveCounts, StackStats};
use crate::estimate::{
    pace::{PaceCorrection, PaceTally, MIN_TRAP_SHARE},
    windows::TimeSampling,
    Confidence, Interval, IntervalInputs,
};
use crate::frame::{Frame, Functions, Module, Symbolize};
use crate::timeline::Timeline;

pub use allocbpf_sampling::Counters;

/// A symbolized frame.
#[derive(Clone, Debug)]
pub struct Location {
    /// The normalized address.
    pub frame: Frame,
    /// Functions at that address, innermost first.
    pub functions: Functions,
}

/// One (process, stack) with its estimates.
#[derive(Clone, Debug)]
pub struct StackReport {
    /// Process id.
    pub pid: u32,
    /// Locations, innermost (the allocation's caller) first.
    pub locations: Vec<Location>,
    /// Raw samples, estimated bytes and objects.
    pub stats: StackStats,
}

impl StackReport {
    /// Function names, outermost first (inlined frames included).
    pub fn function_names(&self) -> Vec<&str> {
        names_of(&self.locations)
    }
}

/// The leak report: live blocks old enough to be suspects.
#[derive(Clone, Debug)]
pub struct Leaks {
    /// Live blocks at least this old are reported.
    pub min_age: Duration,
    /// One group per stack.
    pub groups: Vec<LeakReport>,
}

/// Sampled blocks of one stack still live and older than the minimum age.
#[derive(Clone, Debug)]
pub struct LeakReport {
    /// Process id.
    pub pid: u32,
    /// Locations, innermost first.
    pub locations: Vec<Location>,
    /// Estimated leaked bytes and objects, and the age range.
    pub stats: LeakStats,
}

impl LeakReport {
    /// Function names, outermost first (inlined frames included).
    pub fn function_names(&self) -> Vec<&str> {
        names_of(&self.locations)
    }
}

/// Function names of `locations` (innermost first), outermost first, inlined frames
/// included.
pub fn names_of(locations: &[Location]) -> Vec<&str> {
    locations
        .iter()
        .rev()
        .flat_map(|l| l.functions.iter().rev().map(|f| f.shown_name()))
        .collect()
}

fn locations_of(frames: &[Frame], symbolizer: &dyn Symbolize) -> Vec<Location> {
    frames
        .iter()
        .map(|frame| Location {
            frame: *frame,
            functions: symbolizer.functions(frame),
        })
        .collect()
}

/// What a report knows of one process besides its stacks.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProcessSummary {
    /// Its command name.
    pub name: String,
    /// Exact bytes it requested through the probed functions (0: not counted).
    pub exact_bytes: u64,
    /// Exact number of its probed calls.
    pub exact_calls: u64,
    /// The share of its time observed, under an overhead budget (`None`: full time).
    pub observed: Option<f64>,
}

/// One process's timeline, its peak's stacks symbolized.
#[derive(Clone, Debug)]
pub struct ProcessTimeline {
    /// Process id.
    pub pid: u32,
    /// Its command name, when it is not the report's for the pid (a store's, where
    /// a pid may have been reused).
    pub name: Option<String>,
    /// The timeline; times are nanoseconds since the report's start.
    pub timeline: Timeline<Vec<Location>>,
}

/// Exact figures counted in the kernel, and sampling health.
#[derive(Clone, Copy, Debug, Default)]
pub struct Totals {
    /// Exact bytes requested through the probed functions.
    pub exact_bytes: u64,
    /// Exact number of calls.
    pub exact_calls: u64,
    /// Sum of all sample weights.
    pub estimated_bytes: f64,
    /// Sum of all sample weights before time weighting (see [`StackStats::observed_bytes`]).
    pub observed_bytes: f64,
    /// Samples received.
    pub samples: u64,
    /// Samples lost (ring buffer full).
    pub drops: u64,
    /// What the interval on `estimated_bytes` needs.
    pub interval_inputs: IntervalInputs,
    /// Estimated bytes still live at the end (live tracking).
    pub inuse_bytes: f64,
    /// Estimated objects still live at the end (live tracking).
    pub inuse_objects: f64,
}

impl Totals {
    /// Adds estimates of one stack or one report: bytes (weighted, and before time
    /// weighting), samples, what their interval needs, and live bytes and objects.
    /// The exact counts and the drops are the caller's to add or not.
    pub fn add_estimates(
        &mut self,
        estimated_bytes: f64,
        observed_bytes: f64,
        samples: u64,
        interval_inputs: &IntervalInputs,
        (inuse_bytes, inuse_objects): (f64, f64),
    ) {
        self.estimated_bytes += estimated_bytes;
        self.observed_bytes += observed_bytes;
        self.samples += samples;
        self.interval_inputs.merge(interval_inputs);
        self.inuse_bytes += inuse_bytes;
        self.inuse_objects += inuse_objects;
    }
}

/// What the kernel side reported at the end of a session.
#[derive(Clone, Copy, Debug, Default)]
pub struct KernelFigures {
    /// How long profiling ran.
    pub duration: Duration,
    /// Exact totals of the profiled process.
    pub exact: allocbpf_common::Totals,
    /// Kernel counters.
    pub counters: Counters,
    /// Under time sampling: the expected fraction of the interval observed and the
    /// interval's periods (`None`: observed full time).
    pub observed: Option<Observed>,
}

/// How much of an interval a time-sampled profile observed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Observed {
    /// Expected fraction of the interval inside observation windows.
    pub fraction: f64,
    /// The interval's first period.
    pub first_period: u64,
    /// The interval's last period.
    pub last_period: u64,
    /// The process's pace while probed relative to unprobed (the observer effect,
    /// docs/statistics.md "Pace"), and the factor every estimate is scaled by. `None`:
    /// not measured (too little time or work to tell, or too few traps to matter),
    /// estimates as time weighting makes them.
    pub pace: Option<PaceCorrection>,
    /// The probes' share of the process's CPU while probed (measured, else the cost
    /// model's estimate), unfiltered: the report shows it from [`MIN_TRAP_SHARE`] on
    /// (the observer effect: docs/statistics.md, "Pace").
    pub probe_share: Option<f64>,
    /// The interval's pace tally: without a `pace` correction the estimate's upper
    /// slack is [`PaceTally::uncorrected_slack`] of it.
    pub tally: PaceTally,
}

/// A finished profile.
#[derive(Clone, Debug)]
pub struct Report {
    /// Mean sampling interval in bytes.
    pub rate: u64,
    /// Level of the confidence intervals shown.
    pub confidence: Confidence,
    /// How long profiling ran.
    pub duration: Duration,
    /// Exact and estimated totals.
    pub totals: Totals,
    /// Kernel counters.
    pub counters: Counters,
    /// Modules frames point into, indexed by [`Frame::Module::module`].
    pub modules: Vec<Module>,
    /// Stacks, largest estimated bytes first.
    pub stacks: Vec<StackReport>,
    /// Live-tracking counts, when blocks were tracked.
    pub live: Option<LiveCounts>,
    /// The leak report, when asked for.
    pub leaks: Option<Leaks>,
    /// False when not symbolized: frames carry module + offset only.
    pub symbolized: bool,
    /// Why nothing was counted, when no probed call was made in the window.
    pub note: Option<String>,
    /// Under time sampling (an overhead budget): the estimates are for the whole
    /// interval, the exact totals only for what the probes saw, and this says how much
    /// was observed and gives the total's interval with time sampling included.
    pub time_sampling: Option<TimeSampling>,
    /// Per process, what it allocated and held over time (when recorded).
    pub timelines: Vec<ProcessTimeline>,
    /// The processes profiled, by pid: names and exact totals, where known.
    pub processes: std::collections::BTreeMap<u32, ProcessSummary>,
}

impl Report {
    /// Symbolizes an aggregate into a report. `silence`: what its note says if the
    /// kernel counted no probed call (the one process of a process scope says why).
    pub fn build(
        aggregate: &Aggregate,
        symbolizer: &mut dyn Symbolize,
        rate: u64,
        confidence: Confidence,
        kernel: KernelFigures,
        silence: Option<&str>,
    ) -> Report {
        let KernelFigures {
            duration,
            exact,
            counters,
            observed,
        } = kernel;
        symbolizer.prepare(&mut aggregate.stacks().flat_map(|(k, _)| k.frames.iter()));
        let mut stacks: Vec<StackReport> = aggregate
            .stacks()
            .map(|(key, stats)| StackReport {
                pid: key.pid,
                locations: locations_of(&key.frames, symbolizer),
                stats: *stats,
            })
            .collect();
        stacks.sort_by(|a, b| b.stats.estimated_bytes.total_cmp(&a.stats.estimated_bytes));
        let leaks = aggregate.leak_min_age().map(|min_age| Leaks {
            min_age,
            groups: aggregate
                .leaks()
                .map(|(key, stats)| LeakReport {
                    pid: key.pid,
                    locations: locations_of(&key.frames, symbolizer),
                    stats: *stats,
                })
                .collect(),
        });
        let mut report = Report {
            rate,
            confidence,
            duration,
            totals: Totals {
                exact_bytes: exact.bytes,
                exact_calls: exact.calls,
                estimated_bytes: aggregate.totals.estimated_bytes,
                observed_bytes: aggregate.totals.observed_bytes,
                samples: aggregate.totals.samples,
                drops: counters.ring_buffer_drops,
                interval_inputs: aggregate.totals.interval_inputs,
                inuse_bytes: aggregate.totals.inuse_bytes,
                inuse_objects: aggregate.totals.inuse_objects,
            },
            counters,
            modules: symbolizer.modules(),
            stacks,
            live: aggregate.tracks_live().then_some(aggregate.live_counts),
            leaks,
            symbolized: symbolizer.symbolizes(),
            note: silence.filter(|_| exact.calls == 0).map(str::to_string),
            time_sampling: observed.map(|observed| TimeSampling {
                observed_fraction: observed.fraction,
                periods: observed.first_period..=observed.last_period,
                totals: aggregate.periods.clone(),
                probe_share: observed
                    .probe_share
                    .filter(|&share| share >= MIN_TRAP_SHARE),
                pace: observed.pace,
                paced_processes: u32::from(observed.pace.is_some()),
                pace_slack: Default::default(),
            }),
            timelines: Vec::new(),
            processes: Default::default(),
        };
        if let Some(pace) = observed.and_then(|o| o.pace) {
            report.scale_estimates(pace.factor);
        }
        // From the estimate as scaled: the slack is around what the report shows.
        let estimated = report.totals.estimated_bytes;
        if let (Some(observed), Some(time)) = (observed, report.time_sampling.as_mut()) {
            time.pace_slack = match observed.pace {
                Some(pace) => pace.slack(estimated),
                // Not corrected: its interval reaches as high as a CPU-bound process
                // slowed by its measured trap share would be.
                None => observed.tally.uncorrected_slack(estimated),
            };
        }
        report
    }

    /// Adds process `pid`'s timeline, recorded by `aggregate` (this report's), with
    /// times made relative to `origin_ns` (the report's start, CLOCK_MONOTONIC) and the
    /// peak's stacks symbolized by `symbolizer`; scaled like the report's estimates,
    /// and marked observed part time if the report observed part of its time.
    pub fn add_timeline(
        &mut self,
        pid: u32,
        timeline: Timeline<usize>,
        origin_ns: u64,
        aggregate: &Aggregate,
        symbolizer: &mut dyn Symbolize,
    ) {
        let mut timeline = timeline.map(origin_ns, |stack| {
            aggregate
                .stack_key(stack)
                .map(|key| locations_of(&key.frames, symbolizer))
                .unwrap_or_default()
        });
        if self
            .time_sampling
            .as_ref()
            .is_some_and(|t| t.observed_fraction < 1.0)
        {
            timeline.observed_part_time();
        }
        if let Some(factor) = self
            .time_sampling
            .as_ref()
            .and_then(|t| t.pace)
            .map(|pace| pace.factor)
        {
            timeline.scale(factor);
        }
        self.timelines.push(ProcessTimeline {
            pid,
            name: None,
            timeline,
        });
    }

    /// Multiplies every estimate (bytes, objects, in use, leaked, the per-period
    /// totals) by `factor`, leaving the exact totals, the samples and the observed
    /// byte weights (the byte-sampling intervals scale with the ratio of estimated to
    /// observed bytes, so they follow).
    fn scale_estimates(&mut self, factor: f64) {
        self.stacks.iter_mut().for_each(|s| s.stats.scale(factor));
        let totals = &mut self.totals;
        totals.estimated_bytes *= factor;
        totals.inuse_bytes *= factor;
        totals.inuse_objects *= factor;
        if let Some(leaks) = &mut self.leaks {
            for group in &mut leaks.groups {
                group.stats.estimated_bytes *= factor;
                group.stats.estimated_objects *= factor;
            }
        }
        if let Some(time) = &mut self.time_sampling {
            time.totals.scale(factor);
        }
    }

    /// A report of nothing: no profiled process allocated in `duration`, said in its
    /// note (`note`, else that no profiled process allocated), so every output format is
    /// still a valid, empty profile.
    pub fn empty(
        rate: u64,
        confidence: Confidence,
        duration: Duration,
        live: bool,
        note: Option<String>,
    ) -> Report {
        Report {
            rate,
            confidence,
            duration,
            totals: Totals::default(),
            counters: Counters::default(),
            modules: Vec::new(),
            stacks: Vec::new(),
            live: live.then(LiveCounts::default),
            leaks: None,
            symbolized: true,
            note: Some(note.unwrap_or_else(|| "no profiled process allocated anything".into())),
            time_sampling: None,
            timelines: Vec::new(),
            processes: Default::default(),
        }
    }

    /// One report of several processes' reports (system-wide mode), which share their
    /// module table: stacks side by side (each keeps its pid), totals summed. `None`
    /// for no reports.
    pub fn merge(reports: Vec<Report>) -> Option<Report> {
        let mut reports = reports.into_iter();
        let mut merged = reports.next()?;
        for report in reports {
            let totals = &mut merged.totals;
            totals.exact_bytes += report.totals.exact_bytes;
            totals.exact_calls += report.totals.exact_calls;
            let other = &report.totals;
            totals.add_estimates(
                other.estimated_bytes,
                other.observed_bytes,
                other.samples,
                &other.interval_inputs,
                (other.inuse_bytes, other.inuse_objects),
            );
            match (&mut merged.time_sampling, &report.time_sampling) {
                (Some(merged), Some(other)) => merged.merge(other),
                (None, Some(other)) => merged.time_sampling = Some(other.clone()),
                _ => {}
            }
            if report.modules.len() > merged.modules.len() {
                merged.modules = report.modules;
            }
            merged.stacks.extend(report.stacks);
            merged.timelines.extend(report.timelines);
            merged.processes.extend(report.processes);
            if let (Some(a), Some(b)) = (merged.live.as_mut(), report.live) {
                a.live_samples += b.live_samples;
                a.freed_samples += b.freed_samples;
                a.untracked_samples += b.untracked_samples;
                a.expired_samples += b.expired_samples;
            }
            if let (Some(a), Some(b)) = (merged.leaks.as_mut(), report.leaks) {
                a.groups.extend(b.groups);
            }
            merged.duration = merged.duration.max(report.duration);
        }
        merged
            .stacks
            .sort_by(|a, b| b.stats.estimated_bytes.total_cmp(&a.stats.estimated_bytes));
        Some(merged)
    }

    /// The interval on a stack's estimated bytes at the report's level.
    pub fn interval(&self, stats: &StackStats) -> Interval {
        stats.bytes_interval(self.rate, self.confidence)
    }

    /// The interval on the total estimated bytes at the report's level: with time
    /// sampling included when the profile is time-sampled over two periods or more,
    /// else byte sampling's (scaled up like a stack's when time-sampled).
    pub fn total_interval(&self) -> Interval {
        self.total_interval_at(self.confidence)
    }

    /// [`Report::total_interval`] at another level.
    pub fn total_interval_at(&self, confidence: Confidence) -> Interval {
        if let Some(interval) = self
            .time_sampling
            .as_ref()
            .and_then(|t| t.interval(self.totals.estimated_bytes, confidence))
        {
            return interval;
        }
        let interval = StackStats {
            estimated_bytes: self.totals.estimated_bytes,
            observed_bytes: self.totals.observed_bytes,
            interval_inputs: self.totals.interval_inputs,
            ..StackStats::default()
        }
        .bytes_interval(self.rate, confidence);
        match &self.time_sampling {
            // Nothing sampled in the windows: the byte interval on nothing, scaled up
            // by the share of time observed.
            Some(time) if self.totals.observed_bytes <= 0.0 && time.observed_fraction > 0.0 => {
                Interval {
                    lo: interval.lo / time.observed_fraction,
                    hi: interval.hi / time.observed_fraction,
                }
            }
            // Too few periods for time sampling's variance: byte sampling's, still
            // widened for the pace.
            Some(time) => time.widen(interval),
            None => interval,
        }
    }

    /// True if [`Report::total_interval`] includes the time sampling.
    pub fn total_interval_includes_time(&self) -> bool {
        self.time_sampling.as_ref().is_some_and(|t| {
            t.interval(self.totals.estimated_bytes, self.confidence)
                .is_some()
        })
    }

    /// Stacks merged by (pid, function names): what people read. Largest first.
    pub fn stacks_by_name(&self) -> Vec<(u32, Vec<&str>, StackStats)> {
        merge_by_name(
            self.stacks
                .iter()
                .map(|s| (s.pid, s.function_names(), s.stats)),
            StackStats::merge,
            |s| s.estimated_bytes,
        )
    }

    /// Leak groups merged by (pid, function names), most leaked bytes first; empty
    /// without a leak report.
    pub fn leaks_by_name(&self) -> Vec<(u32, Vec<&str>, LeakStats)> {
        merge_by_name(
            self.leaks
                .iter()
                .flat_map(|l| &l.groups)
                .map(|l| (l.pid, l.function_names(), l.stats)),
            LeakStats::merge,
            |l| l.estimated_bytes,
        )
    }
}

/// Merges entries with equal (pid, names), then sorts by `size`, largest first.
fn merge_by_name<'a, T: Copy>(
    entries: impl Iterator<Item = (u32, Vec<&'a str>, T)>,
    merge: fn(&mut T, &T),
    size: fn(&T) -> f64,
) -> Vec<(u32, Vec<&'a str>, T)> {
    let mut merged: Vec<(u32, Vec<&str>, T)> = Vec::new();
    let mut index: std::collections::HashMap<(u32, Vec<&str>), usize> =
        std::collections::HashMap::new();
    for (pid, names, stats) in entries {
        match index.get(&(pid, names.clone())) {
            Some(&i) => merge(&mut merged[i].2, &stats),
            None => {
                index.insert((pid, names.clone()), merged.len());
                merged.push((pid, names, stats));
            }
        }
    }
    merged.sort_by(|a, b| size(&b.2).total_cmp(&size(&a.2)));
    merged
}

#[cfg(test)]
mod tests;
