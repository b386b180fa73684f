//! The page's data: one JSON document the page's script draws from. Compact on
//! purpose (a page of ten thousand stacks must stay small and quick to parse):
//! function names are interned once, stacks and flame-graph nodes refer to them by
//! index, and the flame graph's nodes are parallel arrays.

use std::collections::{BTreeMap, HashMap};

use serde_json::{json, Value};

use allocbpf_profile::aggregate::StackStats;
use allocbpf_profile::estimate::{Confidence, Interval};
use allocbpf_profile::report::{names_of, ProcessTimeline, Report};

use crate::text::summary_lines;

/// Timelines a page holds: those of the processes that allocated most.
pub const MAX_TIMELINES: usize = 100;

/// Names interned in first-seen order.
#[derive(Default)]
struct Names {
    index: HashMap<String, usize>,
    names: Vec<String>,
}

impl Names {
    fn id(&mut self, name: &str) -> usize {
        if let Some(&id) = self.index.get(name) {
            return id;
        }
        let id = self.names.len();
        self.index.insert(name.to_string(), id);
        self.names.push(name.to_string());
        id
    }
}

/// The interval on a group's in-use bytes, where the page gives one.
type InUseInterval<'a> = &'a dyn Fn(&StackStats) -> Option<Interval>;

/// A flame graph's tree: node 0 is the root; children follow their parent.
struct Tree {
    name: Vec<usize>,
    parent: Vec<i64>,
    stats: Vec<StackStats>,
    children: HashMap<(usize, usize), usize>,
}

impl Tree {
    fn new(root: usize) -> Self {
        Tree {
            name: vec![root],
            parent: vec![-1],
            stats: vec![StackStats::default()],
            children: HashMap::new(),
        }
    }

    /// Adds a stack (names outermost first) with its figures to every node on its
    /// path; returns its leaf node.
    fn add(&mut self, path: &[usize], stats: &StackStats) -> usize {
        let mut node = 0;
        self.stats[0].merge(stats);
        for &name in path {
            let next = self.name.len();
            let child = *self.children.entry((node, name)).or_insert(next);
            if child == next {
                self.name.push(name);
                self.parent.push(node as i64);
                self.stats.push(StackStats::default());
            }
            node = child;
            self.stats[node].merge(stats);
        }
        node
    }

    /// The tree as parallel arrays: per node its name, parent, samples, estimated
    /// bytes allocated with their interval, and with `inuse_interval` (live tracking)
    /// in use with the interval it gives. Every node is kept: stacks name their leaf
    /// node.
    fn to_json(
        &self,
        rate: u64,
        confidence: Confidence,
        inuse_interval: Option<InUseInterval<'_>>,
    ) -> Value {
        let (mut value, mut lo, mut hi) = (vec![], vec![], vec![]);
        let (mut inuse, mut inuse_lo, mut inuse_hi) = (vec![], vec![], vec![]);
        for stats in &self.stats {
            let interval = stats.bytes_interval(rate, confidence);
            value.push(bytes(stats.estimated_bytes));
            lo.push(bytes(interval.lo));
            hi.push(bytes(interval.hi));
            if let Some(inuse_interval) = inuse_interval {
                let interval = inuse_interval(stats);
                inuse.push(bytes(stats.inuse_bytes));
                inuse_lo.push(interval.map(|i| bytes(i.lo)));
                inuse_hi.push(interval.map(|i| bytes(i.hi)));
            }
        }
        let samples: Vec<u64> = self.stats.iter().map(|s| s.samples).collect();
        let mut tree = json!({
            "name": self.name, "parent": self.parent, "samples": samples,
            "value": value, "lo": lo, "hi": hi,
        });
        if inuse_interval.is_some() {
            tree["inuse"] = json!(inuse);
            tree["inuse_lo"] = json!(inuse_lo);
            tree["inuse_hi"] = json!(inuse_hi);
        }
        tree
    }
}

/// Bytes as a whole number (the page shows a few digits; `.0` on every number of a
/// large page would be a tenth of it).
fn bytes(value: f64) -> u64 {
    value.round().max(0.0) as u64
}

/// The interval of bytes held (a timeline's `StackStats` whose `estimated_bytes` are
/// bytes in use): the estimator's, scaled like the estimate; `None` for bytes read
/// back without their inputs (a store).
fn held_interval(held: &StackStats, rate: u64, confidence: Confidence) -> Option<Interval> {
    let without_inputs = held.interval_inputs == Default::default() && held.estimated_bytes > 0.0;
    (!without_inputs).then(|| held.bytes_interval(rate, confidence))
}

fn interval_json(interval: Option<Interval>) -> Value {
    match interval {
        Some(i) => json!([bytes(i.lo), bytes(i.hi)]),
        None => Value::Null,
    }
}

/// How the page names process `pid`: `name [pid]`, or `pid N` without a name.
fn process_label(name: Option<&str>, pid: u32) -> String {
    match name.filter(|name| !name.is_empty()) {
        Some(name) => format!("{name} [{pid}]"),
        None => format!("pid {pid}"),
    }
}

/// The label of process `pid` by the report's summary of it.
fn process_name(report: &Report, pid: u32) -> String {
    process_label(report.processes.get(&pid).map(|s| s.name.as_str()), pid)
}

/// The page's data for `report`; `command`: the command line that made it.
pub fn page_data(report: &Report, command: &str) -> Value {
    let rate = report.rate;
    let confidence = report.confidence;
    let live = report.live.is_some();
    // In-use intervals need the live samples' inputs: none observed part time (blocks
    // leave the followed set when their window closes, so in-use figures are not the
    // heap's), none read back from a store (it keeps no such inputs).
    let part_time = report
        .time_sampling
        .as_ref()
        .is_some_and(|t| t.observed_fraction < 1.0);
    let no_inuse_intervals = part_time
        || report
            .stacks
            .iter()
            .all(|s| s.stats.inuse_inputs == Default::default());
    let inuse_interval = |stats: &StackStats| {
        (!no_inuse_intervals)
            .then(|| stats.inuse_interval(rate, confidence))
            .flatten()
    };
    let mut names = Names::default();
    let root = names.id("all");
    let mut tree = Tree::new(root);
    let mut stacks = Vec::new();
    let mut per_process: BTreeMap<u32, StackStats> = Default::default();
    for (pid, frames, stats) in report.stacks_by_name() {
        let process = names.id(&process_name(report, pid));
        let path: Vec<usize> = std::iter::once(process)
            .chain(frames.iter().map(|f| names.id(f)))
            .collect();
        let leaf = tree.add(&path, &stats);
        per_process.entry(pid).or_default().merge(&stats);
        stacks.push(json!({
            "pid": pid,
            "node": leaf,
            "bytes": bytes(stats.estimated_bytes),
            "ci": interval_json(Some(report.interval(&stats))),
            "samples": stats.samples,
            "inuse": live.then(|| bytes(stats.inuse_bytes)),
            "inuse_ci": live.then(|| interval_json(inuse_interval(&stats))),
        }));
    }
    // Processes that made no stack (a silent target) are listed too.
    for &pid in report.processes.keys() {
        per_process.entry(pid).or_default();
    }
    let processes = processes_json(report, &per_process, live, &inuse_interval);
    let (timelines, timelines_omitted) = timelines_json(report, &mut names);
    let total = report.total_interval();
    let t = &report.totals;
    json!({
        "command": command,
        "rate": rate,
        "confidence": confidence.percent_label(),
        "duration_s": report.duration.as_secs_f64(),
        "live": live,
        "time_sampled": report.time_sampling.as_ref().map(|t| t.observed_fraction),
        "totals": {
            "bytes": bytes(t.estimated_bytes),
            "ci": [bytes(total.lo), bytes(total.hi)],
            "exact_bytes": t.exact_bytes,
            "exact_calls": t.exact_calls,
            "samples": t.samples,
            "drops": t.drops,
            "without_stack": report.counters.stack_errors,
            "inuse": live.then(|| bytes(t.inuse_bytes)),
        },
        "summary": summary_lines(report),
        "names": names.names,
        "tree": tree.to_json(rate, confidence, live.then_some(&inuse_interval as InUseInterval<'_>)),
        "stacks": stacks,
        "processes": processes,
        "timelines": timelines,
        "timelines_omitted": timelines_omitted,
    })
}

/// The processes table: per process its figures summed over its stacks (`per_process`),
/// its exact kernel totals and the share of its time observed; in-use figures with
/// `live` tracking, with the interval `inuse_interval` gives.
fn processes_json(
    report: &Report,
    per_process: &BTreeMap<u32, StackStats>,
    live: bool,
    inuse_interval: InUseInterval<'_>,
) -> Vec<Value> {
    per_process
        .iter()
        .map(|(&pid, stats)| {
            let summary = report.processes.get(&pid).cloned().unwrap_or_default();
            json!({
                "pid": pid,
                "name": process_name(report, pid),
                "bytes": bytes(stats.estimated_bytes),
                "ci": interval_json(Some(report.interval(stats))),
                "samples": stats.samples,
                "exact_bytes": summary.exact_bytes,
                "exact_calls": summary.exact_calls,
                "observed": summary.observed,
                "inuse": live.then(|| bytes(stats.inuse_bytes)),
                "inuse_ci": live.then(|| interval_json(inuse_interval(stats))),
            })
        })
        .collect()
}

/// The timelines of the processes that allocated most, at most [`MAX_TIMELINES`] (a
/// host's page stays small), their peaks' frames interned in `names`; and how many
/// were left out.
fn timelines_json(report: &Report, names: &mut Names) -> (Vec<Value>, usize) {
    let allocated = |t: &&ProcessTimeline| -> f64 {
        t.timeline
            .points
            .iter()
            .map(|p| p.alloc.estimated_bytes)
            .sum()
    };
    let mut ordered: Vec<&ProcessTimeline> = report.timelines.iter().collect();
    ordered.sort_by(|a, b| allocated(b).total_cmp(&allocated(a)));
    let timelines_omitted = ordered.len().saturating_sub(MAX_TIMELINES);
    let timelines: Vec<Value> = ordered
        .into_iter()
        .take(MAX_TIMELINES)
        .map(|t| timeline_json(report, t, names))
        .collect();
    (timelines, timelines_omitted)
}

/// One process's timeline: points as `[start_s, end_s, alloc, alloc_lo, alloc_hi,
/// inuse, inuse_lo, inuse_hi, inuse_high]` (in-use figures null without live
/// tracking; bounds null where not known).
fn timeline_json(report: &Report, process: &ProcessTimeline, names: &mut Names) -> Value {
    let (rate, confidence) = (report.rate, report.confidence);
    let timeline = &process.timeline;
    let seconds = |ns: u64| ns as f64 / 1e9;
    let points: Vec<Value> = timeline
        .points
        .iter()
        .map(|p| {
            let alloc = (!timeline.time_sampled).then(|| p.alloc.bytes_interval(rate, confidence));
            let inuse = timeline
                .live
                .then(|| held_interval(&p.inuse, rate, confidence));
            json!([
                seconds(p.start_ns),
                seconds(p.end_ns),
                bytes(p.alloc.estimated_bytes),
                alloc.map(|i| bytes(i.lo)),
                alloc.map(|i| bytes(i.hi)),
                timeline.live.then(|| bytes(p.inuse.estimated_bytes)),
                inuse.flatten().map(|i| bytes(i.lo)),
                inuse.flatten().map(|i| bytes(i.hi)),
                timeline.live.then(|| bytes(p.inuse_high)),
            ])
        })
        .collect();
    let peak = timeline.peak.as_ref().map(|peak| {
        let stacks: Vec<Value> = peak
            .stacks
            .iter()
            .map(|(locations, held)| {
                let frames: Vec<usize> = names_of(locations)
                    .into_iter()
                    .map(|n| names.id(n))
                    .collect();
                let interval = held_interval(held, rate, confidence);
                json!({
                    "frames": frames,
                    "bytes": bytes(held.estimated_bytes),
                    "ci": interval_json(interval),
                    "samples": held.samples,
                })
            })
            .collect();
        let interval = held_interval(&peak.inuse, rate, confidence);
        json!({
            "at_s": seconds(peak.at_ns),
            "bytes": bytes(peak.inuse.estimated_bytes),
            "ci": interval_json(interval),
            "stacks": stacks,
            "more": peak.omitted,
        })
    });
    json!({
        "pid": process.pid,
        "name": match &process.name {
            Some(name) => process_label(Some(name), process.pid),
            None => process_name(report, process.pid),
        },
        "live": timeline.live,
        "time_sampled": timeline.time_sampled,
        "high": timeline.high.map(|(ns, high)| json!([seconds(ns), bytes(high)])),
        "points": points,
        "peak": peak,
    })
}
