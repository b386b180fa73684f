//! The interval cutter: where one interval ends and the next starts, and which records
//! read during a cut belong to which.
//!
//! One window without stopping the probes (docs/statistics.md, "One window"): a new
//! epoch starts, running programs are waited for, then the ended epoch's totals,
//! counters and samples are exactly the interval's; samples of the new epoch read
//! meanwhile are held for the next interval.

use std::time::{Duration, Instant, SystemTime};

use allocbpf_probe::{events::Event, sampler::monotonic_now_ns};
use allocbpf_profile::report::Report;

use crate::identity::ProcessInfo;

/// One process's profile for one interval.
#[derive(Clone, Debug)]
pub struct ProcessProfile {
    /// The process and its labels.
    pub info: ProcessInfo,
    /// Its profile.
    pub report: Report,
    /// Start of the interval (wall clock).
    pub started: SystemTime,
    /// End of the interval.
    pub ended: SystemTime,
    /// True if the process exited during the interval (its last profile).
    pub exited: bool,
}

/// When an interval ended, on each clock that needs it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct IntervalEnd {
    /// Wall clock (the profile's end time).
    pub wall: SystemTime,
    /// Monotonic clock (the next interval's start).
    pub instant: Instant,
    /// How long the interval lasted.
    pub duration: Duration,
    /// CLOCK_MONOTONIC, the samples' clock (the age of live blocks).
    pub monotonic_ns: u64,
}

/// The current interval's start, and the records held during a cut.
pub(crate) struct IntervalCutter {
    /// Start of the interval (wall clock).
    pub started: SystemTime,
    started_at: Instant,
    /// During a cut: the epoch that ended.
    cutting: Option<u64>,
    /// Records of the next interval read during a cut, in order.
    held: Vec<Event>,
}

impl IntervalCutter {
    /// An interval starting now.
    pub fn new() -> Self {
        Self {
            started: SystemTime::now(),
            started_at: Instant::now(),
            cutting: None,
            held: Vec::new(),
        }
    }

    /// The current interval, were it to end now.
    pub fn end_now(&self) -> IntervalEnd {
        let instant = Instant::now();
        IntervalEnd {
            wall: SystemTime::now(),
            instant,
            duration: instant.duration_since(self.started_at),
            monotonic_ns: monotonic_now_ns(),
        }
    }

    /// Starts the next interval where the last one ended: intervals are contiguous.
    pub fn restart(&mut self, end: IntervalEnd) {
        self.started = end.wall;
        self.started_at = end.instant;
    }

    /// A cut of `ended` begins: records of later epochs are held from now on.
    pub fn begin(&mut self, ended: u64) {
        self.cutting = Some(ended);
    }

    /// The cut is over: the records held for the next interval.
    pub fn end(&mut self) -> Vec<Event> {
        self.cutting = None;
        std::mem::take(&mut self.held)
    }

    /// During a cut, a sample of the new epoch and every event after it (but exec
    /// events) wait for the next interval, in order: a block's `Freed` must not be
    /// handled before its held sample, or the block would stay live, nor a process's
    /// exit (its profile would end without the sample). Returns the event if it is not
    /// held.
    pub fn hold(&mut self, event: Event) -> Option<Event> {
        let Some(ended) = self.cutting else {
            return Some(event);
        };
        let held = match &event {
            Event::Sample(sample) => !self.held.is_empty() || sample.epoch != ended as u32,
            // An exit after a held sample waits too: a held sample of the exiting
            // process must find its entry, not a later process's with its pid.
            Event::Freed { .. } | Event::Untracked { .. } | Event::Exit { .. } => {
                !self.held.is_empty()
            }
            Event::Exec { .. } => false,
        };
        if held {
            self.held.push(event);
            None
        } else {
            Some(event)
        }
    }
}

#[cfg(test)]
mod tests {
    use allocbpf_probe::events::RawSample;

    use super::*;

    fn sample(pid: u32, epoch: u32) -> Event {
        Event::Sample(RawSample {
            sample_id: 1,
            pid,
            tid: pid,
            epoch,
            timestamp_ns: 1,
            size: 64,
            rate: 1,
            next_interval: 1,
            certain: true,
            ..RawSample::default()
        })
    }

    /// During a cut, an exit after a held sample is held with it (the sample must
    /// find its process's entry); an exit before any is not, nor an exec.
    #[test]
    fn an_exit_after_a_held_sample_is_held() {
        let mut cutter = IntervalCutter::new();
        cutter.begin(5);
        assert!(cutter.hold(sample(42, 5)).is_some());
        assert!(cutter.hold(Event::Exit { pid: 7 }).is_some());
        assert!(cutter.hold(sample(42, 6)).is_none());
        assert!(cutter.hold(Event::Exit { pid: 42 }).is_none());
        assert!(cutter.hold(Event::Exec { pid: 9 }).is_some());
        assert_eq!(cutter.end(), [sample(42, 6), Event::Exit { pid: 42 }]);
        assert!(cutter.hold(Event::Exit { pid: 42 }).is_some());
    }
}
