//! Files a process maps may be traps for the symbolizer, and a build id is no proof of
//! what a file is.
//!
//! - A program whose `.gnu_debuglink` names a FIFO: the old symbolizer (blazesym
//!   reading the process's file itself) followed the link next to the binary and hung
//!   in `open()` for good, at the end of the run. allocbpf must finish on time, exit 0
//!   and name the program's functions (from its symbol table, which `strip -g` keeps),
//!   with `--pid` and system-wide, and a SIGTERM must still end a run within seconds.
//! - A stub shared object carrying the C library's build id, mapped by a process seen
//!   first: the old module table keyed modules by build id, so every process's libc
//!   frames were symbolized from the stub. A normal process's stacks must not name
//!   anything the stub defines.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use allocbpf_e2e::{
    gnu_build_id, one_profiler_at_a_time, require_root, run_allocbpf, scratch_dir, stacks_with,
    Profiler, Workload,
};
use serde_json::Value;

/// The host's C library (Debian, x86-64).
const LIBC: &str = "/usr/lib/x86_64-linux-gnu/libc.so.6";

/// How long a 2 s `--pid` run may take, start-up and symbolization included: a hang
/// fails.
const RUN_BOUND: Duration = Duration::from_secs(30);

/// The same for a system-wide run, whose start-up examines every process's files (as
/// `hostile.rs` allows).
const HOST_RUN_BOUND: Duration = Duration::from_secs(90);

/// Allocates 64 KiB every 200 us for `argv[1]` seconds (about 5,000 calls a second, far
/// under the overhead budget) through named functions, every other time from a `qsort`
/// comparison callback, so that a libc frame (`qsort`'s sort loop) lies between two of
/// the program's own; prints its pid first.
const ALLOCATING_C: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

__attribute__((noinline)) void hostile_files_site(void) {
    char *volatile p = malloc(64 * 1024);
    p[0] = 1;
    free(p);
}

static int hostile_files_compare(const void *a, const void *b) {
    hostile_files_site();
    return *(const int *)a - *(const int *)b;
}

__attribute__((noinline)) void hostile_files_loop(double seconds) {
    double end = now() + seconds;
    for (unsigned i = 0; now() < end; i++) {
        if (i % 2) {
            int v[2] = {2, 1};
            qsort(v, 2, sizeof v[0], hostile_files_compare);
        } else {
            hostile_files_site();
        }
        usleep(200);
    }
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 5.0;
    printf("%d\n", getpid());
    fflush(stdout);
    hostile_files_loop(seconds);
    return 0;
}
"#;

/// The stub library: one allocating function, and a 4 MiB function covering the file
/// offsets where libc's code lies, so that a libc frame symbolized from the stub would
/// read `stub_poison`.
const STUB_C: &str = r#"
#include <stdlib.h>

__asm__(".text\n"
        ".globl stub_poison\n"
        ".type stub_poison, @function\n"
        "stub_poison:\n"
        ".skip 0x400000, 0xc3\n"
        ".size stub_poison, .-stub_poison\n");

__attribute__((noinline)) void *stub_only_alloc(size_t size) {
    return malloc(size);
}
"#;

/// dlopens the stub (`argv[2]`) and allocates through it for `argv[1]` seconds, 64 KiB
/// every 200 us; prints its pid first.
const STUB_USER_C: &str = r#"
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    double seconds = atof(argv[1]);
    void *stub = dlopen(argv[2], RTLD_NOW);
    if (!stub) {
        fprintf(stderr, "%s\n", dlerror());
        return 1;
    }
    void *(*alloc)(size_t) = (void *(*)(size_t))dlsym(stub, "stub_only_alloc");
    printf("%d\n", getpid());
    fflush(stdout);
    double end = now() + seconds;
    while (now() < end) {
        char *volatile p = alloc(64 * 1024);
        p[0] = 1;
        free(p);
        usleep(200);
    }
    return 0;
}
"#;

fn run(command: &mut Command) {
    let status = command
        .status()
        .unwrap_or_else(|e| panic!("{command:?}: {e} (gcc and binutils are installed)"));
    assert!(status.success(), "{command:?} failed");
}

/// Compiles C `source` with `flags` into `dir/name`.
fn compile(dir: &Path, name: &str, source: &str, flags: &[&str]) -> PathBuf {
    let file = dir.join(format!("{name}.c"));
    std::fs::write(&file, source).unwrap();
    let binary = dir.join(name);
    run(Command::new("gcc")
        .arg("-o")
        .arg(&binary)
        .arg(&file)
        .args(flags));
    binary
}

/// The allocating program `name` in `dir`, built with debug info, the debug info then
/// split into `name.debug` (`--only-keep-debug`, `strip -g`, `--add-gnu-debuglink`),
/// and `name.debug` (next to it and in its `.debug` directory) replaced by a FIFO:
/// opening it blocks until a writer comes, which none ever does.
fn debuglink_to_fifo(dir: &Path, name: &str) -> PathBuf {
    let binary = compile(
        dir,
        name,
        ALLOCATING_C,
        &["-O1", "-g", "-fno-omit-frame-pointer"],
    );
    let debug = dir.join(format!("{name}.debug"));
    run(Command::new("objcopy")
        .arg("--only-keep-debug")
        .arg(&binary)
        .arg(&debug));
    run(Command::new("strip").arg("-g").arg(&binary));
    run(Command::new("objcopy")
        .arg(format!("--add-gnu-debuglink={name}.debug"))
        .arg(&binary)
        .current_dir(dir));
    std::fs::remove_file(&debug).unwrap();
    std::fs::create_dir_all(dir.join(".debug")).unwrap();
    for fifo in [debug, dir.join(".debug").join(format!("{name}.debug"))] {
        run(Command::new("mkfifo").arg(&fifo));
    }
    let sections = Command::new("readelf")
        .arg("-S")
        .arg(&binary)
        .output()
        .unwrap();
    let sections = String::from_utf8_lossy(&sections.stdout);
    assert!(sections.contains(".gnu_debuglink"), "{sections}");
    assert!(!sections.contains(".debug_info"), "{sections}");
    binary
}

fn frames(stack: &Value) -> Vec<&str> {
    stack["frames"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .filter_map(Value::as_str)
        .collect()
}

fn stacks_of(json: &Value, pid: u32) -> Vec<&Value> {
    json["stacks"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .filter(|s| s["pid"].as_u64() == Some(u64::from(pid)))
        .collect()
}

fn read_json(out: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(out).unwrap()).unwrap()
}

/// The program's own functions are named in `pid`'s stacks of the profile at `out`:
/// some stack runs main, hostile_files_loop, hostile_files_site.
fn assert_named(out: &Path, pid: u32) {
    let json = read_json(out);
    let named: Vec<Vec<&str>> = stacks_with(&json, "hostile_files_site")
        .into_iter()
        .filter(|s| s["pid"].as_u64() == Some(u64::from(pid)))
        .map(frames)
        .collect();
    assert!(
        named.iter().any(|f| {
            f.windows(3)
                .any(|w| w == ["main", "hostile_files_loop", "hostile_files_site"])
        }),
        "no stack of pid {pid} names its functions: {named:?} in {:#}",
        json["stacks"]
    );
}

#[test]
fn a_debug_link_to_a_fifo_does_not_hang_a_pid_run() {
    require_root();
    let _one = one_profiler_at_a_time();
    let dir = scratch_dir("hostile-debuglink-pid");
    let binary = debuglink_to_fifo(&dir, "dbglinkwl");
    let workload = Workload::start(&binary, &["60"]).unwrap();
    let out = dir.join("profile.json");
    let pid = workload.pid.to_string();
    let started = Instant::now();
    let finished = run_allocbpf(
        &[
            "--pid",
            &pid,
            "--duration",
            "2s",
            "--format",
            "json",
            "--output",
            out.to_str().unwrap(),
        ],
        RUN_BOUND,
    )
    .unwrap();
    assert_eq!(finished.code, Some(0), "{}", finished.stderr);
    println!("--pid run took {:?}", started.elapsed());
    assert_named(&out, workload.pid);
}

#[test]
fn a_debug_link_to_a_fifo_does_not_hang_a_system_wide_run() {
    require_root();
    let _one = one_profiler_at_a_time();
    let dir = scratch_dir("hostile-debuglink-host");
    let binary = debuglink_to_fifo(&dir, "dbglinkhost");
    let workload = Workload::start(&binary, &["60"]).unwrap();
    let out = dir.join("profile.json");
    let started = Instant::now();
    let finished = run_allocbpf(
        &[
            "--comm",
            "^dbglinkhost$",
            "--duration",
            "2s",
            "--format",
            "json",
            "--output",
            out.to_str().unwrap(),
            "-v",
        ],
        HOST_RUN_BOUND,
    )
    .unwrap();
    assert_eq!(finished.code, Some(0), "{}", finished.stderr);
    println!("system-wide run took {:?}", started.elapsed());
    assert_named(&out, workload.pid);
}

/// SIGTERM in the middle of a system-wide run over the trapped program ends it within
/// seconds, with its profile written and symbolized.
#[test]
fn sigterm_ends_a_run_over_a_debug_link_to_a_fifo_with_its_profile() {
    require_root();
    let _one = one_profiler_at_a_time();
    let dir = scratch_dir("hostile-debuglink-term");
    let binary = debuglink_to_fifo(&dir, "dbglinkterm");
    let workload = Workload::start(&binary, &["120"]).unwrap();
    let out = dir.join("profile.json");
    let mut profiler = Profiler::spawn(&[
        "--comm",
        "^dbglinkterm$",
        "--duration",
        "600s",
        "--format",
        "json",
        "--output",
        out.to_str().unwrap(),
    ])
    .unwrap();
    profiler
        .stderr
        .wait_for("allocbpf: profiling every process", Duration::from_secs(90))
        .unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let signalled = Instant::now();
    // SAFETY: plain kill(2) on a child we own.
    unsafe { libc::kill(profiler.child.id() as i32, libc::SIGTERM) };
    let finished = profiler.finish(Duration::from_secs(15)).unwrap();
    let took = signalled.elapsed();
    assert_eq!(finished.code, Some(0), "{}", finished.stderr);
    assert!(
        finished.stderr.contains("interrupted"),
        "{}",
        finished.stderr
    );
    assert!(took < Duration::from_secs(10), "SIGTERM took {took:?}");
    assert_named(&out, workload.pid);
}

/// A stub library with libc's build id, mapped (and allocating) before a normal process
/// starts: the normal process's frames, libc's included, are not symbolized from the
/// stub. The stub's own frames are, from the stub.
#[test]
fn a_stub_with_libcs_build_id_does_not_symbolize_other_processes_libc() {
    require_root();
    let _one = one_profiler_at_a_time();
    let dir = scratch_dir("hostile-buildid");
    let libc_id = gnu_build_id(Path::new(LIBC));
    assert_eq!(libc_id.len(), 40, "{libc_id}");
    let stub = dir.join("libstub.so");
    let stub_source = dir.join("stub.c");
    std::fs::write(&stub_source, STUB_C).unwrap();
    run(Command::new("gcc")
        .args(["-shared", "-fPIC", "-O1", "-fno-omit-frame-pointer"])
        .arg(format!("-Wl,--build-id=0x{libc_id}"))
        .arg("-o")
        .arg(&stub)
        .arg(&stub_source));
    assert_eq!(
        gnu_build_id(&stub),
        libc_id,
        "the stub carries libc's build id"
    );
    let stub_user = compile(
        &dir,
        "stubuserwl",
        STUB_USER_C,
        &["-O1", "-fno-omit-frame-pointer", "-ldl"],
    );
    let normal = compile(
        &dir,
        "normalwl",
        ALLOCATING_C,
        &["-O1", "-g", "-fno-omit-frame-pointer"],
    );

    // The stub's process first: its samples (stub frame innermost) come first.
    let stub_process = Workload::start(&stub_user, &["60", stub.to_str().unwrap()]).unwrap();
    let out = dir.join("profile.json");
    let mut profiler = Profiler::spawn(&[
        "--comm",
        "^(stubuserwl|normalwl)$",
        "--duration",
        "5s",
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
    std::thread::sleep(Duration::from_secs(1));
    let normal_process = Workload::start(&normal, &["30"]).unwrap();
    let finished = profiler.finish(Duration::from_secs(60)).unwrap();
    assert_eq!(finished.code, Some(0), "{}", finished.stderr);
    let json = read_json(&out);

    // The stub's own frames come from the stub.
    let stub_stacks = stacks_of(&json, stub_process.pid);
    assert!(
        stub_stacks
            .iter()
            .any(|s| frames(s).contains(&"stub_only_alloc")),
        "the stub process was not sampled through its stub: {:#}",
        json["stacks"]
    );
    // The normal process: its own functions, a libc frame between two of them (the
    // stub covers libc's code offsets: from the stub, it would read `stub_poison`),
    // and nothing of the stub's.
    let normal_stacks = stacks_of(&json, normal_process.pid);
    assert!(
        normal_stacks.iter().any(|s| {
            let f = frames(s);
            f.contains(&"hostile_files_site") && f.contains(&"main")
        }),
        "the normal process was not sampled: {:#}",
        json["stacks"]
    );
    assert!(
        normal_stacks
            .iter()
            .any(|s| frames(s).ends_with(&["hostile_files_compare", "hostile_files_site"])),
        "no sample through qsort's callback: {:#}",
        json["stacks"]
    );
    for stack in &normal_stacks {
        let f = frames(stack);
        assert!(
            !f.iter().any(|name| name.starts_with("stub_")),
            "a frame of the normal process was symbolized from the stub: {f:?}"
        );
    }
}
