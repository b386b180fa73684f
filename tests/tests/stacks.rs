//! Complete stacks for binaries without frame pointers, end to end: C built
//! `-O2 -fomit-frame-pointer` through Debian's glibc (no frame pointers either), C++
//! through libstdc++'s operator new, Rust through the system allocator, an inlined
//! function, a short-lived process, a deleted binary, unsymbolized profiles, and a
//! comparison with gdb's backtrace.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use allocbpf_e2e::{
    attach_json, compile_source, gnu_build_id, go_pprof, profile_workload, require_root,
    scratch_dir, stacks_with, Workload,
};
use serde_json::Value;

/// The C chain, outermost first, as the profile must show it.
const C_CHAIN: [&str; 6] = [
    "main",
    "chain_one",
    "chain_two",
    "inlined_step",
    "chain_three",
    "chain_four",
];

fn c_binary() -> PathBuf {
    compile_source("stacks.c", "gcc", &["-O2", "-fomit-frame-pointer", "-g"]).unwrap()
}

/// Profiles `binary` (with `workload_args`) at 64 KiB with `extra` allocbpf arguments.
fn profile(name: &str, binary: &Path, workload_args: &[&str], extra: &[&str]) -> Value {
    require_root();
    let out = scratch_dir(name).join("profile.json");
    let mut args = vec!["--rate", "64KiB", "--format", "json", "--output"];
    args.push(out.to_str().unwrap());
    args.extend_from_slice(extra);
    profile_workload(binary, workload_args, &args).unwrap();
    serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap()
}

fn frames(stack: &Value) -> Vec<&str> {
    stack["frames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap())
        .collect()
}

/// True if `expected` appears in `frames` in this order, consecutively.
fn has_run(frames: &[&str], expected: &[&str]) -> bool {
    frames.windows(expected.len()).any(|w| w == expected)
}

/// Every sample of the stacks through `innermost` (weighted by samples) carries the
/// whole of `chain`, in order.
fn assert_complete(json: &Value, innermost: &str, chain: &[&str]) {
    let stacks = stacks_with(json, innermost);
    let total: u64 = stacks.iter().map(|s| s["samples"].as_u64().unwrap()).sum();
    assert!(total >= 100, "only {total} samples through {innermost}");
    for stack in &stacks {
        let f = frames(stack);
        assert!(has_run(&f, chain), "incomplete stack: {f:?}");
        assert!(!f.iter().any(|n| n.starts_with("[unknown")), "{f:?}");
    }
}

#[test]
fn c_without_frame_pointers_has_the_whole_chain() {
    let json = profile("stacks-auto", &c_binary(), &[], &[]);
    assert_complete(&json, "chain_four", &C_CHAIN);
    // The allocation site is the innermost frame.
    for stack in stacks_with(&json, "chain_four") {
        assert_eq!(frames(stack).last(), Some(&"chain_four"));
    }
}

#[test]
fn dwarf_mode_unwinds_the_same_chain() {
    let json = profile("stacks-dwarf", &c_binary(), &[], &["--unwind", "dwarf"]);
    assert_complete(&json, "chain_four", &C_CHAIN);
}

/// Frame pointers (the kernel's walk) cannot see past the first frame without them,
/// but the immediate caller, read at [sp], is still right.
#[test]
fn frame_pointer_mode_keeps_the_immediate_caller() {
    let json = profile("stacks-fp", &c_binary(), &[], &["--unwind", "fp"]);
    let stacks = stacks_with(&json, "chain_four");
    assert!(!stacks.is_empty());
    for stack in stacks {
        let f = frames(stack);
        assert_eq!(f.last(), Some(&"chain_four"), "{f:?}");
        assert!(!has_run(&f, &C_CHAIN), "fp unexpectedly complete: {f:?}");
    }
}

#[test]
fn cpp_operator_new_is_demangled_and_complete() {
    let binary = compile_source(
        "stacks_cpp.cpp",
        "g++",
        &["-O2", "-fomit-frame-pointer", "-g"],
    )
    .unwrap();
    let json = profile("stacks-cpp", &binary, &[], &[]);
    assert_complete(
        &json,
        "widgets::Factory::make(int)",
        &[
            "main",
            "widgets::build_all(int)",
            "widgets::Factory::make(int)",
            "operator new(unsigned long)",
        ],
    );
}

#[test]
fn rust_system_allocator_is_demangled_and_complete() {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let binary = compile_source(
        "stacks_rust.rs",
        &rustc,
        &["-O", "-g", "-C", "force-frame-pointers=no"],
    )
    .unwrap();
    let json = profile("stacks-rust", &binary, &[], &[]);
    let stacks = stacks_with(&json, "stacks_rust::alloc_chain::inner");
    let total: u64 = stacks.iter().map(|s| s["samples"].as_u64().unwrap()).sum();
    assert!(total >= 100, "{total} samples");
    for stack in stacks {
        let f = frames(stack);
        let at = |name: &str| f.iter().position(|n| *n == name);
        let (main, outer, inner) = (
            at("stacks_rust::main").expect("main"),
            at("stacks_rust::alloc_chain::outer").expect("outer"),
            at("stacks_rust::alloc_chain::inner").expect("inner"),
        );
        assert!(main < outer && outer < inner, "{f:?}");
        assert!(
            f.iter()
                .any(|n| n.starts_with("alloc::vec::Vec<T>::with_capacity")),
            "demangled std frames: {f:?}"
        );
    }
}

/// A process that allocates for 50 ms and exits is symbolized after its exit.
#[test]
fn a_short_lived_process_is_fully_symbolized() {
    let json = profile("stacks-short", &c_binary(), &["short"], &[]);
    let stacks = stacks_with(&json, "chain_four");
    let total: u64 = stacks.iter().map(|s| s["samples"].as_u64().unwrap()).sum();
    assert!(total >= 5, "{total} samples in 50 ms");
    for stack in stacks {
        assert!(has_run(&frames(stack), &C_CHAIN), "{:?}", frames(stack));
    }
}

/// gdb's backtrace at the allocation (an independent unwinder, with its own DWARF
/// reader and inline-frame support) names the same functions in the same order.
#[test]
fn stacks_match_gdb_backtraces() {
    require_root();
    let binary = c_binary();
    let dir = scratch_dir("stacks-gdb");
    let go = dir.join("go.txt");
    std::fs::write(&go, "go\n").unwrap();
    let output = Command::new("gdb")
        .args(["-batch", "-nx", "-ex", "break chain_four", "-ex"])
        .arg(format!("run < {}", go.display()))
        .args(["-ex", "bt"])
        .arg(&binary)
        .output()
        .expect("gdb (apt-get install gdb)");
    let text = String::from_utf8_lossy(&output.stdout);
    // "#0  chain_four (size=...) at ..." / "#3  0x... in chain_two (...) at ...".
    let mut from_gdb: Vec<String> = text
        .lines()
        .filter(|l| l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.split_once(' ')?.1.trim_start();
            let rest = rest.split_once(" in ").map_or(rest, |(_, r)| r);
            Some(rest.split_whitespace().next()?.to_string())
        })
        .collect();
    from_gdb.reverse(); // outermost first, like the profile
    assert!(
        from_gdb.ends_with(&C_CHAIN.map(String::from)),
        "gdb: {text}"
    );

    let json = profile("stacks-vs-gdb", &binary, &[], &[]);
    for stack in stacks_with(&json, "chain_four") {
        let ours = frames(stack);
        let from_main = &ours[ours.iter().position(|n| *n == "main").unwrap()..];
        assert_eq!(
            from_main,
            &from_gdb[from_gdb.len() - from_main.len()..],
            "gdb: {from_gdb:?}"
        );
    }
}

/// A binary deleted after it started is still unwound and symbolized: its file is read
/// through /proc/PID/map_files while the process lives.
#[test]
fn a_deleted_binary_is_still_symbolized() {
    require_root();
    let dir = scratch_dir("stacks-deleted");
    let copy = dir.join("stacks-deleted");
    std::fs::copy(c_binary(), &copy).unwrap();
    let mut workload = Workload::start(&copy, &[]).unwrap();
    std::fs::remove_file(&copy).unwrap();
    let out = dir.join("profile.json");
    let profiler = attach_json(&workload, &out).unwrap();
    workload.go().unwrap();
    workload.wait(Duration::from_secs(60)).unwrap();
    let finished = profiler.finish(Duration::from_secs(60)).unwrap();
    assert_eq!(finished.code, Some(0), "{}", finished.stderr);
    let json: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_complete(&json, "chain_four", &C_CHAIN);
}

/// `--no-symbolize`: a pprof profile with addresses and build ids only, for a remote
/// symbolizer.
#[test]
fn unsymbolized_profiles_carry_addresses_and_build_ids() {
    require_root();
    let dir = scratch_dir("stacks-unsymbolized");
    let path = dir.join("profile.pb.gz");
    profile_workload(
        &c_binary(),
        &[],
        &[
            "--rate",
            "64KiB",
            "--no-symbolize",
            "--format",
            "pprof",
            "--output",
            path.to_str().unwrap(),
        ],
    )
    .unwrap();
    let raw = go_pprof(&["-raw"], &path, &dir);
    assert!(!raw.contains("chain_four"), "symbolized anyway:\n{raw}");
    let build_id = gnu_build_id(&c_binary());
    assert!(
        raw.contains(&build_id),
        "no mapping with {build_id}:\n{raw}"
    );
}
