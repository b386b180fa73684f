//! `--live` and `--leaks` end to end: `workloads/leaks.c` through real probes (session
//! links on this kernel), and the sites workload's exact totals with live tracking on.
//!
//! Bounds: a kept site's in-use estimate is the sum of S/p(S) over its sampled blocks
//! still live, an unbiased estimate of its live bytes with variance
//! sum S^2 (1-p)/p over those blocks (docs/statistics.md); the check is 5 sd (two-sided
//! normal tail 6e-7, every kept site expects >= 60 live samples). A site whose blocks
//! are all freed must show exactly 0 in use: every sampled block's free is seen.

use allocbpf_e2e::{
    allocators::{Allocator, ALLOCATORS},
    compile_workload, estimated_bytes, go_pprof, profile_to_completion, profile_workload_env,
    require_root, scratch_dir,
    sites::{allocation_variance, totals, TEST_RATE},
    sites_binary, stacks_with,
};
use serde_json::Value;

/// Kept sites of leaks.c: (function, blocks live at the end, their size).
const KEPT: &[(&str, u64, u64)] = &[
    ("leak_site", 5120, 4096),
    ("realloc_kept", 1000, 16384),
    ("calloc_kept", 2000, 4096),
    ("memalign_kept", 2000, 4096),
    ("aligned_kept", 500, 8192),
];
/// Sites of leaks.c that free every block.
const FREED: &[&str] = &[
    "churn_site",
    "realloc_freed",
    "calloc_freed",
    "memalign_freed",
];

fn leaks_binary() -> std::path::PathBuf {
    compile_workload("leaks", &["-O1", "-g", "-fno-omit-frame-pointer"]).unwrap()
}

fn sum(stacks: &[&Value], key: &str) -> f64 {
    stacks.iter().map(|s| s[key].as_f64().unwrap_or(0.0)).sum()
}

#[test]
fn inuse_and_leaks_name_the_kept_sites() {
    check_leaks("auto", "uprobe session links", None);
}

/// The fallback for kernels without session links gives the same figures.
#[test]
fn the_uretprobe_fallback_tracks_the_same_blocks() {
    check_leaks("uretprobe", "uretprobes on every allocation call", None);
}

/// The same figures when the workload's malloc, realloc, calloc, posix_memalign,
/// aligned_alloc and free are jemalloc's, tcmalloc's or mimalloc's (preloaded).
#[test]
fn inuse_and_leaks_under_each_preloaded_allocator() {
    for allocator in ALLOCATORS {
        check_leaks("auto", "uprobe session links", Some(allocator));
    }
}

fn check_leaks(mechanism: &str, expected_log: &str, allocator: Option<&Allocator>) {
    require_root();
    let name = allocator.map_or("glibc", |a| a.short());
    let out = scratch_dir(&format!("live-{mechanism}-{name}")).join("leaks.json");
    let env = allocator.map(|a| a.preload());
    let finished = profile_workload_env(
        &leaks_binary(),
        &[],
        env.as_ref().map_or(&[][..], |e| &e[..]),
        &[
            "--rate",
            "64KiB",
            "--leaks",
            "--min-age",
            "200ms",
            "--live-mechanism",
            mechanism,
            "--format",
            "json",
            "--output",
            out.to_str().unwrap(),
        ],
    )
    .unwrap();
    assert!(
        finished.stderr.contains(expected_log),
        "{}",
        finished.stderr
    );
    let json: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    // Exact totals are unchanged by live tracking.
    assert_eq!(
        json["totals"]["exact_calls"], 70_820,
        "{:#}",
        json["totals"]
    );
    assert_eq!(json["totals"]["exact_bytes"], 310_558_720u64);
    assert_eq!(json["totals"]["drops"], 0);
    assert_eq!(json["live"]["untracked_samples"], 0, "{:#}", json["live"]);
    assert_eq!(json["counters"]["live_map_full"], 0);

    for &(function, blocks, size) in KEPT {
        let stacks = stacks_with(&json, function);
        let inuse = sum(&stacks, "inuse_bytes");
        let truth = (blocks * size) as f64;
        let sd = (blocks as f64 * allocation_variance(size, TEST_RATE)).sqrt();
        println!(
            "{name}: {function:<14} in use {inuse:>12.0}, truth {truth:>10} ({:+.2} sd)",
            (inuse - truth) / sd
        );
        assert!(
            (inuse - truth).abs() <= 5.0 * sd,
            "{function}: {inuse} vs {truth}"
        );
    }
    for function in FREED {
        let stacks = stacks_with(&json, function);
        assert!(!stacks.is_empty(), "{function} was sampled");
        assert!(estimated_bytes(&stacks) > 0.0);
        assert_eq!(
            sum(&stacks, "inuse_bytes"),
            0.0,
            "{function}: every block was freed"
        );
    }

    // The leak report: exactly the kept sites, each with all its in-use bytes (they are
    // all older than 200 ms: the workload sleeps 400 ms before exiting).
    let leaks = json["leaks"].as_array().expect("leaks");
    let leaked = |function: &str| -> Vec<&Value> {
        leaks
            .iter()
            .filter(|l| {
                l["frames"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|f| f == function)
            })
            .collect()
    };
    for &(function, _, _) in KEPT {
        let groups = leaked(function);
        assert!(!groups.is_empty(), "{function} not reported as a leak");
        let inuse = sum(&stacks_with(&json, function), "inuse_bytes");
        assert!((sum(&groups, "estimated_bytes") - inuse).abs() < 1.0);
        for g in groups {
            assert!(g["min_age_seconds"].as_f64().unwrap() >= 0.2, "{g:#}");
        }
    }
    for function in FREED {
        assert!(leaked(function).is_empty(), "{function} reported as a leak");
    }
}

#[test]
fn go_tool_pprof_reads_inuse_profiles() {
    require_root();
    let dir = scratch_dir("live-pprof");
    let path = dir.join("live.pb.gz");
    profile_to_completion(
        &leaks_binary(),
        &[
            "--rate",
            "64KiB",
            "--live",
            "--format",
            "pprof",
            "--output",
            path.to_str().unwrap(),
        ],
    )
    .unwrap();
    let top = go_pprof(&["-top", "-sample_index=inuse_space"], &path, &dir);
    println!("{top}");
    assert!(top.contains("Type: inuse_space"), "{top}");
    assert!(top.contains("leak_site"), "{top}");
    assert!(
        !top.contains("churn_site"),
        "freed blocks are not in use:\n{top}"
    );
}

/// Live tracking must not change what is counted: the sites workload (glibc forwarding
/// realloc(NULL) and reallocarray, aligned_alloc == memalign) keeps its exact totals,
/// and its process exits while profiled.
#[test]
fn exact_totals_hold_with_live_tracking() {
    require_root();
    let out = scratch_dir("live-sites").join("sites.json");
    profile_to_completion(
        &sites_binary(),
        &[
            "--rate",
            "64KiB",
            "--live",
            "--format",
            "json",
            "--output",
            out.to_str().unwrap(),
        ],
    )
    .unwrap();
    let json: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let (bytes, calls) = totals();
    assert_eq!(json["totals"]["exact_bytes"], bytes, "{:#}", json["totals"]);
    assert_eq!(json["totals"]["exact_calls"], calls, "{:#}", json["totals"]);
    assert!(json["totals"]["inuse_bytes"].is_number());
    assert_eq!(json["live"]["untracked_samples"], 0);
}
