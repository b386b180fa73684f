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
use allocbpf_collect::error::error_chain;
use allocbpf_export::pprof::{self, decode_path, ProfileMeta, ReadProfile};
use allocbpf_profile::aggregate::{LiveCounts, StackStats};
use allocbpf_profile::estimate::Confidence;
use allocbpf_profile::frame::{Frame, FunctionFrame};
use allocbpf_profile::report::{
    Location, ProcessSummary, ProcessTimeline, Report, StackReport, Totals,
};
use allocbpf_profile::timeline::{PeakCopy, Timeline, TimelinePoint};

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
    /// Per process, one timeline point per stored profile, oldest first.
    points: BTreeMap<u32, Vec<StoredPoint>>,
    processes: BTreeMap<u32, ProcessSummary>,
}

/// What one stored profile adds to its process's timeline.
struct StoredPoint {
    start_ns: i64,
    end_ns: i64,
    alloc: StackStats,
    inuse_bytes: f64,
    /// Time-sampled (an overhead budget).
    time_sampled: bool,
    /// Its stacks (indexes into the merger's), for the peak.
    stacks: Vec<usize>,
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
            let mut point = StoredPoint {
                start_ns: profile.time_nanos,
                end_ns: profile.time_nanos + profile.duration_nanos,
                alloc: StackStats::default(),
                inuse_bytes: 0.0,
                time_sampled: profile.samples.iter().any(|s| s.time_sampled),
                stacks: this_profile.clone(),
            };
            for &stack in &this_profile {
                let stats = &self.stacks[stack].stats;
                point.alloc.merge(&StackStats {
                    inuse_bytes: 0.0,
                    inuse_objects: 0.0,
                    ..*stats
                });
                point.inuse_bytes += stats.inuse_bytes;
            }
            self.points.entry(pid).or_default().push(point);
            let summary = self.processes.entry(pid).or_default();
            summary.name = comm.to_string();
            summary.exact_bytes += meta.exact_bytes.unwrap_or(0);
            summary.exact_calls += meta.exact_calls.unwrap_or(0);
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

    /// One timeline per process: a point per stored profile (the in-use bytes are its
    /// end's, without an interval: the store keeps no in-use interval inputs), the
    /// peak at the profile that ended holding most, with its stacks.
    fn timelines(&self, origin_ns: i64) -> Vec<ProcessTimeline> {
        let at = |ns: i64| (ns - origin_ns).max(0) as u64;
        self.points
            .iter()
            .map(|(&pid, stored)| {
                let points: Vec<TimelinePoint> = stored
                    .iter()
                    .map(|p| TimelinePoint {
                        start_ns: at(p.start_ns),
                        end_ns: at(p.end_ns),
                        alloc: p.alloc,
                        inuse: StackStats {
                            estimated_bytes: p.inuse_bytes,
                            ..StackStats::default()
                        },
                        inuse_high: p.inuse_bytes,
                    })
                    .collect();
                let peak = stored
                    .iter()
                    .filter(|p| self.live && p.inuse_bytes > 0.0)
                    .max_by(|a, b| a.inuse_bytes.total_cmp(&b.inuse_bytes));
                let mut timeline = Timeline {
                    points,
                    live: self.live,
                    time_sampled: false,
                    high: peak.map(|p| (at(p.end_ns), p.inuse_bytes)),
                    peak: peak.map(|p| PeakCopy {
                        at_ns: at(p.end_ns),
                        inuse: StackStats {
                            estimated_bytes: p.inuse_bytes,
                            ..StackStats::default()
                        },
                        stacks: p
                            .stacks
                            .iter()
                            .map(|&i| &self.stacks[i])
                            .filter(|s| s.stats.inuse_bytes > 0.0)
                            .map(|s| {
                                let held = StackStats {
                                    estimated_bytes: s.stats.inuse_bytes,
                                    estimated_objects: s.stats.inuse_objects,
                                    ..StackStats::default()
                                };
                                (s.locations.clone(), held)
                            })
                            .collect(),
                    }),
                };
                if stored.iter().any(|p| p.time_sampled) {
                    timeline.observed_part_time();
                }
                ProcessTimeline { pid, timeline }
            })
            .collect()
    }

    fn finish(mut self) -> Report {
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
        let timelines = self.timelines(self.first_ns.unwrap_or(0));
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
