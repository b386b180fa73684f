//! Merging the profiles the agent stored into one report.
//!
//! Each stored profile is decoded (gzipped pprof), filtered by age and command name,
//! and turned back into stacks: frames become locations named by their functions, and
//! each stack keeps its raw sample count and confidence-interval inputs (numeric
//! labels the agent writes), so the merged report's intervals are exact, not summed.

use std::{
    collections::HashMap,
    path::Path,
    time::{Duration, SystemTime},
};

use regex::Regex;

use super::store::{age, list};
use allocbpf_collect::error::error_chain;
use allocbpf_export::pprof::{
    decode_path, interval_inputs_from, proto::Profile, ProfileMeta, INTERVAL_INPUT_LABELS,
    OBSERVED_BYTES_LABEL,
};
use allocbpf_profile::aggregate::{LiveCounts, StackStats};
use allocbpf_profile::estimate::Confidence;
use allocbpf_profile::frame::Frame;
use allocbpf_profile::frame::FunctionFrame;
use allocbpf_profile::report::{Location, Report, StackReport, Totals};

/// Why stored profiles could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// The store's directory cannot be listed.
    #[error("reading {}", path.display())]
    Store {
        /// The directory.
        path: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// Merges the profiles stored under `store` that ended at most `since` ago and whose
/// process's command name matches `comm` into one report; also returns how many were
/// merged. Files that do not decode are skipped, each told to `skipped` with why.
pub fn merge_store(
    store: &Path,
    since: Option<Duration>,
    comm: Option<&Regex>,
    mut skipped: impl FnMut(&Path, &str),
) -> Result<(Report, usize), ReportError> {
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
        merger.add(&profile, &meta);
        read += 1;
    }
    Ok((merger.finish(), read))
}

/// A function of a location: name, file, line.
type FunctionKey = (String, Option<String>, Option<u32>);

/// Accumulates stored profiles into one report.
#[derive(Default)]
struct Merger {
    stacks: Vec<StackReport>,
    /// Some profile was time-sampled (an overhead budget): said in the merged note.
    time_sampled: bool,
    /// Locations by their function chain, so equal frames share one `Frame`.
    locations: HashMap<Vec<FunctionKey>, Location>,
    rate: u64,
    live: bool,
    exact_bytes: u64,
    exact_calls: u64,
    first_ns: Option<i64>,
    last_ns: i64,
    /// Stacks of each process's latest profile: in-use bytes are a snapshot, so only
    /// the latest counts (profiles arrive oldest first).
    latest: HashMap<u32, Vec<usize>>,
}

impl Merger {
    fn add(&mut self, profile: &Profile, meta: &ProfileMeta) {
        let s = |i: i64| {
            profile
                .string_table
                .get(i as usize)
                .map_or("", String::as_str)
        };
        let types: Vec<&str> = profile.sample_type.iter().map(|t| s(t.r#type)).collect();
        let column = |name: &str| types.iter().position(|t| *t == name);
        let (alloc_objects, alloc_space) = (column("alloc_objects"), column("alloc_space"));
        let (inuse_objects, inuse_space) = (column("inuse_objects"), column("inuse_space"));
        self.live |= inuse_space.is_some();
        self.rate = self.rate.max(profile.period as u64);
        self.exact_bytes += meta.exact_bytes.unwrap_or(0);
        self.exact_calls += meta.exact_calls.unwrap_or(0);
        self.first_ns = Some(
            self.first_ns
                .map_or(profile.time_nanos, |t| t.min(profile.time_nanos)),
        );
        self.last_ns = self
            .last_ns
            .max(profile.time_nanos + profile.duration_nanos);

        let functions: HashMap<u64, (String, Option<String>)> = profile
            .function
            .iter()
            .map(|f| {
                let file = s(f.filename);
                (
                    f.id,
                    (
                        s(f.name).to_string(),
                        (!file.is_empty()).then(|| file.to_string()),
                    ),
                )
            })
            .collect();
        let location_by_id: HashMap<u64, &allocbpf_export::pprof::proto::Location> =
            profile.location.iter().map(|l| (l.id, l)).collect();
        let mut this_profile: Vec<usize> = Vec::new();
        let mut pid_of_profile = None;
        for sample in &profile.sample {
            let value = |column: Option<usize>| {
                column
                    .and_then(|c| sample.value.get(c))
                    .copied()
                    .unwrap_or(0) as f64
            };
            let label = |name: &str| {
                sample
                    .label
                    .iter()
                    .find(|l| s(l.key) == name)
                    .map_or(0, |l| l.num.max(0) as u64)
            };
            let inputs =
                interval_inputs_from(INTERVAL_INPUT_LABELS.map(label), profile.period as u64);
            let estimated_bytes = value(alloc_space);
            let has_observed = sample
                .label
                .iter()
                .any(|l| s(l.key) == OBSERVED_BYTES_LABEL);
            self.time_sampled |= has_observed;
            let stats = StackStats {
                samples: label("samples"),
                estimated_bytes,
                observed_bytes: if has_observed {
                    label(OBSERVED_BYTES_LABEL) as f64
                } else {
                    estimated_bytes
                },
                estimated_objects: value(alloc_objects),
                interval_inputs: inputs,
                inuse_bytes: value(inuse_space),
                inuse_objects: value(inuse_objects),
            };
            let locations = sample
                .location_id
                .iter()
                .filter_map(|id| location_by_id.get(id))
                .map(|location| self.location(location, &functions))
                .collect();
            let pid = label("pid") as u32;
            pid_of_profile = Some(pid);
            this_profile.push(self.stacks.len());
            self.stacks.push(StackReport {
                pid,
                locations,
                stats,
            });
        }
        if let Some(pid) = pid_of_profile {
            for old in self.latest.insert(pid, this_profile).unwrap_or_default() {
                self.stacks[old].stats.inuse_bytes = 0.0;
                self.stacks[old].stats.inuse_objects = 0.0;
            }
        }
    }

    fn location(
        &mut self,
        location: &allocbpf_export::pprof::proto::Location,
        functions: &HashMap<u64, (String, Option<String>)>,
    ) -> Location {
        let chain: Vec<FunctionKey> = location
            .line
            .iter()
            .map(|line| {
                let (name, file) = functions
                    .get(&line.function_id)
                    .cloned()
                    .unwrap_or_else(|| (format!("0x{:x}", location.address), None));
                (name, file, (line.line > 0).then_some(line.line as u32))
            })
            .collect();
        let chain = if chain.is_empty() {
            vec![(format!("0x{:x}", location.address), None, None)]
        } else {
            chain
        };
        let next = self.locations.len() as u64;
        self.locations
            .entry(chain.clone())
            .or_insert_with(|| Location {
                frame: Frame::Unknown(next),
                functions: chain
                    .into_iter()
                    .map(|(name, file, line)| FunctionFrame { name, file, line })
                    .collect::<Vec<_>>()
                    .into(),
            })
            .clone()
    }

    fn finish(mut self) -> Report {
        let mut totals = Totals {
            exact_bytes: self.exact_bytes,
            exact_calls: self.exact_calls,
            ..Totals::default()
        };
        for stack in &self.stacks {
            totals.estimated_bytes += stack.stats.estimated_bytes;
            totals.observed_bytes += stack.stats.observed_bytes;
            totals.samples += stack.stats.samples;
            totals.interval_inputs.merge(&stack.stats.interval_inputs);
            totals.inuse_bytes += stack.stats.inuse_bytes;
            totals.inuse_objects += stack.stats.inuse_objects;
        }
        self.stacks
            .sort_by(|a, b| b.stats.estimated_bytes.total_cmp(&a.stats.estimated_bytes));
        let span = self.last_ns - self.first_ns.unwrap_or(self.last_ns);
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
        }
    }
}
