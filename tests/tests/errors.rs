//! Bad input: every case ends with a clear message and a non-zero exit, and a target
//! that goes away mid-run still gets its profile written.

use std::{os::unix::fs::PermissionsExt, process::Command, time::Duration};

use allocbpf_e2e::{
    allocbpf_bin, attach_json, compile_workload, require_root, run_allocbpf, scratch_dir,
    sites_binary, Workload,
};

const QUICK: Duration = Duration::from_secs(30);

fn assert_fails_with(args: &[&str], needle: &str) {
    let finished = run_allocbpf(args, QUICK).unwrap();
    assert_ne!(finished.code, Some(0), "{args:?} should fail");
    assert!(
        finished.stderr.contains(needle),
        "{args:?}: expected {needle:?} in:\n{}",
        finished.stderr
    );
}

#[test]
fn unknown_pid_is_reported() {
    require_root();
    // pid_max is at most 2^22; this pid cannot exist.
    assert_fails_with(&["--pid", "99999999"], "no process with pid 99999999");
}

#[test]
fn bad_rates_and_durations_are_rejected() {
    require_root();
    for (args, needle) in [
        (&["--pid", "1", "--rate", "0"][..], "greater than zero"),
        (&["--pid", "1", "--rate", "-1"][..], "greater than zero"),
        (&["--pid", "1", "--rate", "many"][..], "not a number"),
        (&["--pid", "1", "--rate", "1TiB"][..], "unknown unit"),
        (
            &["--pid", "1", "--rate", "100GB"][..],
            "larger than the maximum",
        ),
        (&["--pid", "1", "--duration", "0"][..], "greater than zero"),
        (&["--pid", "1", "--duration", "soon"][..], "not a number"),
        (
            &["--pid", "1", "--duration", "100000h"][..],
            "larger than the maximum",
        ),
    ] {
        assert_fails_with(args, needle);
    }
}

#[test]
fn unwritable_output_fails_before_attaching() {
    require_root();
    let finished = run_allocbpf(
        &["--pid", "1", "--output", "/proc/version/profile.json"],
        QUICK,
    )
    .unwrap();
    assert_ne!(finished.code, Some(0));
    assert!(
        finished
            .stderr
            .contains("cannot write the output file /proc/version/profile.json"),
        "{}",
        finished.stderr
    );
    assert!(
        !finished.stderr.contains("profiling pid"),
        "{}",
        finished.stderr
    );
    // The cause is printed once (messages must not repeat what the error chain prints).
    let line = finished
        .stderr
        .lines()
        .find(|l| l.contains("cannot write the output file"))
        .unwrap_or_default();
    assert_eq!(line.matches("os error").count(), 1, "{line}");
}

#[test]
fn stripped_static_target_has_no_malloc_to_probe() {
    require_root();
    let binary = compile_workload("static_target", &["-static", "-O1", "-s"]).unwrap();
    let mut child = Command::new(&binary).spawn().unwrap();
    let pid = child.id().to_string();
    let finished = run_allocbpf(&["--pid", &pid], QUICK).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert_ne!(finished.code, Some(0));
    assert!(
        finished
            .stderr
            .contains("allocates through no function allocbpf can probe")
            && finished.stderr.contains("--allocator-symbol"),
        "{}",
        finished.stderr
    );
}

#[test]
fn static_target_with_symbols_is_profiled_through_its_own_malloc() {
    require_root();
    let binary = compile_workload("static_target", &["-static", "-O1", "-g"]).unwrap();
    let mut child = Command::new(&binary).spawn().unwrap();
    let pid = child.id().to_string();
    let finished = run_allocbpf(
        &[
            "--pid",
            &pid,
            "--duration",
            "2s",
            "--rate",
            "64KiB",
            "--format",
            "json",
        ],
        Duration::from_secs(60),
    )
    .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(finished.code, Some(0), "{}", finished.stderr);
    // The probes went on the executable itself, not on a libc.
    let exe = std::fs::canonicalize(&binary).unwrap();
    assert!(
        finished
            .stderr
            .contains(&format!("through {}", exe.display())),
        "{}",
        finished.stderr
    );
    let json: serde_json::Value = serde_json::from_str(&finished.stdout).unwrap();
    let sites = allocbpf_e2e::stacks_with(&json, "static_alloc_site");
    assert!(!sites.is_empty(), "{}", finished.stdout);
    assert!(json["totals"]["exact_calls"].as_u64().unwrap() > 100);
}

#[test]
fn unprivileged_user_is_told_to_use_sudo() {
    require_root();
    // A copy in the temp dir, which user nobody can reach wherever the checkout lives.
    let copy = std::env::temp_dir().join(format!("allocbpf-unprivileged-{}", std::process::id()));
    std::fs::copy(allocbpf_bin(), &copy).unwrap();
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o755)).unwrap();
    let output = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
        ])
        .arg(&copy)
        .args(["--pid", "1"])
        .output()
        .expect("setpriv (util-linux)");
    let _ = std::fs::remove_file(&copy);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("needs root"), "{stderr}");
    assert!(stderr.contains("sudo"), "{stderr}");
}

#[test]
fn duration_stops_profiling_and_writes_the_profile() {
    require_root();
    let binary = sites_binary();
    let dir = scratch_dir("duration");
    // Never told to go: it sits idle while allocbpf runs for one second.
    let workload = Workload::start(&binary, &[]).unwrap();
    let pid = workload.pid.to_string();
    let out = dir.join("p.json");
    let started = std::time::Instant::now();
    let finished = run_allocbpf(
        &[
            "--pid",
            &pid,
            "--duration",
            "1s",
            "--format",
            "json",
            "--output",
            out.to_str().unwrap(),
        ],
        QUICK,
    )
    .unwrap();
    assert_eq!(finished.code, Some(0), "{}", finished.stderr);
    assert!(
        finished.stderr.contains("duration elapsed"),
        "{}",
        finished.stderr
    );
    assert!(started.elapsed() < Duration::from_secs(20));
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(json["totals"]["exact_calls"], 0);
    // Told apart from a program that allocates another way (a Go runtime).
    let note = json["note"].as_str().expect("a note on the empty profile");
    assert!(note.contains("did not allocate in this window"), "{note}");
    drop(workload);
}

#[test]
fn sigterm_stops_profiling_and_keeps_what_was_collected() {
    require_root();
    let binary = sites_binary();
    let dir = scratch_dir("sigterm");
    let mut workload = Workload::start(&binary, &["forever"]).unwrap();
    let out = dir.join("p.json");
    let profiler = attach_json(&workload, &out).unwrap();
    workload.go().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    // SAFETY: plain kill(2) on a child we own.
    unsafe { libc::kill(profiler.child.id() as i32, libc::SIGTERM) };
    let finished = profiler.finish(QUICK).unwrap();
    assert_eq!(finished.code, Some(0), "{}", finished.stderr);
    assert!(
        finished.stderr.contains("interrupted"),
        "{}",
        finished.stderr
    );
    // The target keeps running, unharmed by the probes and their removal.
    assert!(workload.child.try_wait().unwrap().is_none(), "target died");
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert!(
        json["totals"]["samples"].as_u64().unwrap() > 100,
        "{:#}",
        json["totals"]
    );
    assert!(json["totals"]["exact_calls"].as_u64().unwrap() > 100_000);
}

#[test]
fn kernel_thread_is_not_a_target() {
    require_root();
    let kthreadd = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok()?.parse::<u32>().ok())
        .find(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| c.trim() == "kthreadd")
        })
        .expect("kthreadd is visible (tests run in the host pid namespace)");
    assert_fails_with(&["--pid", &kthreadd.to_string()], "is a kernel thread");
}

#[test]
fn an_agent_whose_metrics_address_is_taken_refuses_to_start() {
    require_root();
    // Another service holds the port.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = taken.local_addr().unwrap().to_string();
    let store = scratch_dir("metrics-taken").join("store");
    assert_fails_with(
        &[
            "agent",
            "--store",
            store.to_str().unwrap(),
            "--metrics-address",
            &address,
        ],
        &format!("binding the metrics endpoint {address}"),
    );
}

/// A target that exits while allocbpf loads and attaches (it lives ~30 ms; loading
/// alone takes longer) is told apart from every other failure: the documented exit
/// status 3 and one clear line, and a profile written with whatever the probes in by
/// then saw (none of it lost). Repeated: the exit lands in different phases (examining
/// its maps, loading, attaching).
#[test]
fn a_target_that_exits_during_attach_is_said_so_with_status_3() {
    require_root();
    let busy = compile_workload("busy", &["-O1"]).unwrap();
    let dir = scratch_dir("exit-during-attach");
    for round in 0..3 {
        let mut child = Command::new(&busy)
            .args(["30000", "64", "1000"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id().to_string();
        let out = dir.join(format!("p{round}.json"));
        let finished = run_allocbpf(
            &[
                "--pid",
                &pid,
                "--format",
                "json",
                "--output",
                out.to_str().unwrap(),
            ],
            QUICK,
        )
        .unwrap();
        child.wait().unwrap();
        assert_eq!(finished.code, Some(3), "{}", finished.stderr);
        let line = format!("pid {pid} exited before its probes were live");
        assert!(finished.stderr.contains(&line), "{}", finished.stderr);
        assert!(!finished.stderr.contains("error"), "{}", finished.stderr);
        // Written when any probe was in; a valid, empty or partial, profile.
        if let Ok(bytes) = std::fs::read(&out) {
            if !bytes.is_empty() {
                let json: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
                assert!(json["totals"]["exact_calls"].is_u64(), "{json}");
            }
        }
    }
}
