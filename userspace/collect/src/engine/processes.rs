//! The process table: every process the engine follows, with its identity, whether the
//! scope admits it, its aggregate for the current interval and the files it maps.

use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

use allocbpf_probe::image::ImageKey;
use allocbpf_profile::aggregate::Aggregate;

use crate::{
    budget::pace::PaceMeter,
    process::{BuildIdCache, ProcessInfo},
};

/// One followed process.
pub(crate) struct Tracked {
    /// Its identity and labels.
    pub info: ProcessInfo,
    /// Whether the scope profiles it (samples of others are dropped).
    pub admitted: bool,
    /// Its samples of the current interval (and, with live tracking, its live blocks).
    pub aggregate: Aggregate,
    /// Exited (or found dead): its next profile is its last.
    pub exited: bool,
    /// Allocator images this process maps (where its samples come from: the budget's
    /// windows and costs).
    pub images: Vec<ImageKey>,
    /// Every executable file it mapped when last examined (and images found mapped
    /// since): what keeps cached facts and attached images alive (`release.rs`).
    pub mapped: Vec<ImageKey>,
    /// Under an overhead budget: how much of the current interval it was observed.
    pub observed: ObservedTime,
    /// Under an overhead budget: its pace with probes in and out (the observer effect).
    pub pace: PaceMeter,
    /// Sample ids of live blocks no longer followed (their window closed), whose
    /// kernel entries go at the next cut.
    pub expired_blocks: Vec<u64>,
}

/// Under an overhead budget: the expected share of the current interval a process was
/// observed, summed at each budget check.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ObservedTime {
    /// Expected observed time (inclusion probability times elapsed), ns.
    observed_ns: f64,
    /// Time followed, ns.
    lived_ns: u64,
    /// The first period it was followed in during the interval.
    pub first_period: Option<u64>,
}

impl ObservedTime {
    /// `elapsed_ns` more, observed with probability `inclusion`, starting in `period`.
    pub fn add(&mut self, inclusion: f64, elapsed_ns: u64, period: u64) {
        self.observed_ns += inclusion * elapsed_ns as f64;
        self.lived_ns += elapsed_ns;
        self.first_period.get_or_insert(period);
    }

    /// The expected fraction observed (1 before any check).
    pub fn fraction(&self) -> f64 {
        if self.lived_ns == 0 {
            return 1.0;
        }
        self.observed_ns / self.lived_ns as f64
    }
}

/// How long the samples of a process whose identity could not be read are dropped
/// before it is looked at again (a sample at a time: not once per sample).
pub(crate) const UNREADABLE_RETRY: Duration = Duration::from_secs(1);

/// Processes whose identity could not be read, remembered at most (older ones are
/// forgotten past it).
const MAX_UNREADABLE: usize = 65_536;

/// Followed processes, and the pids to leave alone or to clean up after.
#[derive(Default)]
pub(crate) struct ProcessTable {
    /// Followed processes by pid.
    pub tracked: HashMap<u32, Tracked>,
    /// Processes that exited without ever being tracked (no sample: cron jobs,
    /// scripts): their kernel entries (fallback totals, gates, live blocks) are
    /// removed at the next cut, so bounded maps hold running processes only and a
    /// reused pid starts clean. Bounded by the host's pid space.
    pub untracked_exits: HashSet<u32>,
    /// Never profiled: allocbpf itself and its calibration children.
    pub ignored: HashSet<u32>,
    /// Processes whose identity could not be read (gone, or hidden from us), and
    /// when: their samples are dropped without reading `/proc` again for each, for
    /// [`UNREADABLE_RETRY`] or until they exec or exit ([`ProcessTable::unreadable`]).
    pub unreadable_at: HashMap<u32, Instant>,
    /// Build ids of the executables seen.
    pub build_ids: BuildIdCache,
}

impl ProcessTable {
    /// A table that ignores `me`.
    pub fn ignoring(me: u32) -> ProcessTable {
        ProcessTable {
            ignored: HashSet::from([me]),
            ..ProcessTable::default()
        }
    }

    /// Records `info` for its pid: updates a followed process, or starts following a
    /// new one (returns true then).
    pub fn update(&mut self, info: ProcessInfo, admitted: bool, live: bool) -> bool {
        match self.tracked.get_mut(&info.pid) {
            Some(tracked) => {
                tracked.info = info;
                tracked.admitted = admitted;
                false
            }
            None => {
                self.tracked.insert(
                    info.pid,
                    Tracked {
                        info,
                        admitted,
                        aggregate: if live {
                            Aggregate::with_live_tracking()
                        } else {
                            Aggregate::default()
                        },
                        exited: false,
                        images: Vec::new(),
                        mapped: Vec::new(),
                        observed: ObservedTime::default(),
                        pace: PaceMeter::default(),
                        expired_blocks: Vec::new(),
                    },
                );
                true
            }
        }
    }

    /// Whether `pid`'s identity could not be read less than [`UNREADABLE_RETRY`] ago
    /// (and it has not exec'd or exited since).
    pub fn unreadable(&self, pid: u32) -> bool {
        self.unreadable_at
            .get(&pid)
            .is_some_and(|at| at.elapsed() < UNREADABLE_RETRY)
    }

    /// `pid`'s identity could not be read now (`readable` false), or could.
    pub fn set_readable(&mut self, pid: u32, readable: bool) {
        if readable {
            self.unreadable_at.remove(&pid);
            return;
        }
        let now = Instant::now();
        if self.unreadable_at.len() >= MAX_UNREADABLE {
            self.unreadable_at
                .retain(|_, at| now.duration_since(*at) < UNREADABLE_RETRY);
        }
        self.unreadable_at.insert(pid, now);
    }

    /// `pid` exited: its next profile is its last, or (never followed) its kernel
    /// entries go at the next cut.
    pub fn exited(&mut self, pid: u32) {
        self.unreadable_at.remove(&pid);
        match self.tracked.get_mut(&pid) {
            Some(tracked) => tracked.exited = true,
            None => {
                self.untracked_exits.insert(pid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process whose identity cannot be read is not read again for each sample, but
    /// again after a while, or at once after its exec or exit.
    #[test]
    fn unreadable_processes_are_not_read_for_every_sample() {
        let mut table = ProcessTable::ignoring(1);
        assert!(!table.unreadable(42));
        table.set_readable(42, false);
        assert!(table.unreadable(42));
        table.set_readable(42, true);
        assert!(!table.unreadable(42));
        table.set_readable(42, false);
        table.exited(42);
        assert!(!table.unreadable(42));
        table.set_readable(42, false);
        *table.unreadable_at.get_mut(&42).unwrap() -= UNREADABLE_RETRY;
        assert!(!table.unreadable(42));
    }
}
