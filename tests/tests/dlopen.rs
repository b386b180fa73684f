//! End to end: an allocator `dlopen`ed after its process was examined is probed. The
//! `late_dlopen` workload starts on glibc, is examined by allocbpf, and 2 s after it is
//! told to go `dlopen`s a private copy of Debian's mimalloc (a file no other process
//! maps, so nothing attached it before) and allocates through its `mi_malloc` alone.
//! allocbpf must find the new image by re-reading the process's maps (every
//! [`RESCAN_PERIOD`]) and count its calls, system-wide with `--comm` and with `--pid`.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use allocbpf_e2e::{
    allocators::ALLOCATORS, compile_workload, profile_workload, require_root, scratch_dir,
    stacks_with, Finished, Profiler, Workload,
};
use serde_json::Value;

/// allocbpf re-reads each followed process's maps this often
/// (`allocbpf_collect::engine::MAPS_RESCAN_INTERVAL`).
const RESCAN_PERIOD: Duration = Duration::from_secs(5);

/// How late after the `dlopen` the image may be probed at most: a process's turn
/// comes once per round of [`RESCAN_PERIOD`], but its place in a round may move (from
/// first to last as processes come and go), so two periods; plus 1 s for examining
/// and attaching the image and for late housekeeping ticks on a loaded host.
const LATE: Duration = Duration::from_secs(2 * RESCAN_PERIOD.as_secs() + 1);

/// How long the workload allocates through mimalloc: [`LATE`], then 5 s that must be
/// counted.
const MI_SECONDS: u64 = LATE.as_secs() + 5;

/// Bytes per `mi_malloc` call.
const MI_SIZE: u64 = 16384;

/// One `mi_malloc` call per this many microseconds (16 MB/s).
const MI_PERIOD_US: u64 = 1000;

/// The glibc phase's volume (`GLIBC_CALLS` x `GLIBC_SIZE` in `late_dlopen.c`).
const GLIBC_BYTES: u64 = 100 * 4096;

/// Room above the workload's own calls for what its runtime allocates meanwhile
/// (stdio buffers, the dynamic loader's records for the new library).
const SLACK_BYTES: u64 = 4 << 20;

/// The workload, built with frame pointers and debug info (`mi_site` named in stacks).
fn late_dlopen_binary() -> PathBuf {
    compile_workload(
        "late_dlopen",
        &["-O1", "-g", "-fno-omit-frame-pointer", "-ldl"],
    )
    .unwrap()
}

/// A private copy of Debian's `libmimalloc.so.2` in `dir`: its own inode, mapped by no
/// other process, so it is attached only if allocbpf finds it mapped by the workload.
fn private_mimalloc(dir: &Path) -> PathBuf {
    let system = ALLOCATORS
        .iter()
        .find(|a| a.family == "mimalloc")
        .expect("mimalloc is one of the test allocators")
        .library;
    assert!(
        Path::new(system).exists(),
        "{system} is missing (cargo xtask setup installs libmimalloc2.0)"
    );
    let copy = dir.join("libmimalloc-private.so.2");
    std::fs::copy(system, &copy).unwrap();
    copy
}

/// The workload's arguments: the library, then its mimalloc phase.
fn workload_args(library: &Path) -> Vec<String> {
    vec![
        library.to_str().unwrap().to_string(),
        MI_SECONDS.to_string(),
        MI_SIZE.to_string(),
        MI_PERIOD_US.to_string(),
    ]
}

/// The `mi_malloc` calls the workload makes, and the fewest of them made after
/// [`LATE`]: the loop is paced on the clock and never runs ahead (call `i` is made
/// `i` periods after the first at the earliest), so at most `LATE / period + 1` calls
/// come before the image can have been probed.
fn mi_calls_counted_at_least() -> (u64, u64) {
    let calls = MI_SECONDS * 1_000_000 / MI_PERIOD_US;
    let early = LATE.as_micros() as u64 / MI_PERIOD_US + 1;
    (calls, calls - early)
}

/// The exact bytes of `json` include every `mi_malloc` call made after [`LATE`] (and
/// not more than the workload made, with [`SLACK_BYTES`] for its runtime).
fn assert_mimalloc_counted(json: &Value, finished: &Finished) {
    let (calls, counted) = mi_calls_counted_at_least();
    let exact = json["totals"]["exact_bytes"].as_u64().unwrap();
    let least = counted * MI_SIZE;
    let most = GLIBC_BYTES + calls * MI_SIZE + SLACK_BYTES;
    assert!(
        exact >= least,
        "{exact} bytes counted, fewer than the {least} mi_malloc allocated more than {LATE:?} after dlopen: the dlopen'd mimalloc was not probed in time; totals {:#}; stderr: {}",
        json["totals"],
        finished.stderr
    );
    assert!(
        exact <= most,
        "{exact} bytes counted, more than the {most} allocated: counted twice? {:#}",
        json["totals"]
    );
}

/// Samples name `mi_malloc`'s caller.
fn assert_mi_site_sampled(json: &Value, finished: &Finished) {
    let stacks = stacks_with(json, "mi_site");
    let samples: u64 = stacks.iter().filter_map(|s| s["samples"].as_u64()).sum();
    assert!(
        samples > 0,
        "no sample names mi_site; stacks {:#}; stderr: {}",
        json["stacks"],
        finished.stderr
    );
}

/// The log (`-v`) says the private copy was attached.
fn assert_attached(finished: &Finished, library: &Path) {
    // The log names the file as the process maps it: without `..`.
    let path = library
        .canonicalize()
        .unwrap_or_else(|_| library.to_path_buf())
        .display()
        .to_string();
    assert!(
        finished
            .stderr
            .lines()
            .any(|l| l.contains("attached") && l.contains(&path)),
        "the private mimalloc {path} was not attached: {}",
        finished.stderr
    );
}

/// System-wide with `--comm`: the workload is followed from allocbpf's start (the
/// `/proc` scan), and its later `dlopen` is found by the re-read of its maps: the
/// `/proc` scan looks at new pids only.
#[test]
fn a_dlopened_allocator_is_probed_system_wide() {
    require_root();
    let _one = allocbpf_e2e::one_profiler_at_a_time();
    let dir = scratch_dir("dlopen-host");
    let library = private_mimalloc(&dir);
    // Under its own name: the filter matches the command name.
    let binary = dir.join("late_dlopen");
    std::fs::copy(late_dlopen_binary(), &binary).unwrap();
    let args = workload_args(&library);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut workload = Workload::start(&binary, &args).unwrap();
    let out = dir.join("profile.json");
    let mut profiler = Profiler::spawn(&[
        "--comm",
        "^late_dlopen$",
        "--rate",
        "256KiB",
        // A cap: SIGTERM stops it once the workload is done.
        "--duration",
        "180s",
        "--format",
        "json",
        "--output",
        out.to_str().unwrap(),
        "-v",
    ])
    .unwrap();
    profiler
        .stderr
        .wait_for("allocbpf: profiling every process", Duration::from_secs(90))
        .unwrap();
    workload.go().unwrap();
    workload
        .stdout
        .wait_for("dlopened", Duration::from_secs(20))
        .unwrap();
    workload.wait(Duration::from_secs(MI_SECONDS + 60)).unwrap();
    // SAFETY: plain kill(2) on a child we own.
    unsafe { libc::kill(profiler.child.id() as i32, libc::SIGTERM) };
    let finished = profiler.finish(Duration::from_secs(60)).unwrap();
    assert_eq!(finished.code, Some(0), "{}", finished.stderr);
    let json: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    println!(
        "totals {:#}, time sampling {:#}",
        json["totals"], json["time_sampling"]
    );
    assert_mi_site_sampled(&json, &finished);
    // System-wide, the overhead budget is on: exact totals cover the calls made while
    // the probes were in. Probed full time (its cost, ~1000 hits a second, is far
    // below the budget, unless other processes' calls to the shared libc make it
    // windowed), every call after the image was attached is counted; windowed, at
    // least more than the glibc phase.
    let observed = json["time_sampling"]["observed_fraction"]
        .as_f64()
        .unwrap_or(1.0);
    if observed >= 0.999 {
        assert_mimalloc_counted(&json, &finished);
    } else {
        let exact = json["totals"]["exact_bytes"].as_u64().unwrap();
        assert!(
            exact > GLIBC_BYTES + SLACK_BYTES,
            "{exact} bytes counted: no mi_malloc call (observed {observed}); stderr: {}",
            finished.stderr
        );
    }
    assert_attached(&finished, &library);
}

/// `--pid`: the target's images are attached at start; the one it `dlopen`s later is
/// found by the same re-read of its maps (probed for its pid only).
#[test]
fn a_dlopened_allocator_is_probed_with_pid() {
    require_root();
    let _one = allocbpf_e2e::one_profiler_at_a_time();
    let dir = scratch_dir("dlopen-pid");
    let library = private_mimalloc(&dir);
    let out = dir.join("profile.json");
    let args = workload_args(&library);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let finished = profile_workload(
        &late_dlopen_binary(),
        &args,
        &[
            "--rate",
            "256KiB",
            "--format",
            "json",
            "--output",
            out.to_str().unwrap(),
            "-v",
        ],
    )
    .unwrap();
    // Started on glibc alone: mimalloc is not among the images attached at start.
    let startup = finished.startup_line();
    assert!(!startup.contains("mimalloc"), "{startup}");
    let json: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    println!("totals {:#}", json["totals"]);
    assert_mimalloc_counted(&json, &finished);
    assert_mi_site_sampled(&json, &finished);
    assert_attached(&finished, &library);
}
