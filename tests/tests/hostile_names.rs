//! A process whose names are not UTF-8 is profiled like any other.
//!
//! Its command name (`/proc/PID/comm`) and the paths in its memory map are the
//! process's own choice, and Linux takes any bytes but `/` and NUL. allocbpf used to
//! read them as UTF-8 text: `/proc/PID/comm` failed to read, so the process was never
//! followed (system-wide) or refused (`--pid`), and one such path in `/proc/PID/maps`
//! failed the whole map. Here the allocating workload `agentwl` runs from a copy named
//! `x\xff\xfe\xc3bad` (three bytes that are not UTF-8 in the middle), and must be
//! sampled system-wide (selected by `--comm` on its name as shown, each invalid byte
//! becoming U+FFFD) and with `--pid`.
//!
//! The bounds. `agentwl` allocates (and frees) 64 KiB, then sleeps 200 us: about 5,000
//! calls a second, ~320 MiB/s, when the machine is idle. The bounds assume only a tenth
//! of that pace at worst: one call every 2 ms, so at least 1,500 calls (94 MiB) in the
//! 3 s profiled. At `--rate 256KiB` a 64 KiB call holds a sample with probability
//! `1 - e^(-64/256)` = 0.221 (Poisson sampling of bytes): at least 332 samples expected
//! (sd 16); the floor, [`MIN_SAMPLES`] = 200, is over 8 sd below. Each sample of a
//! 64 KiB call is estimated at `64 KiB / 0.221` = 289 KiB, so 200 samples are at least
//! 56 MiB: [`MIN_ESTIMATED_BYTES`] = 48 MiB (the estimate is unbiased for the 94 MiB
//! or more allocated). The rate is not lower, to keep the ring buffer's load (a stack
//! copied with each sample, ~3,300 samples in 3 s at the nominal pace) far from
//! pressure. System-wide the overhead budget is set to a full CPU so the process is
//! probed full time (the budget's time sampling is not what this test is about, and
//! would make the sample count depend on it).

use std::{
    ffi::OsStr,
    os::unix::ffi::OsStrExt,
    path::{Path, PathBuf},
    time::Duration,
};

use allocbpf_e2e::{
    compile_workload, one_profiler_at_a_time, profile_running_json, require_root, run_allocbpf,
    scratch_dir, Workload,
};
use serde_json::Value;

/// The executable's name, hence the command name: `x`, three bytes that are no UTF-8
/// (a lone 0xff, a lone 0xfe, and 0xc3 without its continuation byte), `bad`.
const HOSTILE_NAME: &[u8] = b"x\xff\xfe\xc3bad";

/// [`HOSTILE_NAME`] as shown (lossily): each invalid byte is U+FFFD.
const SHOWN_NAME: &str = "x\u{fffd}\u{fffd}\u{fffd}bad";

/// The sampling rate of both runs (module docs).
const RATE: &str = "256KiB";

/// Least samples of the workload in 3 s at [`RATE`] (module docs).
const MIN_SAMPLES: u64 = 200;

/// Least estimated bytes of the workload in 3 s (module docs).
const MIN_ESTIMATED_BYTES: f64 = (48u64 << 20) as f64;

/// Starts `agentwl` for 120 s from a copy named [`HOSTILE_NAME`] in a scratch
/// directory of its own; checks the kernel took that name as its command name.
fn start_hostile(test: &str) -> (Workload, PathBuf) {
    let built = compile_workload("agentwl", &["-O1"]).unwrap();
    let dir = scratch_dir(test);
    let binary = dir.join(OsStr::from_bytes(HOSTILE_NAME));
    let _ = std::fs::remove_file(&binary);
    std::fs::copy(&built, &binary).unwrap();
    let workload = Workload::start(&binary, &["120"]).unwrap();
    let comm = std::fs::read(format!("/proc/{}/comm", workload.pid)).unwrap();
    assert_eq!(comm, [HOSTILE_NAME, b"\n"].concat(), "the workload's comm");
    (workload, dir)
}

/// The stacks of process `pid` in a JSON profile.
fn stacks_of(json: &Value, pid: u32) -> Vec<&Value> {
    json["stacks"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .filter(|s| s["pid"].as_u64() == Some(u64::from(pid)))
        .collect()
}

/// Process `pid` has at least [`MIN_SAMPLES`] samples and [`MIN_ESTIMATED_BYTES`] in
/// the profile `json`, at its allocation site (its executable, at a path that is not
/// UTF-8, was unwound and symbolized).
fn assert_profiled(json: &Value, pid: u32, mode: &str) {
    let stacks = stacks_of(json, pid);
    let samples: u64 = stacks.iter().filter_map(|s| s["samples"].as_u64()).sum();
    let estimated: f64 = stacks
        .iter()
        .filter_map(|s| s["estimated_bytes"].as_f64())
        .sum();
    assert!(
        samples >= MIN_SAMPLES && estimated >= MIN_ESTIMATED_BYTES,
        "{mode}: pid {pid} has {samples} samples (at least {MIN_SAMPLES} expected), \
         {:.1} MiB estimated (at least {} MiB expected); totals {:#}",
        estimated / f64::from(1 << 20),
        MIN_ESTIMATED_BYTES as u64 >> 20,
        json["totals"]
    );
    let at_site = allocbpf_e2e::stacks_with(json, "agentwl_alloc_site")
        .into_iter()
        .filter(|s| s["pid"].as_u64() == Some(u64::from(pid)))
        .count();
    assert!(
        at_site > 0,
        "{mode}: no stack of pid {pid} through agentwl_alloc_site: {:#}",
        Value::from(stacks.into_iter().take(5).cloned().collect::<Vec<_>>())
    );
}

/// The JSON profile at `out`.
fn read_json(out: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(out).unwrap()).unwrap()
}

/// System-wide, selected by its command name as shown: the process is followed and
/// sampled, and the profile has its samples only.
#[test]
fn a_process_with_a_non_utf8_name_is_profiled_system_wide() {
    require_root();
    let _one = one_profiler_at_a_time();
    let (workload, dir) = start_hostile("hostile-names-host");
    let out = dir.join("host.json");
    let comm = format!("^{SHOWN_NAME}$");
    let args = [
        "--comm",
        comm.as_str(),
        "--rate",
        RATE,
        "--budget",
        "100%",
        "--duration",
        "3s",
        "--format",
        "json",
        "--output",
        out.to_str().unwrap(),
    ];
    // Start-up examines every process's files: 3 s plus that must fit in 90 s.
    let finished = run_allocbpf(&args, Duration::from_secs(90)).unwrap();
    assert_eq!(finished.code, Some(0), "{}", finished.stderr);
    let json = read_json(&out);
    assert_profiled(&json, workload.pid, "system-wide");
    // The filter admitted this process only.
    let others: Vec<u64> = json["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["pid"].as_u64())
        .filter(|&pid| pid != u64::from(workload.pid))
        .collect();
    assert!(others.is_empty(), "other processes admitted: {others:?}");
}

/// `--pid`: the process is resolved (its comm read as bytes), announced under its name
/// as shown, and sampled.
#[test]
fn a_process_with_a_non_utf8_name_is_profiled_by_pid() {
    require_root();
    let _one = one_profiler_at_a_time();
    let (workload, dir) = start_hostile("hostile-names-pid");
    let out = dir.join("pid.json");
    let (json, finished) =
        profile_running_json(workload.pid, &["--rate", RATE, "--duration", "3s"], &out).unwrap();
    assert!(
        finished
            .startup_line()
            .contains(&format!("pid {} ({SHOWN_NAME})", workload.pid)),
        "{}",
        finished.stderr
    );
    assert_profiled(&json, workload.pid, "--pid");
}
