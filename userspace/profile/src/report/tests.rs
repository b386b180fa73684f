use super::*;
use crate::aggregate::{SampledAllocation, StackKey};
use crate::estimate::{pace::ProbeState, windows::SampleWindow};

struct Nothing;

impl Symbolize for Nothing {
    fn prepare(&mut self, _: &mut dyn Iterator<Item = &Frame>) {}
    fn functions(&self, _: &Frame) -> Functions {
        Functions::default()
    }
    fn symbolizes(&self) -> bool {
        false
    }
    fn modules(&self) -> Vec<Module> {
        Vec::new()
    }
}

/// A time-sampled report weighs each sample by 1/inclusion (never the exact
/// figures).
#[test]
fn time_weights_scale_the_estimates_only() {
    let mut aggregate = Aggregate::default();
    let sample = |period| SampledAllocation {
        sample_id: period,
        size: 1 << 20,
        offset: 0,
        rate: 4096,
        certain: true,
        timestamp_ns: period,
        window: Some(SampleWindow {
            period,
            inclusion: 0.25,
        }),
    };
    for period in 0..4 {
        let key = StackKey {
            pid: 1,
            frames: Vec::new(),
        };
        aggregate.add(key, &sample(period));
    }
    let kernel = KernelFigures {
        exact: allocbpf_common::Totals {
            bytes: 4 << 20,
            ..Default::default()
        },
        observed: Some(Observed {
            pace: None,
            fraction: 0.25,
            first_period: 0,
            last_period: 3,
            probe_share: None,
            tally: PaceTally::default(),
        }),
        ..KernelFigures::default()
    };
    let report = Report::build(
        &aggregate,
        &mut Nothing,
        4096,
        Confidence::DEFAULT,
        kernel,
        None,
    );
    // Four certain 1 MiB samples, each standing for 4 MiB.
    assert_eq!(report.totals.estimated_bytes, (16 << 20) as f64);
    // Steady periods: no time-sampling variance.
    let interval = report.total_interval();
    assert_eq!(
        (interval.lo, interval.hi),
        ((16 << 20) as f64, (16 << 20) as f64)
    );
    assert_eq!(report.stacks[0].stats.estimated_bytes, (16 << 20) as f64);
    assert_eq!(report.totals.exact_bytes, 4 << 20);

    // A process that worked at half its pace while probed, a quarter of the time:
    // every estimate and the total's interval scaled by 0.25 + 0.75 / 0.5 = 1.75,
    // the exact figures and samples untouched.
    let paced = KernelFigures {
        observed: kernel.observed.map(|o| Observed {
            pace: Some(PaceCorrection {
                ratio: 0.5,
                factor: 1.75,
                factor_low: 1.5,
                factor_high: 2.5,
            }),
            ..o
        }),
        ..kernel
    };
    let report = Report::build(
        &aggregate,
        &mut Nothing,
        4096,
        Confidence::DEFAULT,
        paced,
        None,
    );
    assert_eq!(report.totals.estimated_bytes, (28 << 20) as f64);
    assert_eq!(report.stacks[0].stats.estimated_bytes, (28 << 20) as f64);
    assert_eq!(report.stacks[0].stats.observed_bytes, (4 << 20) as f64);
    // Steady periods: the interval is the range the factor could take, 1.5 to 2.5
    // times the 16 MiB time weighting gives.
    let interval = report.total_interval();
    assert_eq!(
        (interval.lo, interval.hi),
        ((24 << 20) as f64, (40 << 20) as f64)
    );
    assert_eq!(
        report.time_sampling.as_ref().unwrap().pace.map(|p| p.ratio),
        Some(0.5)
    );
    assert_eq!(report.totals.exact_bytes, 4 << 20);
    assert_eq!(report.totals.samples, 4);
}

/// The builder finishes what the collector measured: the probe share only from the
/// threshold on, and an uncorrected estimate's slack from its pace tally.
#[test]
fn the_probe_share_and_the_uncorrected_slack_are_built_in() {
    let mut aggregate = Aggregate::default();
    aggregate.add(
        StackKey {
            pid: 1,
            frames: Vec::new(),
        },
        &SampledAllocation {
            sample_id: 0,
            size: 1 << 20,
            offset: 0,
            rate: 4096,
            certain: true,
            timestamp_ns: 0,
            window: Some(SampleWindow {
                period: 0,
                inclusion: 0.5,
            }),
        },
    );
    // Too short probed for a correction, but a fifth of its probed CPU in traps.
    let mut tally = PaceTally::default();
    tally.add(ProbeState::Probed, 10e6, 10e6, 2e6);
    assert_eq!(tally.correction(), None);
    let kernel = |probe_share| KernelFigures {
        observed: Some(Observed {
            fraction: 0.5,
            first_period: 0,
            last_period: 0,
            pace: None,
            probe_share,
            tally,
        }),
        ..KernelFigures::default()
    };
    let build = |kernel| {
        Report::build(
            &aggregate,
            &mut Nothing,
            4096,
            Confidence::DEFAULT,
            kernel,
            None,
        )
    };

    let report = build(kernel(Some(0.04)));
    let time = report.time_sampling.as_ref().unwrap();
    assert_eq!(time.probe_share, None);

    let report = build(kernel(Some(0.2)));
    let time = report.time_sampling.as_ref().unwrap();
    assert_eq!(time.probe_share, Some(0.2));
    let slack = tally.uncorrected_slack(report.totals.estimated_bytes);
    assert!(slack.above > 0.0);
    assert_eq!(time.pace_slack, slack);

    // Not time-sampled: nothing to show.
    let report = build(KernelFigures::default());
    assert!(report.time_sampling.is_none());
}

/// The silence is the note of a report whose process made no probed call, and only
/// of such a report.
#[test]
fn the_silence_notes_a_report_without_calls() {
    let aggregate = Aggregate::default();
    let build = |calls| {
        let kernel = KernelFigures {
            exact: allocbpf_common::Totals {
                calls,
                ..Default::default()
            },
            ..KernelFigures::default()
        };
        let quiet = Some("quiet");
        Report::build(
            &aggregate,
            &mut Nothing,
            4096,
            Confidence::DEFAULT,
            kernel,
            quiet,
        )
    };
    assert_eq!(build(0).note.as_deref(), Some("quiet"));
    assert_eq!(build(1).note, None);
    let empty = |note| Report::empty(4096, Confidence::DEFAULT, Duration::ZERO, false, note);
    assert_eq!(empty(Some("quiet".into())).note.as_deref(), Some("quiet"));
    assert_eq!(
        empty(None).note.as_deref(),
        Some("no profiled process allocated anything")
    );
}
