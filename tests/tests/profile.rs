//! End to end: profile `workloads/sites.c` through real uprobes and check every site's
//! name, its estimate against the bound derived in `src/sites.rs`, the exact totals to
//! the byte, and that `go tool pprof` reads the pprof output.

use allocbpf_e2e::{
    gnu_build_id, go_pprof, profile_to_completion, require_root, scratch_dir,
    sites::{check_sites, SITES, TEST_RATE},
    sites_binary,
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
    let _one = allocbpf_e2e::one_profiler_at_a_time();
    check_sites(&profile_sites("estimates"));
}

#[test]
fn go_tool_pprof_reads_the_profile_and_names_the_sites() {
    let _one = allocbpf_e2e::one_profiler_at_a_time();
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
    let _one = allocbpf_e2e::one_profiler_at_a_time();
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

/// System-wide with a filter nothing matches: every format is still a valid, empty
/// profile that says why (a 0-byte file broke every consumer), and the run succeeds.
#[test]
fn a_filter_that_matches_nothing_gives_a_valid_empty_profile_in_every_format() {
    let _one = allocbpf_e2e::one_profiler_at_a_time();
    require_root();
    let dir = scratch_dir("empty-formats");
    for format in ["json", "pprof", "text", "folded", "svg"] {
        let path = dir.join(format!("empty.{format}"));
        let finished = allocbpf_e2e::run_allocbpf(
            &[
                "--comm",
                "^no-such-process-allocbpf$",
                "--duration",
                "1s",
                "--format",
                format,
                "--output",
                path.to_str().unwrap(),
            ],
            std::time::Duration::from_secs(90),
        )
        .unwrap();
        assert_eq!(finished.code, Some(0), "{format}: {}", finished.stderr);
        assert!(finished
            .stderr
            .contains("no profiled process allocated anything"));
        let bytes = std::fs::read(&path).unwrap();
        match format {
            "json" => {
                let json: Value = serde_json::from_slice(&bytes).unwrap();
                assert_eq!(json["stacks"].as_array().map(Vec::len), Some(0));
                assert_eq!(json["note"], "no profiled process allocated anything");
            }
            "pprof" => {
                let raw = go_pprof(&["-raw"], &path, &dir);
                assert!(raw.contains("PeriodType: space bytes"), "{raw}");
            }
            "svg" => assert!(String::from_utf8_lossy(&bytes).contains("</svg>")),
            "text" => assert!(String::from_utf8_lossy(&bytes).contains("note:")),
            // Folded stacks of nothing: no line.
            _ => assert!(bytes.is_empty()),
        }
    }
}
