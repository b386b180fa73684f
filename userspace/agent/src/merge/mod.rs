//! Merging the profiles the agent stored into one report.
//!
//! Each stored profile is decoded (gzipped pprof), filtered by age and command name,
//! and turned back into stacks ([`pprof::read`]): frames become locations named by
//! their functions, and each stack keeps its raw sample count and confidence-interval
//! inputs (numeric labels the agent writes), so the merged report's intervals are
//! exact, not summed. Here they are only merged.

use std::{
    collections::{BTreeMap, HashMap},
    path::Path,
    time::{Duration, SystemTime},
};

use regex::Regex;

use super::store::{age, list, StoreError};
use timelines::StoredTimelines;

mod timelines;
use allocbpf_collect::error::error_chain;
use allocbpf_export::pprof::{self, decode_path, ProfileMeta, ReadProfile};
use allocbpf_profile::aggregate::LiveCounts;
use allocbpf_profile::estimate::Confidence;
use allocbpf_profile::frame::{Frame, FunctionFrame};
use allocbpf_profile::report::{Location, ProcessSummary, Report, StackReport, Totals};

/// Merges the profiles stored under `store` that ended at most `since` ago and whose
/// process's command name matches `comm` into one report; also returns how many were
/// merged. Files that do not decode are skipped, each told to `skipped` with why.
pub fn merge_store(
    store: &Path,
    since: Option<Duration>,
    comm: Option<&Regex>,
    mut skipped: impl FnMut(&Path, &str),
) -> Result<(Report, usize), StoreError> {
    let now = SystemTime::now();
    let mut merger = Merger::default();
    let mut read = 0;
    for stored in list(store)? {
        if since.is_some_and(|since| age(&stored, now) > since) {
            continue;
        }
        let (profile, meta) = match decode_path(&stored.path) {
            Ok(decoded) => decoded,
            Err(error) => {
                skipped(&stored.path, &error_chain(&error));
                continue;
            }
        };
        let profile_comm = meta
            .label("comm")
            .map(str::to_string)
            .unwrap_or_else(|| stored.comm.clone());
        if comm.is_some_and(|re| !re.is_match(&profile_comm)) {
            continue;
        }
        merger.add(&pprof::read(&profile), &meta, &profile_comm);
        read += 1;
    }
    Ok((merger.finish(), read))
}

/// Accumulates stored profiles into one report.
#[derive(Default)]
struct Merger {
    stacks: Vec<StackReport>,
    /// Some profile was time-sampled (an overhead budget): said in the merged note.
    time_sampled: bool,
    /// Locations by their function chain, so equal frames share one `Frame`.
    locations: HashMap<Vec<FunctionFrame>, Location>,
    rate: u64,
    live: bool,
    exact_bytes: u64,
    exact_calls: u64,
    first_ns: Option<i64>,
    last_ns: i64,
    /// Stacks of each process's latest profile: in-use bytes are a snapshot, so only
    /// the latest counts (profiles arrive oldest first).
    latest: HashMap<u32, Vec<usize>>,
    /// Per process, a point per stored profile, and its peak.
    timelines: StoredTimelines,
    processes: BTreeMap<u32, ProcessSummary>,
    /// Per process: observed time (each profile's duration times its observed share)
    /// and time, in nanoseconds.
    observed: BTreeMap<u32, (f64, f64)>,
}

impl Merger {
    fn add(&mut self, profile: &ReadProfile, meta: &ProfileMeta, comm: &str) {
        self.live |= profile.live;
        self.rate = self.rate.max(profile.rate);
        self.exact_bytes += meta.exact_bytes.unwrap_or(0);
        self.exact_calls += meta.exact_calls.unwrap_or(0);
        self.first_ns = Some(
            self.first_ns
                .map_or(profile.time_nanos, |t| t.min(profile.time_nanos)),
        );
        self.last_ns = self
            .last_ns
            .max(profile.time_nanos + profile.duration_nanos);

        let mut this_profile: Vec<usize> = Vec::new();
        let mut pid_of_profile = None;
        for sample in &profile.samples {
            self.time_sampled |= sample.time_sampled;
            let locations = sample
                .locations
                .iter()
                .map(|chain| self.location(chain))
                .collect();
            pid_of_profile = Some(sample.pid);
            this_profile.push(self.stacks.len());
            self.stacks.push(StackReport {
                pid: sample.pid,
                locations,
                stats: sample.stats,
            });
        }
        if let Some(pid) = pid_of_profile {
            let first = this_profile.first().copied().unwrap_or(0);
            self.timelines.add(
                pid,
                comm,
                (
                    profile.time_nanos,
                    profile.time_nanos + profile.duration_nanos,
                ),
                &self.stacks[first..],
                profile.samples.iter().any(|s| s.time_sampled),
            );
            let summary = self.processes.entry(pid).or_default();
            summary.name = comm.to_string();
            summary.exact_bytes += meta.exact_bytes.unwrap_or(0);
            summary.exact_calls += meta.exact_calls.unwrap_or(0);
            // The share observed over all its profiles: weighted by their durations.
            let observed = self.observed.entry(pid).or_default();
            let duration = profile.duration_nanos.max(0) as f64;
            observed.0 += meta.observed_fraction().unwrap_or(1.0) * duration;
            observed.1 += duration;
            for old in self.latest.insert(pid, this_profile).unwrap_or_default() {
                self.stacks[old].stats.inuse_bytes = 0.0;
                self.stacks[old].stats.inuse_objects = 0.0;
            }
        }
    }

    /// The location of a function chain: one `Frame` per distinct chain, numbered in
    /// the order they are first seen.
    fn location(&mut self, chain: &[FunctionFrame]) -> Location {
        let next = self.locations.len() as u64;
        self.locations
            .entry(chain.to_vec())
            .or_insert_with(|| Location {
                frame: Frame::Unknown(next),
                functions: chain.into(),
            })
            .clone()
    }

    fn finish(mut self) -> Report {
        for (pid, (observed, total)) in &self.observed {
            let share = if *total > 0.0 { observed / total } else { 1.0 };
            if let Some(summary) = self.processes.get_mut(pid) {
                summary.observed = (share < 1.0).then_some(share);
            }
        }
        let mut totals = Totals {
            exact_bytes: self.exact_bytes,
            exact_calls: self.exact_calls,
            ..Totals::default()
        };
        for stack in &self.stacks {
            let stats = &stack.stats;
            totals.add_estimates(
                stats.estimated_bytes,
                stats.observed_bytes,
                stats.samples,
                &stats.interval_inputs,
                (stats.inuse_bytes, stats.inuse_objects),
            );
        }
        self.stacks
            .sort_by(|a, b| b.stats.estimated_bytes.total_cmp(&a.stats.estimated_bytes));
        let span = self.last_ns - self.first_ns.unwrap_or(self.last_ns);
        let timelines =
            std::mem::take(&mut self.timelines).finish(self.first_ns.unwrap_or(0), self.live);
        Report {
            rate: self.rate.max(1),
            confidence: Confidence::DEFAULT,
            duration: std::time::Duration::from_nanos(span.max(0) as u64),
            totals,
            counters: Default::default(),
            modules: Vec::new(),
            stacks: self.stacks,
            live: self.live.then(LiveCounts::default),
            leaks: None,
            symbolized: true,
            note: self.time_sampled.then(|| {
                "merged from profiles time-sampled under the overhead budget: estimates are \
                 for their whole intervals; intervals cover byte sampling in the observed \
                 windows only"
                    .to_string()
            }),
            time_sampling: None,
            timelines,
            processes: std::mem::take(&mut self.processes),
        }
    }
}
