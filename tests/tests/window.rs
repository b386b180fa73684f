//! One window for everything in a report: on a target that keeps running, the exact
//! totals, the kernel's counters and the samples are cut at the same point (probes
//! detached, running programs waited for, then everything read), so the report's
//! samples are the kernel's samples and the exact total lies in the 95% interval as
//! often as the statistics promise.
//!
//! Bound: each of `RUNS` independent runs misses with probability at most 5% (the
//! interval is exact or conservative, docs/statistics.md), so the misses are at most
//! Binomial(20, 0.05): P(misses >= 6) = 3e-4. A report whose estimate and totals come
//! from different windows (the bug this guards against) missed on every run.

use allocbpf_e2e::{profile_running_json, require_root, scratch_dir, sites_binary, Workload};

const RUNS: usize = 20;
const MAX_MISSES: usize = 5;

#[test]
fn a_running_target_profiled_many_times_keeps_one_window() {
    require_root();
    let dir = scratch_dir("window");
    let mut workload = Workload::start(&sites_binary(), &["forever"]).unwrap();
    workload.go().unwrap();
    let mut misses = 0;
    for run in 0..RUNS {
        let out = dir.join(format!("run-{run}.json"));
        let (json, _) = profile_running_json(
            workload.pid,
            &[
                // ~5,000 samples a second from this workload, without stack copies:
                // the ring buffer keeps up on a busy 2-core machine, so no drop biases
                // the estimate (drops are not what this test is about).
                "--rate",
                "1MiB",
                "--unwind",
                "fp",
                "--duration",
                "700ms",
            ],
            &out,
        )
        .unwrap();
        let totals = &json["totals"];
        let exact = totals["exact_bytes"].as_f64().unwrap();
        let ci = totals["bytes_ci95"].as_array().unwrap();
        let (lo, hi) = (ci[0].as_f64().unwrap(), ci[1].as_f64().unwrap());
        let inside = lo <= exact && exact <= hi;
        misses += usize::from(!inside);
        println!(
            "run {run:2}: exact {exact:>12.0} in [{lo:.0}, {hi:.0}]: {inside}; samples {} (kernel {})",
            totals["samples"], json["counters"]["samples"]
        );
        assert!(
            totals["exact_calls"].as_u64().unwrap() > 10_000,
            "{totals:#}"
        );
        assert_eq!(totals["drops"], 0, "{totals:#}");
        // Every sample the kernel took is in the report, and no other.
        assert_eq!(totals["samples"], json["counters"]["samples"], "{json:#}");
        assert!(totals["samples"].as_u64().unwrap() > 500, "{totals:#}");
    }
    assert!(
        workload.child.try_wait().unwrap().is_none(),
        "the target died"
    );
    assert!(
        misses <= MAX_MISSES,
        "{misses} of {RUNS} intervals missed the exact total"
    );
}
