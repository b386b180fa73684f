//! `--format json`: the schema the Foundation issue fixed (docs/output.md).
//!
//! ```text
//! {"rate": bytes,
//!  "totals": {"exact_bytes", "exact_calls", "estimated_bytes", "samples", "drops"},
//!  "stacks": [{"pid", "frames": [names, outermost first], "samples",
//!              "estimated_bytes", "estimated_objects"}]}
//! ```
//! Extensions add keys; existing keys keep their meaning.

use std::io::Write;

use serde_json::{json, Value};

use crate::report::Report;

/// The report as a JSON value.
pub fn to_value(report: &Report) -> Value {
    let stacks: Vec<Value> = report
        .stacks_by_name()
        .into_iter()
        .map(|(pid, frames, stats)| {
            json!({
                "pid": pid,
                "frames": frames,
                "samples": stats.samples,
                "estimated_bytes": stats.estimated_bytes,
                "estimated_objects": stats.estimated_objects,
            })
        })
        .collect();
    let t = &report.totals;
    json!({
        "rate": report.rate,
        "duration_seconds": report.duration.as_secs_f64(),
        "totals": {
            "exact_bytes": t.exact_bytes,
            "exact_calls": t.exact_calls,
            "estimated_bytes": t.estimated_bytes,
            "samples": t.samples,
            "drops": t.drops,
        },
        "counters": report.counters,
        "stacks": stacks,
    })
}

/// Writes the report as pretty-printed JSON.
pub fn write(report: &Report, out: &mut dyn Write) -> std::io::Result<()> {
    serde_json::to_writer_pretty(&mut *out, &to_value(report))?;
    writeln!(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::test_report;

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
    }
}
