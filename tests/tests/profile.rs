//! End to end: profile `workloads/sites.c` through real uprobes and check every site's
//! name, its estimate against the bound derived in `src/sites.rs`, the exact totals to
//! the byte, and that `go tool pprof` reads the pprof output.

use std::{process::Command, time::Duration};

use allocbpf_e2e::{
    compile_workload, require_root, scratch_dir,
    sites::{totals, SITES, TEST_RATE},
    Profiler, Workload,
};
use serde_json::Value;

/// Profiles one run of the sites workload; returns allocbpf's JSON and the pprof path.
fn profile_sites(name: &str) -> (Value, std::path::PathBuf, String) {
    require_root();
    let binary = compile_workload("sites", &["-O1", "-g", "-fno-omit-frame-pointer"]).unwrap();
    let dir = scratch_dir(name);
    let mut workload = Workload::start(&binary, &[]).unwrap();
    let pid = workload.pid.to_string();
    let rate = TEST_RATE.to_string();
    let json_path = dir.join("profile.json");
    let json_arg = json_path.to_str().unwrap();
    let profiler = Profiler::attach(&[
        "--pid", &pid, "--rate", &rate, "--format", "json", "--output", json_arg,
    ])
    .unwrap();
    workload.go().unwrap();
    workload.wait(Duration::from_secs(120)).unwrap();
    // The target's exit stops the profiler, which then writes what it collected.
    let finished = profiler.finish(Duration::from_secs(60)).unwrap();
    assert_eq!(
        finished.code,
        Some(0),
        "allocbpf failed: {}",
        finished.stderr
    );
    assert!(
        finished.stderr.contains("target exited"),
        "{}",
        finished.stderr
    );
    let json: Value = serde_json::from_slice(&std::fs::read(&json_path).unwrap()).unwrap();
    (json, dir, finished.stderr)
}

fn site_stacks<'a>(json: &'a Value, function: &str) -> Vec<&'a Value> {
    json["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| {
            s["frames"]
                .as_array()
                .unwrap()
                .iter()
                .any(|f| f.as_str() == Some(function))
        })
        .collect()
}

#[test]
fn sites_are_named_and_estimates_fall_within_derived_bounds() {
    let (json, _, _) = profile_sites("estimates");
    assert_eq!(json["rate"], TEST_RATE);

    // Exact totals count each call once, even where glibc forwards one probed function
    // to another (realloc(NULL) -> malloc, reallocarray -> realloc -> malloc).
    let (bytes, calls) = totals();
    assert_eq!(json["totals"]["exact_bytes"], bytes, "{:#}", json["totals"]);
    assert_eq!(json["totals"]["exact_calls"], calls, "{:#}", json["totals"]);
    assert_eq!(json["totals"]["drops"], 0);

    for site in SITES {
        let stacks = site_stacks(&json, site.function);
        let estimated: f64 = stacks
            .iter()
            .map(|s| s["estimated_bytes"].as_f64().unwrap())
            .sum();
        let samples: u64 = stacks.iter().map(|s| s["samples"].as_u64().unwrap()).sum();
        let truth = site.bytes() as f64;
        let sd = site.estimate_sd(TEST_RATE);
        let (mean_samples, sd_samples) = site.samples_mean_sd(TEST_RATE);
        println!(
            "{:<18} truth {:>11} estimated {:>13.0} ({:+.2} sd)  samples {:>5} (expected {:.0})",
            site.function,
            truth,
            estimated,
            if sd > 0.0 {
                (estimated - truth) / sd
            } else {
                0.0
            },
            samples,
            mean_samples
        );
        if site.bytes() == 0 {
            assert!(stacks.is_empty(), "{} allocates nothing", site.function);
            continue;
        }
        assert!(
            !stacks.is_empty(),
            "{} missing from the profile",
            site.function
        );
        // Bound: 5 standard deviations of the estimator (derivation in src/sites.rs).
        assert!(
            (estimated - truth).abs() <= 5.0 * sd + 0.5,
            "{}: estimated {estimated}, truth {truth}, sd {sd}",
            site.function
        );
        assert!(
            (samples as f64 - mean_samples).abs() <= 5.0 * sd_samples + 0.5,
            "{}: {samples} samples, expected {mean_samples} +- {sd_samples}",
            site.function
        );
        // Every stack of the site is complete: site < run_sites < main.
        for stack in &stacks {
            let frames: Vec<&str> = stack["frames"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| f.as_str().unwrap())
                .collect();
            let at = frames.iter().position(|f| *f == site.function).unwrap();
            assert!(at >= 2, "{frames:?}");
            assert_eq!(&frames[at - 2..at], ["main", "run_sites"], "{frames:?}");
            assert_eq!(
                at,
                frames.len() - 1,
                "allocation site is innermost: {frames:?}"
            );
        }
    }
}

#[test]
fn go_tool_pprof_reads_the_profile_and_names_the_sites() {
    require_root();
    let binary = compile_workload("sites", &["-O1", "-g", "-fno-omit-frame-pointer"]).unwrap();
    let dir = scratch_dir("pprof");
    let mut workload = Workload::start(&binary, &[]).unwrap();
    let pid = workload.pid.to_string();
    let pprof_path = dir.join("profile.pb.gz");
    let profiler = Profiler::attach(&[
        "--pid",
        &pid,
        "--rate",
        "64KiB",
        "--format",
        "pprof",
        "--output",
        pprof_path.to_str().unwrap(),
    ])
    .unwrap();
    workload.go().unwrap();
    workload.wait(Duration::from_secs(120)).unwrap();
    let finished = profiler.finish(Duration::from_secs(60)).unwrap();
    assert_eq!(finished.code, Some(0), "{}", finished.stderr);

    let output = Command::new("go")
        .args(["tool", "pprof", "-top", "-sample_index=alloc_space"])
        .arg(&pprof_path)
        .env("PPROF_TMPDIR", &dir)
        .env("HOME", &dir)
        .output()
        .expect("go tool pprof (apt-get install golang-go)");
    let top = String::from_utf8_lossy(&output.stdout);
    println!("{top}");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(top.contains("Type: alloc_space"), "{top}");
    for site in SITES.iter().filter(|s| s.bytes() > 0) {
        assert!(
            top.contains(site.function),
            "{} missing:\n{top}",
            site.function
        );
    }
    // Debug info reaches pprof as file:line.
    let lines = Command::new("go")
        .args(["tool", "pprof", "-top", "-lines"])
        .arg(&pprof_path)
        .env("PPROF_TMPDIR", &dir)
        .env("HOME", &dir)
        .output()
        .unwrap();
    let lines = String::from_utf8_lossy(&lines.stdout);
    assert!(
        lines.contains("site_small ") && lines.contains("sites.c:"),
        "{lines}"
    );
    // The raw view shows the mapping with its build id.
    let raw = Command::new("go")
        .args(["tool", "pprof", "-raw"])
        .arg(&pprof_path)
        .env("PPROF_TMPDIR", &dir)
        .env("HOME", &dir)
        .output()
        .unwrap();
    let raw = String::from_utf8_lossy(&raw.stdout);
    assert!(
        raw.contains("sites-"),
        "mapping of the workload binary:\n{raw}"
    );
    assert!(
        raw.contains("libc.so.6") || raw.contains("Mappings"),
        "{raw}"
    );
}

#[test]
fn every_format_is_written() {
    require_root();
    let binary = compile_workload("sites", &["-O1", "-g", "-fno-omit-frame-pointer"]).unwrap();
    let dir = scratch_dir("formats");
    for format in ["text", "folded", "svg"] {
        let mut workload = Workload::start(&binary, &[]).unwrap();
        let pid = workload.pid.to_string();
        let path = dir.join(format!("profile.{format}"));
        let profiler = Profiler::attach(&[
            "--pid",
            &pid,
            "--rate",
            "256KiB",
            "--format",
            format,
            "--output",
            path.to_str().unwrap(),
        ])
        .unwrap();
        workload.go().unwrap();
        workload.wait(Duration::from_secs(120)).unwrap();
        let finished = profiler.finish(Duration::from_secs(60)).unwrap();
        assert_eq!(finished.code, Some(0), "{format}: {}", finished.stderr);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("site_small"), "{format}:\n{text}");
        match format {
            "text" => assert!(
                text.contains("of exactly 357.6 MiB in 175017 calls"),
                "{text}"
            ),
            "folded" => assert!(
                text.lines()
                    .any(|l| l.contains(";main;run_sites;site_small ")),
                "{text}"
            ),
            _ => assert!(text.starts_with("<?xml"), "{text}"),
        }
    }
}
