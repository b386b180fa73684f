//! One window for everything in a report: on a target that keeps running, the exact
//! totals, the kernel's counters and the samples are cut at the same point, so the
//! report's samples are the kernel's samples and the exact total lies in the 95%
//! interval as often as the statistics promise. For `--pid`, probes are detached and
//! running programs waited for before everything is read; the agent's interval cuts
//! keep the probes running and cut at an epoch flip instead.
//!
//! Bound: each of `RUNS` independent runs misses with probability at most 5% (the
//! interval is exact or conservative, docs/statistics.md), so the misses are at most
//! Binomial(20, 0.05): P(misses >= 6) = 3e-4. A report whose estimate and totals come
//! from different windows (the bug this guards against) missed on every run. The
//! agent's consecutive intervals are independent too (disjoint calls, and the
//! countdown is memoryless), with the same bound for its first 20 intervals.

use std::{path::Path, sync::Mutex, time::Duration};

use allocbpf_e2e::{
    agent::{stored_profiles, write_config, AgentProcess},
    profile_running_json, require_root, scratch_dir, sites_binary, Workload,
};
use allocbpf_export::pprof::decode_file as decode;

const RUNS: usize = 20;
const MAX_MISSES: usize = 5;

/// The two tests each profile a `sites forever` workload; one at a time keeps the
/// agent from profiling the other test's target (and the machine's two CPUs free).
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

#[test]
fn a_running_target_profiled_many_times_keeps_one_window() {
    require_root();
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
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

/// The estimate's 95% interval and the exact bytes from a stored profile's comment
/// ("... total E bytes, 95% CI [LO, HI]; exact totals B bytes in C calls; ...").
fn interval_and_exact(profile: &Path) -> (f64, f64, f64, u64) {
    let profile = decode(profile).unwrap();
    let text = profile
        .comment
        .iter()
        .filter_map(|&i| profile.string_table.get(i as usize))
        .find(|c| c.contains("% CI ["))
        .expect("the estimate's comment")
        .clone();
    let after = |marker: &str| text.split(marker).nth(1).unwrap().to_string();
    let ci = after("CI [");
    let (lo, rest) = ci.split_once(", ").unwrap();
    let hi = rest.split(']').next().unwrap();
    let exact_part = after("exact totals ");
    let mut words = exact_part.split_whitespace();
    let exact = words.next().unwrap();
    let calls = words.nth(2).unwrap();
    (
        lo.parse().unwrap(),
        hi.parse().unwrap(),
        exact.parse().unwrap(),
        calls.parse().unwrap(),
    )
}

#[test]
fn the_agents_interval_cuts_keep_one_window() {
    require_root();
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = std::fs::canonicalize(scratch_dir("window-agent")).unwrap();
    let store = scratch.join("store");
    let mut workload = Workload::start(&sites_binary(), &["forever"]).unwrap();
    workload.go().unwrap();
    // Frame-pointer stacks and 1 MiB, as above: no ring-buffer drop to blur the test.
    // The workload allocates without pause, far over the overhead budget, which would
    // probe it part time: the budget is off (exact interval windows are what this test
    // is about).
    let config = write_config(
        &scratch,
        "comm = \"^sites\"\nunwind = \"fp\"\n[budget]\nenabled = false\n",
    );
    let agent = AgentProcess::start(
        &[
            "--config",
            config.to_str().unwrap(),
            "--store",
            store.to_str().unwrap(),
            "--interval",
            "1s",
            "--rate",
            "1MiB",
            "--metrics-address",
            "off",
        ],
        &[],
    )
    .unwrap();
    std::thread::sleep(Duration::from_secs(RUNS as u64 + 2));
    agent.terminate(Duration::from_secs(30)).unwrap();
    assert!(
        workload.child.try_wait().unwrap().is_none(),
        "the target died"
    );
    let tag = format!("-{}-", workload.pid);
    let mut profiles: Vec<_> = stored_profiles(&store)
        .into_iter()
        .filter(|p| p.file_name().unwrap().to_string_lossy().contains(&tag))
        .collect();
    // Named START_MS-END_MS-PID-COMM: in time order. The last one is SIGTERM's partial
    // interval; every full one is checked.
    profiles.sort();
    assert!(profiles.len() > RUNS, "{} profiles", profiles.len());
    let mut misses = 0;
    for (i, profile) in profiles.iter().take(RUNS).enumerate() {
        let (lo, hi, exact, calls) = interval_and_exact(profile);
        let inside = lo <= exact && exact <= hi;
        misses += usize::from(!inside);
        println!("interval {i:2}: exact {exact:>12.0} in [{lo:.0}, {hi:.0}]: {inside}");
        assert!(calls > 10_000, "interval {i}: {calls} calls");
    }
    assert!(
        misses <= MAX_MISSES,
        "{misses} of {RUNS} intervals missed the exact total"
    );
}
