//! Threads that exit before their process: their exact totals are kept (folded at thread
//! exit) and sampling stays unbiased across per-thread countdowns.

use allocbpf_e2e::{
    compile_workload, estimated_bytes, profile_to_completion, require_root, scratch_dir,
    sites::Site, stacks_with,
};

const THREADS: u64 = 16;
const CALLS: u64 = 20_000;
const SIZE: u64 = 256;
const RATE: u64 = 16 * 1024;

/// Profiles the threads workload with `extra` arguments; checks totals and the estimate
/// and returns the JSON profile.
fn profile_threads(name: &str, extra: &[&str]) -> serde_json::Value {
    require_root();
    let binary = compile_workload(
        "threads",
        &["-O1", "-g", "-fno-omit-frame-pointer", "-pthread"],
    )
    .unwrap();
    let out = scratch_dir(name).join("threads.json");
    let rate = RATE.to_string();
    // 20,000 samples in a fraction of a second: frame-pointer stacks (the workload has
    // them) keep events small enough that the ring buffer never drops one.
    let mut args = vec![
        "--rate", &rate, "--unwind", "fp", "--format", "json", "--output",
    ];
    args.push(out.to_str().unwrap());
    args.extend_from_slice(extra);
    profile_to_completion(&binary, &args).unwrap();
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();

    // pthread_create allocates each thread's descriptor/TLS through calloc/malloc in
    // glibc, so the totals are at least the site's and at most a few KiB more per thread.
    let exact_calls = json["totals"]["exact_calls"].as_u64().unwrap();
    let exact_bytes = json["totals"]["exact_bytes"].as_u64().unwrap();
    assert!(
        (THREADS * CALLS..=THREADS * CALLS + 8 * THREADS).contains(&exact_calls),
        "{exact_calls} calls"
    );
    assert!(
        (THREADS * CALLS * SIZE..=THREADS * CALLS * SIZE + THREADS * 64 * 1024)
            .contains(&exact_bytes),
        "{exact_bytes} bytes"
    );

    // The site's estimate: bound derived in src/sites.rs (5 sd).
    let site = Site {
        function: "site_thread",
        allocations: &[(SIZE, THREADS * CALLS)],
        empty_calls: 0,
    };
    let estimated = estimated_bytes(&stacks_with(&json, "site_thread"));
    let truth = site.bytes() as f64;
    let sd = site.estimate_sd(RATE);
    println!(
        "site_thread: truth {truth} estimated {estimated:.0} ({:+.2} sd)",
        (estimated - truth) / sd
    );
    assert!(
        (estimated - truth).abs() <= 5.0 * sd,
        "estimated {estimated}, truth {truth}, sd {sd}"
    );
    json
}

#[test]
fn exited_threads_keep_their_totals_and_estimates_stay_unbiased() {
    let json = profile_threads("threads", &[]);
    assert_eq!(json["counters"]["thread_map_full"], 0);
}

/// One slot and four overflow entries for 17 threads: one thread gets the slot, four
/// the overflow map, the rest the per-CPU fallback. Totals stay exact and the estimate
/// unbiased on every path (docs/design.md, "Per-thread countdown").
#[test]
fn full_thread_tables_degrade_without_bias_or_loss() {
    let json = profile_threads(
        "threads-full",
        &["--thread-slots", "1", "--overflow-threads", "4"],
    );
    assert!(
        json["counters"]["thread_map_full"].as_u64().unwrap() > 0,
        "{:#}",
        json["counters"]
    );
}
