//! End to end: profile `workloads/sites.c` through real uprobes and check every site's
//! name, its estimate against the bound derived in `src/sites.rs`, the exact totals to
//! the byte, and that `go tool pprof` reads the pprof output.

use allocbpf_e2e::{
    estimated_bytes, gnu_build_id, go_pprof, profile_to_completion, require_root, scratch_dir,
    sites::{totals, SITES, TEST_RATE},
    sites_binary, stacks_with,
};
use serde_json::Value;

/// Profiles one run of the sites workload at `TEST_RATE`; returns the JSON profile.
fn profile_sites(name: &str) -> Value {
    require_root();
    let json_path = scratch_dir(name).join("profile.json");
    let rate = TEST_RATE.to_string();
    let json_arg = json_path.to_str().unwrap();
    profile_to_completion(
        &sites_binary(),
        &["--rate", &rate, "--format", "json", "--output", json_arg],
    )
    .unwrap();
    serde_json::from_slice(&std::fs::read(&json_path).unwrap()).unwrap()
}

#[test]
fn sites_are_named_and_estimates_fall_within_derived_bounds() {
    let json = profile_sites("estimates");
    assert_eq!(json["rate"], TEST_RATE);

    // Exact totals count each call once, even where glibc forwards one probed function
    // to another (realloc(NULL) -> malloc, reallocarray -> realloc -> malloc).
    let (bytes, calls) = totals();
    assert_eq!(json["totals"]["exact_bytes"], bytes, "{:#}", json["totals"]);
    assert_eq!(json["totals"]["exact_calls"], calls, "{:#}", json["totals"]);
    assert_eq!(json["totals"]["drops"], 0);
    let total_ci = json["totals"]["bytes_ci95"]
        .as_array()
        .expect("totals.bytes_ci95");
    assert!(total_ci[0].as_f64() <= total_ci[1].as_f64());
    assert_eq!(json["confidence"], 0.95);

    for site in SITES {
        let stacks = stacks_with(&json, site.function);
        let estimated = estimated_bytes(&stacks);
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
        // Every stack carries an ordered 95% interval; a site of certain allocations
        // only (site_large) has its exact bytes as the lower end.
        for stack in &stacks {
            let ci = stack["bytes_ci95"].as_array().expect("bytes_ci95");
            let (lo, hi) = (ci[0].as_f64().unwrap(), ci[1].as_f64().unwrap());
            assert!(0.0 < lo && lo <= hi, "{stack:#}");
            if sd == 0.0 {
                assert_eq!(lo, truth, "{stack:#}");
            }
        }
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
    let dir = scratch_dir("pprof");
    let pprof_path = dir.join("profile.pb.gz");
    profile_to_completion(
        &sites_binary(),
        &[
            "--rate",
            "64KiB",
            "--format",
            "pprof",
            "--output",
            pprof_path.to_str().unwrap(),
        ],
    )
    .unwrap();

    let top = go_pprof(&["-top", "-sample_index=alloc_space"], &pprof_path, &dir);
    println!("{top}");
    assert!(top.contains("Type: alloc_space"), "{top}");
    for site in SITES.iter().filter(|s| s.bytes() > 0) {
        assert!(
            top.contains(site.function),
            "{} missing:\n{top}",
            site.function
        );
    }
    // Debug info reaches pprof as file:line.
    let lines = go_pprof(&["-top", "-lines"], &pprof_path, &dir);
    assert!(
        lines.contains("site_small ") && lines.contains("sites.c:"),
        "{lines}"
    );
    // The mappings carry the workload binary's GNU build id.
    let raw = go_pprof(&["-raw"], &pprof_path, &dir);
    // Confidence intervals travel as numeric sample labels that pprof keeps.
    let tags = go_pprof(&["-tags"], &pprof_path, &dir);
    for key in ["bytes_ci95_low", "bytes_ci95_high"] {
        assert!(tags.contains(key), "{key} missing:\n{tags}");
    }
    let build_id = gnu_build_id(&sites_binary());
    assert!(
        raw.lines()
            .any(|l| l.contains("sites-") && l.contains(&build_id)),
        "no mapping with build id {build_id}:\n{raw}"
    );
}

#[test]
fn every_format_is_written() {
    require_root();
    let binary = sites_binary();
    let dir = scratch_dir("formats");
    for format in ["text", "folded", "svg"] {
        let path = dir.join(format!("profile.{format}"));
        profile_to_completion(
            &binary,
            &[
                "--rate",
                "256KiB",
                "--confidence",
                "0.9",
                "--format",
                format,
                "--output",
                path.to_str().unwrap(),
            ],
        )
        .unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("site_small"), "{format}:\n{text}");
        match format {
            "text" => assert!(
                text.contains("of exactly 357.6 MiB in 175017 calls") && text.contains("90% CI"),
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
