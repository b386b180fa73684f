//! End to end on the allocators real programs use: the sites workload under each of
//! Debian's jemalloc, tcmalloc and mimalloc (preloaded and linked) and under musl, and a
//! C++ workload whose `new`/`delete` go to each. allocbpf finds them by their symbols,
//! with no flag; every call is counted once (exact totals to the call and the byte);
//! every site's estimate lies within the 5-sd bound derived in `src/sites.rs`; no entry
//! is single-stepped.

use std::path::{Path, PathBuf};

use allocbpf_e2e::{
    allocators::{Allocator, ALLOCATORS},
    compile_source, compile_workload, profile_workload_env, require_root, scratch_dir,
    sites::{
        allocation_variance, check_site_list, check_sites, check_sites_counting_rejected, Site,
        TEST_RATE,
    },
    sites_binary, stacks_with, Finished,
};
use serde_json::Value;

/// Profiles one run of `binary` (with `env`) at [`TEST_RATE`] into JSON.
fn profile(name: &str, binary: &Path, env: &[(&str, &str)], extra: &[&str]) -> (Value, Finished) {
    require_root();
    let out = scratch_dir(name).join("profile.json");
    let rate = TEST_RATE.to_string();
    let mut args = vec![
        "--rate",
        rate.as_str(),
        "--format",
        "json",
        "--output",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let finished = profile_workload_env(binary, &[], env, &args).unwrap();
    let json = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    (json, finished)
}

/// The start-up line names `family`, and nothing is single-stepped.
fn check_startup(finished: &Finished, family: &str) {
    let startup = finished.startup_line();
    assert!(startup.contains(family), "{family} not named: {startup}");
    assert!(
        !finished.stderr.contains("single-steps"),
        "an entry is single-stepped: {}",
        finished.stderr
    );
}

#[test]
fn c_sites_under_each_preloaded_allocator() {
    let _one = allocbpf_e2e::one_profiler_at_a_time();
    for allocator in ALLOCATORS {
        let (json, finished) = profile(
            &format!("preload-{}", allocator.short()),
            &sites_binary(),
            &allocator.preload(),
            &[],
        );
        println!("{}: {:#}", allocator.family, json["totals"]);
        check_startup(&finished, allocator.family);
        check_sites(&json);
    }
}

/// `sites.c` linked against `allocator` (DT_NEEDED, the way redis links jemalloc).
fn sites_linked(allocator: &Allocator) -> PathBuf {
    compile_workload(
        "sites",
        &["-O1", "-g", "-fno-omit-frame-pointer", allocator.library],
    )
    .unwrap()
}

#[test]
fn c_sites_linked_against_each_allocator() {
    let _one = allocbpf_e2e::one_profiler_at_a_time();
    for allocator in ALLOCATORS {
        let binary = sites_linked(allocator);
        let (json, finished) = profile(&format!("linked-{}", allocator.short()), &binary, &[], &[]);
        check_startup(&finished, allocator.family);
        check_sites(&json);
    }
}

#[test]
fn c_sites_on_musl() {
    let _one = allocbpf_e2e::one_profiler_at_a_time();
    // Debian's musl: a dynamically linked program whose libc is
    // /usr/lib/x86_64-linux-musl/libc.so (no "libc.so.6" anywhere).
    let binary = compile_source(
        "sites.c",
        "musl-gcc",
        &["-O1", "-g", "-fno-omit-frame-pointer"],
    )
    .unwrap();
    let (json, finished) = profile("musl", &binary, &[], &["-v"]);
    check_startup(&finished, "musl");
    // musl's calloc is not probed (it only checks the size, calls malloc and clears):
    // site_calloc's stacks step through its frame by the rule derived from its code.
    assert!(
        finished
            .stderr
            .contains("calloc not probed: forwards to malloc"),
        "musl's calloc should be left to malloc's probe"
    );
    check_sites_counting_rejected(&json, false);
}

/// The sites of `newdelete.cpp`.
const CPP_SITES: &[Site] = &[
    Site {
        function: "site_new",
        allocations: &[(1024, 20_000)],
        empty_calls: 0,
    },
    Site {
        function: "site_new_array",
        allocations: &[(2048, 20_000)],
        empty_calls: 0,
    },
    Site {
        function: "site_new_nothrow",
        allocations: &[(4096, 10_000)],
        empty_calls: 0,
    },
    Site {
        function: "site_new_aligned",
        allocations: &[(1024, 10_000)],
        empty_calls: 0,
    },
    Site {
        function: "site_new_kept",
        allocations: &[(4096, 2_000)],
        empty_calls: 0,
    },
];

fn newdelete_binary() -> PathBuf {
    compile_source(
        "newdelete.cpp",
        "g++",
        &["-O1", "-g", "-fno-omit-frame-pointer", "-std=c++17"],
    )
    .unwrap()
}

/// Exact totals, every site, and with `--live` the in-use bytes: those of the kept
/// site within 5 sd of its 8,192,000 bytes (the bound of tests/tests/live.rs), zero
/// for the others, whose every block was deleted.
fn check_cpp(json: &Value) {
    assert_eq!(
        json["totals"]["exact_calls"], 62_000,
        "{:#}",
        json["totals"]
    );
    assert_eq!(json["totals"]["exact_bytes"], 120_832_000u64);
    assert_eq!(json["totals"]["drops"], 0);
    check_site_list(json, CPP_SITES);
    let inuse = |function: &str| -> f64 {
        stacks_with(json, function)
            .iter()
            .map(|s| s["inuse_bytes"].as_f64().unwrap())
            .sum()
    };
    let truth = 2000.0 * 4096.0;
    let sd = (2000.0 * allocation_variance(4096, TEST_RATE)).sqrt();
    let kept = inuse("site_new_kept");
    println!(
        "kept in use {kept:.0}, truth {truth} ({:+.2} sd)",
        (kept - truth) / sd
    );
    assert!((kept - truth).abs() <= 5.0 * sd, "{kept} vs {truth}");
    for site in CPP_SITES.iter().filter(|s| s.function != "site_new_kept") {
        assert_eq!(
            inuse(site.function),
            0.0,
            "{} deleted every block",
            site.function
        );
    }
    assert_eq!(json["live"]["untracked_samples"], 0, "{:#}", json["live"]);
}

#[test]
fn cpp_new_and_delete_under_libstdcxx_and_each_allocator() {
    let _one = allocbpf_e2e::one_profiler_at_a_time();
    let binary = newdelete_binary();
    // libstdc++'s operators forward to glibc's malloc and free: counted there, once.
    let (json, finished) = profile("cpp-glibc", &binary, &[], &["--live"]);
    check_startup(&finished, "glibc");
    check_cpp(&json);
    for allocator in ALLOCATORS {
        let (json, finished) = profile(
            &format!("cpp-{}", allocator.short()),
            &binary,
            &allocator.preload(),
            &["--live"],
        );
        check_startup(&finished, allocator.family);
        check_cpp(&json);
    }
}

/// Builds `tests/workloads/rustalloc` (its own workspace, locked) and returns `bin`.
fn rustalloc_binary(bin: &str) -> PathBuf {
    let root = allocbpf_e2e::workspace_root();
    let target = root.join("target/e2e/rustalloc");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = std::process::Command::new(cargo)
        .args([
            "build",
            "--release",
            "--locked",
            "--bin",
            bin,
            "--manifest-path",
        ])
        .arg(root.join("tests/workloads/rustalloc/Cargo.toml"))
        .arg("--target-dir")
        .arg(&target)
        .status()
        .expect("cargo");
    assert!(status.success(), "building rustalloc failed");
    target.join("release").join(bin)
}

/// The sites of `rustalloc/src/lib.rs`, through the global allocator.
const RUST_SITES: &[(&str, u64, u64)] = &[
    ("site_alloc", 1024, 20_000),
    ("site_zeroed", 4096, 10_000),
    ("site_aligned", 2048, 10_000),
    ("site_grow", 512, 10_000),
    ("site_grow", 2048, 10_000),
];

/// Exact totals to the call and the byte, and each site (Rust paths end in
/// `::site_x`) within 5 sd of its truth (the bound of `src/sites.rs`).
fn check_rust(json: &Value) {
    assert_eq!(
        json["totals"]["exact_calls"], 60_000,
        "{:#}",
        json["totals"]
    );
    assert_eq!(json["totals"]["exact_bytes"], 107_520_000u64);
    assert_eq!(json["totals"]["drops"], 0);
    let mut functions: Vec<&str> = RUST_SITES.iter().map(|s| s.0).collect();
    functions.dedup();
    for function in functions {
        let suffix = format!("::{function}");
        let stacks: Vec<&Value> = json["stacks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| {
                s["frames"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|f| f.as_str().is_some_and(|f| f.ends_with(&suffix)))
            })
            .collect();
        let estimated = allocbpf_e2e::estimated_bytes(&stacks);
        let (truth, variance) = RUST_SITES.iter().filter(|s| s.0 == function).fold(
            (0.0, 0.0),
            |(t, v), &(_, size, n)| {
                (
                    t + (size * n) as f64,
                    v + n as f64 * allocation_variance(size, TEST_RATE),
                )
            },
        );
        let sd = variance.sqrt();
        println!(
            "{function}: estimated {estimated:.0}, truth {truth} ({:+.2} sd)",
            (estimated - truth) / sd
        );
        assert!(
            (estimated - truth).abs() <= 5.0 * sd,
            "{function}: {estimated} vs {truth}"
        );
    }
}

#[test]
fn rust_programs_with_jemalloc_and_mimalloc_global_allocators() {
    let _one = allocbpf_e2e::one_profiler_at_a_time();
    // tikv-jemallocator links jemalloc statically with the `_rjem_` prefix; the mimalloc
    // crate calls mimalloc's own `mi_` API. Neither needs a flag.
    for (bin, family) in [("rust_jemalloc", "jemalloc"), ("rust_mimalloc", "mimalloc")] {
        let binary = rustalloc_binary(bin);
        let (json, finished) = profile(bin, &binary, &[], &[]);
        check_startup(&finished, family);
        check_rust(&json);
    }
}
