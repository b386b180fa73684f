//! The process table: every process the engine follows, with its identity, whether the
//! scope admits it, its aggregate for the current interval and the files it maps.

use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

use allocbpf_images::image::ImageKey;
use allocbpf_profile::aggregate::Aggregate;

use crate::{
    budget::{agent_cost::AgentCost, pace::PaceMeter},
    identity::{BuildIdCache, ProcessInfo},
    kernel::LinkSet,
};

/// One followed process.
pub(crate) struct Tracked {
    /// Its identity and labels.
    pub info: ProcessInfo,
    /// Whether the scope profiles it (samples of others are dropped).
    pub admitted: bool,
    /// Its samples of the current interval (and, with live tracking, its live blocks).
    pub aggregate: Aggregate,
    /// Exited (or found dead, or replaced by a later process with its pid): its next
    /// profile is its last.
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
    /// Under an overhead budget: its own full-time links, while it is light and shares
    /// an image probed part time for a heavier process.
    pub own: OwnLinks,
    /// The agent's CPU for its samples: charged to its budget at a steady per-sample
    /// cost.
    pub agent: AgentCost,
    /// When its thread count was last read (CLOCK_MONOTONIC ns; 0: never): the pace
    /// correction's capacity, re-read every [`THREADS_REREAD_NS`] at most.
    pub threads_read_ns: u64,
}

/// How often a process's thread count is re-read for its pace correction. Threads come
/// and go far slower than the budget's checks, and on a host of hundreds of processes a
/// `/proc/PID/stat` read at every check was the largest share of the agent's CPU
/// (docs/benchmarks.md, "issue 49"); a capacity is the most threads seen, so a late
/// thread is counted within this delay.
pub(crate) const THREADS_REREAD_NS: u64 = 5_000_000_000;

/// A light process's own links: probes filtered on it, attached full time on the
/// images it maps while the overhead budget probes them part time for a heavier
/// process (docs/design.md, "Overhead budget"). Its gate (`GateState::OwnLinks`) makes
/// them the links that count for it.
#[derive(Debug, Default)]
pub(crate) struct OwnLinks {
    /// The links, one set per image (none: observed through the shared windows).
    pub links: Vec<LinkSet>,
    /// Since when its gate counts them (CLOCK_MONOTONIC ns): its samples from then
    /// on were taken full time.
    pub since_ns: Option<u64>,
    /// The last span it was observed through them, once they went: for its samples
    /// of that span read after.
    pub last_span: Option<(u64, u64)>,
}

impl OwnLinks {
    /// True if its own links counted for it at `t_ns`.
    pub fn covers(&self, t_ns: u64) -> bool {
        self.since_ns.is_some_and(|since| since <= t_ns)
            || self
                .last_span
                .is_some_and(|(from, to)| from <= t_ns && t_ns < to)
    }

    /// True if it has own links now.
    pub fn attached(&self) -> bool {
        !self.links.is_empty()
    }
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
    /// Followed processes by pid: the processes running now (as far as we know).
    pub tracked: HashMap<u32, Tracked>,
    /// Followed processes that exited in the current interval (or were found replaced
    /// by a later process with their pid), moved out of `tracked`, by pid, in the order
    /// they left: the next cut makes their last profiles and empties this. A later
    /// process with the same pid gets an entry of its own in `tracked`, and its
    /// samples are never added to theirs ([`ProcessTable::sample_owner`]).
    pub departed: HashMap<u32, Vec<Tracked>>,
    /// Processes that exited since the last cut, followed or not (those never tracked
    /// had no sample: cron jobs, scripts): their kernel entries (fallback totals,
    /// gates, live blocks) are removed at the next cut unless a later process with
    /// the pid is followed by then, so bounded maps hold running processes only and a
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
    /// Memory maps the engine read of processes that were cut at their size cap.
    pub maps_cut: u64,
    /// New entries record their timeline.
    pub record_timelines: bool,
}

/// What [`ProcessTable::update`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Followed {
    /// The process was followed already: its identity and verdict were updated.
    Known,
    /// A process not followed before.
    New,
    /// A process not followed before whose pid an earlier process had in this
    /// interval (exited, or replaced now: its exit event was lost): what is cached
    /// about that pid (stacks, maps) is the earlier one's.
    Reused,
}

/// Which entry a sample belongs to ([`ProcessTable::sample_owner`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Owner {
    /// The followed process with its pid.
    Tracked,
    /// The last process that exited with its pid (`departed`).
    Departed,
    /// None yet: a process to look at.
    Unknown,
}

impl ProcessTable {
    /// A table that ignores `me`.
    pub fn ignoring(me: u32) -> ProcessTable {
        ProcessTable {
            ignored: HashSet::from([me]),
            ..ProcessTable::default()
        }
    }

    /// Records `info` for its pid: updates a followed process (the same pid and start
    /// time: an exec relabels it), or starts following a new one. A followed process
    /// with the pid and another start time exited (its exit event was lost): its
    /// entry departs, and the new one gets its own.
    pub fn update(&mut self, info: ProcessInfo, admitted: bool, live: bool) -> Followed {
        let pid = info.pid;
        if let Some(tracked) = self.tracked.get_mut(&pid) {
            let same = match (tracked.info.start_time, info.start_time) {
                (Some(before), Some(now)) => before == now,
                // Unknown (a target whose identity could not be read): its pid.
                _ => true,
            };
            if same {
                // What the engine learnt (not procfs) stays until an exec clears it.
                let runtimes = std::mem::take(&mut tracked.info.runtimes);
                tracked.info = ProcessInfo {
                    runtimes: match info.runtimes.is_empty() {
                        true => runtimes,
                        false => info.runtimes,
                    },
                    ..info
                };
                tracked.admitted = admitted;
                return Followed::Known;
            }
            self.depart(pid);
        }
        let reused = self.departed.contains_key(&pid);
        let mut aggregate = if live {
            Aggregate::with_live_tracking()
        } else {
            Aggregate::default()
        };
        if self.record_timelines {
            aggregate.record_timeline();
        }
        self.tracked.insert(
            pid,
            Tracked {
                info,
                admitted,
                aggregate,
                exited: false,
                images: Vec::new(),
                mapped: Vec::new(),
                observed: ObservedTime::default(),
                pace: PaceMeter::default(),
                expired_blocks: Vec::new(),
                own: OwnLinks::default(),
                agent: AgentCost::default(),
                threads_read_ns: 0,
            },
        );
        match reused {
            true => Followed::Reused,
            false => Followed::New,
        }
    }

    /// Moves `pid`'s entry out of `tracked` into `departed`, marked exited; false if
    /// it had none.
    fn depart(&mut self, pid: u32) -> bool {
        let Some(mut tracked) = self.tracked.remove(&pid) else {
            return false;
        };
        tracked.exited = true;
        self.departed.entry(pid).or_default().push(tracked);
        true
    }

    /// Whose a sample of `pid` is. The followed process's, if there is one: a process
    /// with the pid of one that departed is followed from its first sample, so this
    /// reads nothing for the samples of followed processes (a lost exit event leaves
    /// a later process's samples in the earlier one's entry until its exec or the
    /// cut). Else the last departed process with that pid if the sample is its own:
    /// `pid` is gone (samples its threads sent as it exited) or is still the process
    /// that started then (threads that outlive its main thread); a process that
    /// started since is a new one (`Unknown`). `start_time` reads a pid's start time
    /// ([`crate::identity::start_time`]), only then.
    pub fn sample_owner(&self, pid: u32, start_time: impl FnOnce(u32) -> Option<u64>) -> Owner {
        if self.tracked.contains_key(&pid) {
            return Owner::Tracked;
        }
        let Some(departed) = self.departed.get(&pid).and_then(|list| list.last()) else {
            return Owner::Unknown;
        };
        match start_time(pid) {
            None => Owner::Departed,
            Some(now) if departed.info.start_time == Some(now) => Owner::Departed,
            Some(_) => Owner::Unknown,
        }
    }

    /// The entry of `pid` that `owner` names (none for [`Owner::Unknown`]).
    pub fn entry(&mut self, pid: u32, owner: Owner) -> Option<&mut Tracked> {
        match owner {
            Owner::Tracked => self.tracked.get_mut(&pid),
            Owner::Departed => self.departed.get_mut(&pid)?.last_mut(),
            Owner::Unknown => None,
        }
    }

    /// Every entry with `pid`, followed or departed (a block's `Freed` event goes to
    /// the one that holds its sample id).
    pub fn entries_of(&mut self, pid: u32) -> impl Iterator<Item = &mut Tracked> {
        let departed = self.departed.get_mut(&pid).into_iter().flatten();
        self.tracked.get_mut(&pid).into_iter().chain(departed)
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

    /// `pid` exited: its entry departs (its next profile is its last, and a later
    /// process with its pid gets an entry of its own), and its kernel entries go at
    /// the next cut. True if it was followed.
    pub fn exited(&mut self, pid: u32) -> bool {
        self.unreadable_at.remove(&pid);
        self.untracked_exits.insert(pid);
        self.depart(pid)
    }
}

#[cfg(test)]
mod tests {
    use allocbpf_profile::{
        aggregate::{SampledAllocation, StackKey},
        frame::Frame,
    };

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

    fn process(pid: u32, start_time: u64, comm: &str) -> ProcessInfo {
        ProcessInfo {
            pid,
            start_time: Some(start_time),
            comm: comm.into(),
            ..ProcessInfo::default()
        }
    }

    /// One sample of `pid` (sample id `id`), in the entry its owner names.
    fn sample(table: &mut ProcessTable, pid: u32, owner: Owner, id: u64) {
        let allocation = SampledAllocation {
            sample_id: id,
            size: 64,
            offset: 0,
            rate: 1,
            certain: true,
            timestamp_ns: 1,
            window: None,
        };
        let key = StackKey {
            pid,
            frames: vec![Frame::Unknown(id)],
        };
        table
            .entry(pid, owner)
            .expect("an entry")
            .aggregate
            .add(key, &allocation);
    }

    fn samples(tracked: &Tracked) -> u64 {
        tracked.aggregate.totals.samples
    }

    /// A pid reused after an exit: the later process gets an entry of its own, the
    /// earlier one keeps its samples and labels until the cut, and a sample goes to
    /// the earlier one only if it is still that process (same start time) or gone.
    #[test]
    fn a_reused_pid_is_another_process() {
        let mut table = ProcessTable::ignoring(1);
        assert_eq!(
            table.update(process(42, 100, "old"), true, true),
            Followed::New
        );
        let never = |_: u32| -> Option<u64> { panic!("a followed pid is not read") };
        assert_eq!(table.sample_owner(42, never), Owner::Tracked);
        sample(&mut table, 42, Owner::Tracked, 1);
        // An exec relabels the same process (same start time).
        assert_eq!(
            table.update(process(42, 100, "old2"), true, true),
            Followed::Known
        );

        assert!(table.exited(42));
        assert!(!table.tracked.contains_key(&42));
        assert!(table.untracked_exits.contains(&42));
        // Its own late samples: gone, or still running (threads outliving its main
        // thread).
        assert_eq!(table.sample_owner(42, |_| None), Owner::Departed);
        assert_eq!(table.sample_owner(42, |_| Some(100)), Owner::Departed);
        sample(&mut table, 42, Owner::Departed, 2);
        // A later process with its pid: looked at, then followed on its own.
        assert_eq!(table.sample_owner(42, |_| Some(200)), Owner::Unknown);
        assert_eq!(
            table.update(process(42, 200, "new"), false, true),
            Followed::Reused
        );
        assert_eq!(table.sample_owner(42, never), Owner::Tracked);
        sample(&mut table, 42, Owner::Tracked, 3);

        let new = &table.tracked[&42];
        assert_eq!(
            (new.info.comm.to_str(), new.exited, new.admitted),
            (Some("new"), false, false)
        );
        assert_eq!(samples(new), 1);
        let old = &table.departed[&42];
        assert_eq!(old.len(), 1);
        assert_eq!(
            (old[0].info.comm.to_str(), old[0].exited, old[0].admitted),
            (Some("old2"), true, true)
        );
        assert_eq!(samples(&old[0]), 2);

        // A block's Freed event finds the entry that holds its sample.
        for tracked in table.entries_of(42) {
            tracked.aggregate.freed(2);
        }
        assert_eq!(
            table.departed[&42][0].aggregate.live_counts.freed_samples,
            1
        );
        assert_eq!(table.tracked[&42].aggregate.live_counts.freed_samples, 0);

        // The later one exits too: both wait for the cut, in order.
        assert!(table.exited(42));
        assert_eq!(table.sample_owner(42, |_| Some(200)), Owner::Departed);
        assert_eq!(table.sample_owner(42, |_| Some(100)), Owner::Unknown);
        let comms: Vec<_> = table.departed[&42]
            .iter()
            .map(|t| t.info.comm.clone())
            .collect();
        assert_eq!(comms, ["old2", "new"]);
        // Never followed: nothing departs, the kernel entries still go.
        assert!(!table.exited(7));
        assert!(table.untracked_exits.contains(&7));
        assert_eq!(table.sample_owner(7, |_| None), Owner::Unknown);
    }

    /// A lost exit event: a later process seen with the pid (at its exec's look) takes
    /// over, and the earlier entry departs with what it collected.
    #[test]
    fn a_later_start_time_replaces_a_process_whose_exit_was_lost() {
        let mut table = ProcessTable::ignoring(1);
        assert_eq!(
            table.update(process(9, 5, "old"), true, false),
            Followed::New
        );
        sample(&mut table, 9, Owner::Tracked, 1);
        assert_eq!(
            table.update(process(9, 6, "new"), true, false),
            Followed::Reused
        );
        assert_eq!(samples(&table.tracked[&9]), 0);
        assert!(!table.tracked[&9].exited);
        let old = &table.departed[&9][0];
        assert!(old.exited);
        assert_eq!((old.info.comm.to_str(), samples(old)), (Some("old"), 1));
        // Unknown start time (a target whose identity could not be read): its pid.
        let unknown = ProcessInfo {
            start_time: None,
            ..process(9, 0, "x")
        };
        assert_eq!(table.update(unknown, true, false), Followed::Known);
    }
}
