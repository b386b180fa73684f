//! CPython end to end: Debian's `python3.11` (the interpreter linked into a stripped
//! executable) running `workloads/python_sites.py` under the real allocbpf. Its
//! samples carry the Python frames of the thread that allocated, merged into the
//! native stack where the eval loop ran them.

use std::time::Duration;

use allocbpf_e2e::{attach_json, require_root, scratch_dir, workspace_root, Workload};
use anyhow::Result;
use serde_json::Value;

/// Stacks (outermost first) of the profile that contain `function`.
fn stacks_with<'a>(profile: &'a Value, function: &str) -> Vec<&'a Value> {
    profile["stacks"]
        .as_array()
        .map(|stacks| {
            stacks
                .iter()
                .filter(|s| {
                    s["frames"]
                        .as_array()
                        .is_some_and(|f| f.iter().any(|name| name == function))
                })
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn debian_python_stacks_name_the_python_functions() -> Result<()> {
    require_root();
    let script = workspace_root().join("tests/workloads/python_sites.py");
    let dir = scratch_dir("python");
    let out = dir.join("profile.json");
    let mut workload = Workload::start(
        std::path::Path::new("/usr/bin/python3.11"),
        &[script.to_str().unwrap(), "300"],
    )?;
    let profiler = attach_json(&workload, &out)?;
    workload.go()?;
    workload.wait(Duration::from_secs(120))?;
    let finished = profiler.finish(Duration::from_secs(60))?;
    assert_eq!(finished.code, Some(0), "{}", finished.stderr);
    let profile: Value = serde_json::from_slice(&std::fs::read(&out)?)?;
    // bytes(4000) reaches malloc through PyObject_Calloc: counted once, under the
    // Python function that made it, which `main` called.
    for site in ["large_bytes", "small_dicts", "small_bytes"] {
        let stacks = stacks_with(&profile, site);
        assert!(!stacks.is_empty(), "no stack names {site}: {profile}");
        let frames = stacks[0]["frames"].as_array().unwrap();
        let main = frames.iter().position(|f| f == "main");
        let at = frames.iter().position(|f| f == site);
        assert!(
            main < at && main.is_some(),
            "{site} not under main: {frames:?}"
        );
    }
    let large: f64 = stacks_with(&profile, "large_bytes")
        .iter()
        .map(|s| s["estimated_bytes"].as_f64().unwrap_or(0.0))
        .sum();
    let small: f64 = stacks_with(&profile, "small_bytes")
        .iter()
        .map(|s| s["estimated_bytes"].as_f64().unwrap_or(0.0))
        .sum();
    // 300 rounds x 100 objects of ~4 KiB: 120 MB, far more than the small sites.
    assert!(
        large > 50e6 && large > small,
        "large {large}, small {small}"
    );
    Ok(())
}
