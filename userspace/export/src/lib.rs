//! Output formats. Every exporter reads a finished [`Report`] of the profile model
//! ([`allocbpf_profile`]) and writes bytes: [`text`], [`json`], [`folded`] stacks, SVG
//! flame graphs (inferno), one self-contained [`html`] page and gzipped [`pprof`], which is also decoded for `allocbpf
//! report`; a pprof profile converts to an OpenTelemetry profiles request ([`otlp`]).
//! Nothing here knows how the report was collected.
#![deny(missing_docs)]

pub mod folded;
pub mod html;
pub mod json;
pub mod otlp;
pub mod pprof;
pub mod text;

use std::io::Write;

use allocbpf_profile::report::Report;

/// The output formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// A table of the top stacks, exact vs estimated totals and drops.
    Text,
    /// Machine-readable JSON (schema: README.md, "Formats"; [`json`]).
    Json,
    /// gzipped pprof profile.proto (Go heap conventions).
    Pprof,
    /// Folded stacks: `outer;...;inner estimated_bytes`.
    Folded,
    /// A flamegraph (inferno) of estimated bytes.
    Svg,
    /// One self-contained HTML page ([`html`]).
    Html,
}

/// Writes `report` in `format`; `command`: the command line that made it (the HTML
/// page's header shows it).
pub fn write(
    report: &Report,
    format: Format,
    command: &str,
    out: &mut dyn Write,
) -> std::io::Result<()> {
    match format {
        Format::Text => text::write(report, out),
        Format::Json => json::write(report, out),
        Format::Pprof => pprof::write(report, out),
        Format::Folded => folded::write(report, out),
        Format::Svg => folded::write_svg(report, out),
        Format::Html => html::write(report, command, out),
    }
}

/// Time sampling that observed a quarter of four periods, for the exporters' tests.
#[cfg(test)]
pub(crate) fn quarter_observed() -> allocbpf_profile::estimate::windows::TimeSampling {
    allocbpf_profile::estimate::windows::TimeSampling {
        observed_fraction: 0.25,
        periods: 0..=3,
        totals: Default::default(),
        probe_share: None,
        pace: None,
        paced_processes: 0,
        pace_slack: Default::default(),
    }
}

/// A small report with an inlined frame, shared by the exporters' tests.
#[cfg(test)]
pub(crate) fn test_report() -> Report {
    use allocbpf_profile::aggregate::StackStats;
    use allocbpf_profile::estimate::{Confidence, IntervalInputs};
    use allocbpf_profile::frame::FunctionFrame;
    use allocbpf_profile::frame::{Frame, Module};
    use allocbpf_profile::report::{Location, StackReport, Totals};
    let function = |name: &str, line| FunctionFrame {
        name: name.to_string(),
        file: Some("work.c".to_string()),
        line: Some(line),
        shown: None,
    };
    let stack = |pid, bytes: f64, samples, leaf: Vec<FunctionFrame>| StackReport {
        pid,
        locations: vec![
            Location {
                frame: Frame::Module {
                    module: 0,
                    offset: 0x1234,
                },
                functions: leaf.into(),
            },
            Location {
                frame: Frame::Module {
                    module: 0,
                    offset: 0x2000,
                },
                functions: vec![function("main", 9)].into(),
            },
        ],
        stats: StackStats {
            samples,
            estimated_bytes: bytes,
            estimated_objects: bytes / 64.0,
            observed_bytes: bytes,
            interval_inputs: IntervalInputs {
                counted_samples: samples,
                untried_bytes: samples * 32,
                sampled_bytes: samples * 64,
                certain_bytes: 0,
                ..IntervalInputs::default()
            },
            inuse_bytes: 0.0,
            inuse_objects: 0.0,
            inuse_inputs: Default::default(),
            inuse_observed_bytes: 0.0,
        },
    };
    Report {
        rate: 4096,
        confidence: Confidence::DEFAULT,
        duration: std::time::Duration::from_secs(2),
        totals: Totals {
            exact_bytes: 30_000,
            exact_calls: 400,
            estimated_bytes: 28_672.0,
            observed_bytes: 28_672.0,
            samples: 7,
            drops: 0,
            inuse_bytes: 0.0,
            inuse_objects: 0.0,
            interval_inputs: IntervalInputs {
                counted_samples: 7,
                untried_bytes: 7 * 32,
                sampled_bytes: 7 * 64,
                certain_bytes: 0,
                ..IntervalInputs::default()
            },
        },
        counters: Default::default(),
        modules: vec![Module {
            path: "/usr/bin/work".into(),
            build_id: Some(vec![0xab, 0xcd]),
        }],
        stacks: vec![
            stack(
                42,
                20_480.0,
                5,
                vec![function("inlined_helper", 3), function("site_a", 5)],
            ),
            stack(42, 8_192.0, 2, vec![function("site_b", 7)]),
        ],
        live: None,
        leaks: None,
        symbolized: true,
        note: None,
        time_sampling: None,
        timelines: Vec::new(),
        processes: Default::default(),
    }
}
