//! Debian's redis-server, a program nobody here wrote, linked against jemalloc
//! (DT_NEEDED libjemalloc.so.2), profiled with default flags under redis-benchmark:
//! jemalloc is found and probed with no flag, calls are counted exactly, the estimate
//! agrees with them, and stacks go through redis's own functions.
//!
//! Bound: the 95% interval is about +-1.96 standard deviations of the estimate; the
//! exact total must lie within the interval widened to +-5 sd on each side (the normal
//! tail beyond 5 sd is 6e-7), with hundreds of samples in 3 s.

use std::{
    net::TcpListener,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use allocbpf_e2e::{profile_running_json, require_root, scratch_dir};
use serde_json::Value;

/// A child killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn redis_answers(port: &str) -> bool {
    Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", port, "ping"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("PONG"))
}

#[test]
fn debian_redis_server_under_redis_benchmark() {
    require_root();
    let dir = scratch_dir("redis");
    let port = free_port().to_string();
    let server = Killed(
        Command::new("redis-server")
            .args(["--port", &port, "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server (cargo xtask setup installs redis-server)"),
    );
    let started = Instant::now();
    while !redis_answers(&port) {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "redis did not start"
        );
        thread::sleep(Duration::from_millis(50));
    }
    // Bounded load on loopback: stops by itself after 3 million requests at most.
    let _benchmark = Killed(
        Command::new("redis-benchmark")
            .args(["-h", "127.0.0.1", "-p", &port, "-q", "-n", "3000000"])
            .args(["-t", "set,get,lpush", "-d", "256", "-c", "20"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-benchmark (redis-tools)"),
    );
    thread::sleep(Duration::from_millis(500));
    let out = dir.join("redis.json");
    let (json, finished) =
        profile_running_json(server.0.id(), &["--duration", "3s"], &out).unwrap();
    let startup = finished.startup_line();
    assert!(startup.contains("libjemalloc.so.2 (jemalloc"), "{startup}");
    assert!(
        !finished.stderr.contains("single-steps"),
        "{}",
        finished.stderr
    );

    let totals = &json["totals"];
    println!("{totals:#}");
    let calls = totals["exact_calls"].as_u64().unwrap();
    assert!(calls > 100_000, "{totals:#}");
    assert_eq!(totals["samples"], json["counters"]["samples"]);
    assert_eq!(totals["drops"], 0);
    let exact = totals["exact_bytes"].as_f64().unwrap();
    let estimate = totals["estimated_bytes"].as_f64().unwrap();
    let ci = totals["bytes_ci95"].as_array().unwrap();
    let (lo, hi) = (ci[0].as_f64().unwrap(), ci[1].as_f64().unwrap());
    let widen = 5.0 / 1.96;
    assert!(
        estimate - widen * (estimate - lo) <= exact && exact <= estimate + widen * (hi - estimate),
        "exact {exact} vs estimate {estimate} [{lo}, {hi}]"
    );
    // Stacks through redis: its allocator wrapper and its command dispatch.
    let frames: Vec<&str> = json["stacks"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["frames"].as_array().unwrap().iter())
        .filter_map(Value::as_str)
        .collect();
    for function in ["zmalloc", "processCommand"] {
        assert!(
            frames.iter().any(|f| f.starts_with(function)),
            "no {function} frame"
        );
    }
    // The server is unharmed by the probes and their removal.
    assert!(redis_answers(&port), "redis stopped answering");
}
