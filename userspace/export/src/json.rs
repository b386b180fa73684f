//! JSON: the schema the Foundation issue fixed (README.md, "Formats").
//!
//! ```text
//! {"rate": bytes, "confidence": level,
//!  "totals": {"exact_bytes", "exact_calls", "estimated_bytes", "samples", "drops",
//!             "bytes_ci95": [lo, hi], "bytes_ci": [lo, hi]},
//!  "stacks": [{"pid", "frames": [names, outermost first], "samples",
//!              "estimated_bytes", "estimated_objects",
//!              "bytes_ci95": [lo, hi], "bytes_ci": [lo, hi]}]}
//! ```
//! `bytes_ci95` is always the 95% interval, whatever confidence level the report has, so scripts
//! can rely on one key; `bytes_ci` is the interval at `confidence`.
//! With live tracking, stacks and totals add `inuse_bytes` and `inuse_objects`, and `live`
//! holds the tracking counts; with a leak report, `leaks` lists
//! `{"pid", "frames", "samples", "estimated_bytes", "estimated_objects",
//! "min_age_seconds", "max_age_seconds"}` and `leak_min_age_seconds` the cut.
//! Under an overhead budget (time sampling), `time_sampling` holds `observed_fraction`,
//! `periods`, whether the totals' intervals include time sampling, `probe_share` (null
//! unless the probes took 5% or more of the process's CPU while it was probed) and
//! `pace` and `pace_factor` (the process's pace while probed relative to unprobed, and
//! the factor every estimate was scaled by for it: the observer effect,
//! docs/statistics.md "Pace"; `pace_factor_range` the factor for a hit costing the
//! process 0.85x to 2x its calibrated cost in place, a range the totals' intervals
//! include; `paced_processes` counts the processes so corrected, and
//! a merged report of several shows no single pace; null when it could not be measured,
//! and then a CPU-bound process with a `probe_share` `s` may be underestimated: its truth
//! up to `1/(1 - 2 s)` times its estimate, where the totals' intervals reach); every
//! estimate is for the whole interval.
//! Extensions add keys; existing keys keep their meaning.

use std::io::Write;

use serde_json::{json, Value};

use allocbpf_profile::aggregate::{LeakStats, StackStats};
use allocbpf_profile::estimate::{Confidence, Interval};
use allocbpf_profile::report::Report;

/// The two interval keys of a stack or the totals: `at` gives the interval at a level.
fn intervals(report: &Report, at: impl Fn(Confidence) -> Interval) -> (Value, Value) {
    let pair = |i: Interval| json!([i.lo, i.hi]);
    (pair(at(Confidence::DEFAULT)), pair(at(report.confidence)))
}

fn stack_value(report: &Report, pid: u32, frames: Vec<&str>, stats: StackStats) -> Value {
    let (ci95, ci) = intervals(report, |c| stats.bytes_interval(report.rate, c));
    let mut value = json!({
        "pid": pid,
        "frames": frames,
        "samples": stats.samples,
        "estimated_bytes": stats.estimated_bytes,
        "estimated_objects": stats.estimated_objects,
        "bytes_ci95": ci95,
        "bytes_ci": ci,
    });
    if report.live.is_some() {
        value["inuse_bytes"] = json!(stats.inuse_bytes);
        value["inuse_objects"] = json!(stats.inuse_objects);
    }
    value
}

fn leak_value(pid: u32, frames: Vec<&str>, leak: LeakStats) -> Value {
    json!({
        "pid": pid,
        "frames": frames,
        "samples": leak.samples,
        "estimated_bytes": leak.estimated_bytes,
        "estimated_objects": leak.estimated_objects,
        "min_age_seconds": leak.min_age_ns as f64 / 1e9,
        "max_age_seconds": leak.max_age_ns as f64 / 1e9,
    })
}

/// The report as a JSON value.
pub fn to_value(report: &Report) -> Value {
    let stacks: Vec<Value> = report
        .stacks_by_name()
        .into_iter()
        .map(|(pid, frames, stats)| stack_value(report, pid, frames, stats))
        .collect();
    let t = &report.totals;
    let (ci95, ci) = intervals(report, |c| report.total_interval_at(c));
    let mut value = json!({
        "rate": report.rate,
        "confidence": report.confidence.level(),
        "duration_seconds": report.duration.as_secs_f64(),
        "totals": {
            "exact_bytes": t.exact_bytes,
            "exact_calls": t.exact_calls,
            "estimated_bytes": t.estimated_bytes,
            "samples": t.samples,
            "drops": t.drops,
            "bytes_ci95": ci95,
            "bytes_ci": ci,
        },
        "counters": report.counters,
        "stacks": stacks,
    });
    if let Some(note) = &report.note {
        value["note"] = json!(note);
    }
    if let Some(time) = &report.time_sampling {
        // Estimates are for the whole interval; `bytes_ci*` of the totals include time
        // sampling, those of the stacks cover byte sampling in the observed windows only.
        value["time_sampling"] = json!({
            "observed_fraction": time.observed_fraction,
            "periods": time.periods.end() - time.periods.start() + 1,
            "totals_ci_include_time_sampling": report.total_interval_includes_time(),
            "probe_share": time.probe_share,
            "pace": time.pace.map(|p| p.ratio),
            "pace_factor": time.pace.map(|p| p.factor),
            "pace_factor_range": time.pace.map(|p| [p.factor_low, p.factor_high]),
            "paced_processes": time.paced_processes,
        });
    }
    if let Some(live) = &report.live {
        value["totals"]["inuse_bytes"] = json!(t.inuse_bytes);
        value["totals"]["inuse_objects"] = json!(t.inuse_objects);
        value["live"] = json!(live);
    }
    if let Some(min_age) = report.leaks.as_ref().map(|l| l.min_age) {
        value["leak_min_age_seconds"] = json!(min_age.as_secs_f64());
        value["leaks"] = report
            .leaks_by_name()
            .into_iter()
            .map(|(pid, frames, leak)| leak_value(pid, frames, leak))
            .collect();
    }
    value
}

/// Writes the report as pretty-printed JSON.
pub fn write(report: &Report, out: &mut dyn Write) -> std::io::Result<()> {
    serde_json::to_writer_pretty(&mut *out, &to_value(report))?;
    writeln!(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_report;

    #[test]
    fn live_and_leak_keys_appear_with_live_tracking() {
        let mut report = test_report();
        assert!(to_value(&report).get("live").is_none());
        report.live = Some(allocbpf_profile::aggregate::LiveCounts::default());
        report.leaks = Some(allocbpf_profile::report::Leaks {
            min_age: std::time::Duration::from_secs(30),
            groups: Vec::new(),
        });
        let v = to_value(&report);
        assert!(v["stacks"][0]["inuse_bytes"].is_number());
        assert!(v["totals"]["inuse_objects"].is_number());
        assert_eq!(v["leaks"], json!([]));
        assert_eq!(v["leak_min_age_seconds"], 30.0);
    }

    #[test]
    fn schema_has_the_documented_keys() {
        let v = to_value(&test_report());
        assert_eq!(v["rate"], 4096);
        for key in [
            "exact_bytes",
            "exact_calls",
            "estimated_bytes",
            "samples",
            "drops",
        ] {
            assert!(v["totals"].get(key).is_some(), "totals.{key}");
        }
        let stack = &v["stacks"][0];
        assert_eq!(stack["pid"], 42);
        assert_eq!(stack["frames"], json!(["main", "site_a", "inlined_helper"]));
        assert_eq!(stack["samples"], 5);
        assert_eq!(stack["estimated_bytes"], 20480.0);
        assert!(stack.get("estimated_objects").is_some());
        let ci = stack["bytes_ci95"].as_array().unwrap();
        assert_eq!(ci.len(), 2);
        assert!(ci[0].as_f64().unwrap() <= ci[1].as_f64().unwrap());
        assert!(v["totals"]["bytes_ci95"].is_array());
        assert_eq!(v["confidence"], 0.95);
    }
}
