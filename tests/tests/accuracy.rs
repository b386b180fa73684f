//! The accuracy harness's assertions (simulated trials through the kernel's sampling
//! code; `cargo xtask accuracy` prints the same figures).
//!
//! Bounds, all derived from the sampling law, seeds fixed:
//! - mean estimate within 3 standard errors of the truth (issue 3's criterion; with
//!   fixed seeds the outcome is deterministic, and a correct estimator passes a 3-SE
//!   check with probability 99.7% per site for any seed);
//! - observed variance / formula variance within 5 sd of 1, where the ratio's sd is
//!   sqrt(2/(T-1) + kurtosis/T) (the variance of a sample variance);
//! - 95% interval coverage in [93%, 97%] over T = 10,000 trials: the binomial sd of the
//!   observed coverage is 0.22%, so a correct interval whose true coverage lies in
//!   [94.1%, 96.1%] passes with margin >= 4 sd (the conservative end-point adjustment
//!   puts true coverage at 95.0-96.2% for the harness's 48+ samples per site);
//! - binomial frequencies and correlations within 5 sd (two-sided tail 6e-7).

use allocbpf_e2e::accuracy::{
    self, workloads, SiteSummary, HEAPPROFD_SIZES, MEMORYLESS_TRIALS, TRIALS,
};

fn check_site(row: &SiteSummary) {
    let what = format!("{} / {}: {row:?}", row.workload, row.site);
    if row.is_exact() {
        assert_eq!(row.mean, row.truth, "{what}");
        assert_eq!(row.sd_observed, 0.0, "{what}");
        return;
    }
    assert!(row.z.abs() <= 3.0, "bias {:.2} SE: {what}", row.z);
    let ratio_bound = 5.0 * row.variance_ratio_sd;
    assert!(
        (row.variance_ratio - 1.0).abs() <= ratio_bound,
        "variance ratio {:.3} outside 1 +- {ratio_bound:.3}: {what}",
        row.variance_ratio
    );
    assert!(
        (0.93..=0.97).contains(&row.coverage),
        "coverage {:.4}: {what}",
        row.coverage
    );
}

fn check_workload(index: u64, workload: workloads::SimWorkload) -> Vec<SiteSummary> {
    let rows = accuracy::run_workload(&workload, TRIALS, 1_000_000 * index);
    for row in &rows {
        check_site(row);
    }
    rows
}

#[test]
fn many_small_and_a_few_huge() {
    let rows = check_workload(1, workloads::small_and_huge());
    assert!(rows[1].is_exact(), "1 MiB is above the certain threshold");
}

#[test]
fn sizes_around_the_rate() {
    check_workload(2, workloads::around_the_rate());
}

/// Every 64th allocation large: a fixed-stride sampler would see only one kind.
#[test]
fn periodic_pattern_does_not_alias() {
    check_workload(3, workloads::periodic());
}

#[test]
fn the_same_bytes_on_1_4_and_16_threads() {
    let rows: Vec<SiteSummary> = [1, 4, 16]
        .iter()
        .enumerate()
        .map(|(i, &threads)| {
            check_workload(4 + i as u64, workloads::split_across_threads(threads))[0].clone()
        })
        .collect();
    // Equal in expectation: pairwise differences of means within 3 combined SE.
    for a in &rows {
        for b in &rows {
            let se = (a.standard_error.powi(2) + b.standard_error.powi(2)).sqrt();
            assert!(
                (a.mean - b.mean).abs() <= 3.0 * se,
                "{} vs {}",
                a.workload,
                b.workload
            );
        }
    }
}

#[test]
fn calloc_realloc_and_aligned_mixes() {
    check_workload(7, workloads::allocator_mix());
}

/// heapprofd: P(an allocation of S bytes is sampled) = 1 - exp(-S/R), and at 512 KiB a
/// 1.5 MiB allocation is sampled at least 95% of the time.
#[test]
fn sampling_probability_matches_heapprofd() {
    for check in accuracy::sampling_probabilities(512 << 10, &HEAPPROFD_SIZES, 20_000, 3) {
        assert!(
            (check.observed - check.expected).abs() <= 5.0 * check.sd,
            "{check:?}"
        );
        if check.size == 3 << 19 {
            assert!(check.expected >= 0.95, "{check:?}");
        }
    }
}

/// Ring pressure and observation windows (docs/statistics.md, "Overload", "Samples
/// inside windows"): countdowns switching between mean intervals R/16 and 32R, each
/// sample weighed at its own, through the probe's drawing code. Same bounds as every
/// site: bias within 3 SE, variance as predicted at each allocation's rate, 95% interval
/// coverage in [93%, 97%] (the moment-matched gamma law).
#[test]
fn countdowns_that_change_scale_stay_unbiased_and_covered() {
    let row = accuracy::scaled_rates(TRIALS, 26);
    eprintln!("{row:?}");
    check_site(&row);
}

/// 1 MiB as one allocation or as 1024 x 1 KiB: the same expected estimate.
#[test]
fn memorylessness() {
    let (single, split) = accuracy::memorylessness(MEMORYLESS_TRIALS, 4);
    for row in [&single, &split] {
        assert!(row.z.abs() <= 3.0, "{row:?}");
    }
    let se = (single.standard_error.powi(2) + split.standard_error.powi(2)).sqrt();
    assert!((single.mean - split.mean).abs() <= 3.0 * se);
}

/// The intervals the probe draws: exponential with mean R (KS at significance 0.001),
/// no correlation between one thread's consecutive draws or between two threads'.
#[test]
fn interval_picks_are_exponential_and_uncorrelated() {
    let q = accuracy::interval_quality(512 << 10, 500_000, 5);
    assert!(q.ks_distance < q.ks_critical, "{q:?}");
    let per_thread = (q.draws / 2) as f64;
    // Correlation of n independent pairs has sd 1/sqrt(n).
    for r in q.autocorrelations.iter().chain([&q.cross_thread]) {
        assert!(r.abs() < 5.0 / per_thread.sqrt(), "{q:?}");
    }
    // The mean of n exponential draws has relative sd 1/sqrt(n).
    assert!(
        (q.mean_ratio - 1.0).abs() < 5.0 / (q.draws as f64).sqrt(),
        "{q:?}"
    );
}

/// Time sampling under the overhead budget (docs/statistics.md, "Time sampling"): a
/// process observed in one window of `d·P` per period at a random phase, each sample
/// weighed by `1/d`, is estimated without bias over the WHOLE interval, and the
/// successive-difference interval (byte and time sampling together) covers the truth
/// nearly as often as its level says. Bounds: the mean error within 4 standard errors
/// (two-sided normal tail 6e-5; the seeds are fixed); coverage over 2,000 trials at
/// least 92%. The t interval is exact for normal period totals; a sparse process
/// observed 2% of the time has skewed ones (a window catches a burst or not), and
/// its coverage measured over other seeds is 93.3-93.6% (94-95% for the others): 92%
/// is 2.7 binomial sd (0.55%) under that. Drifting rates make the estimator
/// conservative (98.7% for bursts at 20%), so there is no upper bound. The
/// byte-sampling-only interval is printed: on bursty processes it covers far less
/// (66%), which is why profiles say it covers the observed windows only.
///
/// A CPU-bound process slowed to 3/5 of its pace inside its windows (docs/statistics.md,
/// "Pace") is held to the same bounds once its estimate is scaled by
/// `pace_factor(d, r̂)`, `r̂` from its CPU ticks through `PaceTally`: measured -0.1 and
/// +0.6 standard errors, coverage 93.3% and 94.4%. Scaled by `1/r̂` alone (forgetting
/// that the process really was slower in its windows) it is 45 standard errors high at
/// d = 20%: the bound tells the two apart.
#[test]
fn time_sampled_estimates_are_unbiased_and_their_intervals_cover() {
    use allocbpf_e2e::accuracy::time_sampling::{run, Pattern};
    let steady = Pattern::Steady { size: 4096 };
    let bursty = Pattern::Bursty {
        size: 4096,
        mean_on: 400,
        mean_off: 1_600,
    };
    // Slowed to 3/5 of its pace inside its windows (the observer effect), corrected by
    // the pace its CPU time shows.
    let cpu_bound = Pattern::CpuBound {
        size: 4096,
        work: 3,
        trap: 2,
        in_place_percent: 100,
    };
    for (index, (pattern, duty)) in [
        (steady, 0.02),
        (steady, 0.2),
        (bursty, 0.02),
        (bursty, 0.2),
        (cpu_bound, 0.02),
        (cpu_bound, 0.2),
    ]
    .into_iter()
    .enumerate()
    {
        let summary = run(pattern, duty, 64 << 10, 2_000, 77 + index as u64);
        eprintln!("{summary:?}");
        let z = summary.mean_error / summary.standard_error;
        assert!(
            z.abs() <= 4.0,
            "bias of {z:.2} standard errors: {summary:?}"
        );
        assert!(summary.coverage >= 0.92, "coverage: {summary:?}");
        // The pace's widening is for a calibration that is off; this one is right,
        // and the sampling interval alone must cover.
        assert!(summary.sampling_coverage >= 0.92, "coverage: {summary:?}");
    }
}

/// Short and bursty processes, and processes that start and end within an interval
/// (docs/statistics.md, "Short and bursty processes"), 1,500 simulated processes of
/// each shape: observed full time (their image full time, or their own links beside a
/// heavy process), each one's interval is the byte-sampling one where it lived less
/// than two periods, Wolter's over its periods otherwise, and covers its truth in at
/// least 92% of them: for 95% intervals the count of 1,500 is Binomial(1,500, 0.95),
/// sd 0.56%, so 92% is 5.3 sd below (a correct interval essentially never fails it);
/// the mean error is within 4 standard errors of 0. Shapes: a job of half a period
/// allocating in three bursts (at 64 KiB and at 4 KiB allocations), one of ten periods
/// starting anywhere in the interval, and the on/off bursty process. The same jobs
/// observed in windows are printed, not held: a job living less than one period is in
/// a window with probability `d` and its bytes are then weighed `1/d`, so no interval
/// built from what one period showed covers it (docs/statistics.md).
#[test]
fn short_and_bursty_processes_observed_full_time_are_covered() {
    use allocbpf_e2e::accuracy::time_sampling::{run, Pattern, PERIOD};
    let shapes = [
        Pattern::Short {
            size: 64 << 10,
            life: PERIOD / 2,
        },
        Pattern::Short {
            size: 4096,
            life: PERIOD / 2,
        },
        Pattern::Short {
            size: 4096,
            life: 10 * PERIOD,
        },
        Pattern::Bursty {
            size: 4096,
            mean_on: 400,
            mean_off: 1_600,
        },
    ];
    for (index, pattern) in shapes.into_iter().enumerate() {
        let summary = run(pattern, 1.0, 64 << 10, 1_500, 911 + index as u64);
        eprintln!("full time: {summary:?}");
        let z = summary.mean_error / summary.standard_error;
        assert!(
            z.abs() <= 4.0,
            "bias of {z:.2} standard errors: {summary:?}"
        );
        assert!(summary.coverage >= 0.92, "coverage: {summary:?}");
        let windowed = run(pattern, 0.05, 64 << 10, 1_500, 1911 + index as u64);
        eprintln!("windows at 5%: {windowed:?}");
    }
}

/// When a trap costs the process more (or less) in place than its calibrated cost,
/// its pace is mis-measured and its corrected estimate is biased, beyond what the
/// sampling interval covers; the interval widened by the pace's slack (the factor
/// for a hit cost anywhere in `IN_PLACE_COST`, 0.85x to 2x) still covers, as long
/// as the real cost lies in that range (docs/statistics.md, "Pace").
///
/// The same process as above (3 ticks of work, 2 of trap per allocation in its
/// windows, r = 0.6), with the traps counted at 1/1.25 and 1/0.9 of what they cost.
/// Expected bias at d = 20%: the measured pace is (5 - 1.6)/5 = 0.68 at 1.25x, so the
/// factor is (0.8 + 0.2·0.68)/0.68 = 1.376 against 0.2 + 0.8/0.6 = 1.533: -10.2%;
/// at 0.9x, (5 - 2.22)/5 = 0.556 and 1.639: +6.9%; at 1.65x (CPython's `ctypes`
/// storm), (5 - 1.21)/5 = 0.758 and 1.255: -18.1%. Bounds: the bias is beyond 4
/// standard errors (the correction is really off, so the test has power), and the
/// widened interval covers in at least 92% of 2,000 trials (as above).
#[test]
fn an_off_calibration_is_covered_by_the_pace_slack() {
    use allocbpf_e2e::accuracy::time_sampling::{run, Pattern};
    for (index, (in_place_percent, duty)) in
        [(125, 0.2), (125, 0.02), (90, 0.2), (90, 0.02), (165, 0.2)]
            .into_iter()
            .enumerate()
    {
        let pattern = Pattern::CpuBound {
            size: 4096,
            work: 3,
            trap: 2,
            in_place_percent,
        };
        let summary = run(pattern, duty, 64 << 10, 2_000, 177 + index as u64);
        eprintln!("{summary:?}");
        let z = summary.mean_error / summary.standard_error;
        let expected_sign = if in_place_percent > 100 { -1.0 } else { 1.0 };
        assert!(
            z * expected_sign > 4.0,
            "the calibration is off: its bias ({z:.1} standard errors) shows it: {summary:?}"
        );
        assert!(summary.coverage >= 0.92, "coverage: {summary:?}");
    }
}
