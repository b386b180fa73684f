//! `cargo xtask bench`, second part: the cost of every probed entry point of every
//! allocator family on this machine, and redis-benchmark throughput.
//!
//! Per entry (`tests/workloads/entries.c`: each entry called in a loop, paired with its
//! deallocation, which is not probed), ns per call under:
//! - `bare`: no probe;
//! - `floor@+0`: an empty program on each entry's first byte, as allocbpf probed before
//!   it chose probe points (single-stepped wherever that instruction is not emulated);
//! - `floor`: the empty program at the probe points allocbpf chooses;
//! - `allocbpf`: the sampler at the default rate (512 KiB).
//!
//! Targets: allocbpf/floor <= 1.10 for every entry, and no entry single-stepped.
//! Configurations alternate within each round; medians over rounds are printed.
//!
//! redis-benchmark (SET and GET against Debian's redis-server, which allocates through
//! jemalloc): requests/s bare, with the empty program at allocbpf's probe points, with
//! allocbpf at its defaults, and with the empty program on each entry's first byte (what
//! probing by symbol alone costs). Target: allocbpf >= 0.95 of the floor's throughput.

use std::{
    collections::BTreeMap,
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use allocbpf_harness::Workload;
use allocbpf_profile::estimate::median;
use anyhow::{bail, Context, Result};

use crate::util::{attach, compile_c_with, finish_collecting, RESULT_TIMEOUT};

/// An allocator family: how the entries binary runs under it, and what to time.
struct Family {
    name: &'static str,
    compiler: &'static str,
    preload: Option<&'static str>,
    entries: &'static [&'static str],
}

const C_ENTRIES: &[&str] = &[
    "malloc",
    "calloc",
    "realloc",
    "reallocarray",
    "posix_memalign",
    "aligned_alloc",
    "memalign",
    "valloc",
    "pvalloc",
];

const FAMILIES: &[Family] = &[
    Family {
        name: "glibc",
        compiler: "gcc",
        preload: None,
        entries: C_ENTRIES,
    },
    Family {
        name: "musl",
        compiler: "musl-gcc",
        preload: None,
        entries: &[
            "malloc",
            "calloc",
            "realloc",
            "reallocarray",
            "posix_memalign",
            "aligned_alloc",
            "valloc",
        ],
    },
    Family {
        name: "jemalloc",
        compiler: "gcc",
        preload: Some("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"),
        entries: &[
            "malloc",
            "calloc",
            "realloc",
            "posix_memalign",
            "aligned_alloc",
            "memalign",
            "valloc",
            "mallocx",
            "rallocx",
            "xallocx",
            "_Znwm",
            "_Znam",
            "_ZnwmSt11align_val_t",
        ],
    },
    Family {
        name: "tcmalloc",
        compiler: "gcc",
        preload: Some("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
        entries: &[
            "malloc",
            "calloc",
            "realloc",
            "posix_memalign",
            "aligned_alloc",
            "memalign",
            "valloc",
            "pvalloc",
            "_Znwm",
            "_Znam",
            "_ZnwmSt11align_val_t",
        ],
    },
    Family {
        name: "mimalloc",
        compiler: "gcc",
        preload: Some("/usr/lib/x86_64-linux-gnu/libmimalloc.so.2"),
        entries: &[
            "malloc",
            "calloc",
            "realloc",
            "posix_memalign",
            "aligned_alloc",
            "memalign",
            "valloc",
            "pvalloc",
            "_Znwm",
            "_Znam",
            "_ZnwmSt11align_val_t",
            "mi_zalloc",
            "mi_malloc_aligned",
            "mi_zalloc_aligned",
            "mi_realloc_aligned",
            "mi_mallocn",
            "mi_new",
        ],
    },
    Family {
        // CPython's object and memory allocators, from Debian's libpython3.11 (the same
        // code its python3.11 executable links in).
        name: "cpython",
        compiler: "gcc",
        preload: Some("/usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0"),
        entries: &[
            "PyObject_Malloc",
            "PyObject_Calloc",
            "PyObject_Realloc",
            "PyMem_Malloc",
            "PyMem_Calloc",
            "PyMem_Realloc",
        ],
    },
];

/// The configurations, in the order they alternate.
const CONFIGS: [(&str, Option<&[&str]>, bool); 4] = [
    ("bare", None, false),
    ("floor@+0", Some(&["--empty-probes"]), true),
    ("floor", Some(&["--empty-probes"]), false),
    ("allocbpf", Some(&["-v"]), false),
];

/// One row: ns per call under each configuration, over rounds.
#[derive(Default)]
struct Row {
    object: String,
    probed_at: String,
    ns: [Vec<f64>; 4],
}

/// One line of the entries binary: (entry, ns per call, the file that defines it).
type Measured = (String, f64, String);

/// Runs the entries binary under one configuration; returns its lines and allocbpf's
/// log.
fn run_entries(
    family: &Family,
    binary: &Path,
    allocbpf: &Path,
    config: usize,
    iterations: u64,
) -> Result<(Vec<Measured>, Vec<String>)> {
    let (_, args, at_entry) = CONFIGS[config];
    let mut command = Command::new(binary);
    command.arg(iterations.to_string()).args(family.entries);
    if let Some(library) = family.preload {
        command.env("LD_PRELOAD", library);
    }
    let mut workload = Workload::spawn(&mut command)?;
    let pid = workload.pid.to_string();
    let profiler = match args {
        None => None,
        Some(extra) => {
            let mut all = vec!["--pid", pid.as_str(), "--output", "/dev/null"];
            all.extend_from_slice(extra);
            Some(attach_with_env(allocbpf, &all, at_entry)?)
        }
    };
    workload.go()?;
    let mut rows = Vec::new();
    for _ in family.entries {
        let line = workload
            .stdout
            .wait_for("", RESULT_TIMEOUT)
            .context("entries output")?;
        let mut words = line.split_whitespace();
        let (Some(name), Some(ns), Some(object)) = (words.next(), words.next(), words.next())
        else {
            bail!("bad entries line {line:?}");
        };
        rows.push((name.to_string(), ns.parse()?, object.to_string()));
    }
    workload.child.wait()?;
    let log = match profiler {
        Some((child, stderr)) => finish_collecting(child, stderr, false)?,
        None => Vec::new(),
    };
    Ok((rows, log))
}

/// [`attach`], with the environment variable that puts every probe on its entry's
/// first byte when `at_entry`.
fn attach_with_env(
    allocbpf: &Path,
    args: &[&str],
    at_entry: bool,
) -> Result<(
    std::process::Child,
    std::io::Lines<std::io::BufReader<std::process::ChildStderr>>,
)> {
    if at_entry {
        std::env::set_var("ALLOCBPF_BENCH_PROBE_AT_ENTRY", "1");
    }
    let attached = attach(allocbpf, args, false);
    std::env::remove_var("ALLOCBPF_BENCH_PROBE_AT_ENTRY");
    attached
}

/// "PATH: SYMBOL (...) probed at +N (INSTR)" lines of allocbpf's -v log, by
/// (canonical path, symbol).
fn probe_points(log: &[String]) -> BTreeMap<(PathBuf, String), String> {
    let mut points = BTreeMap::new();
    for line in log {
        let Some(at) = line.find(" probed at +") else {
            continue;
        };
        let Some((prefix, entry)) = line[..at].rsplit_once(": ") else {
            continue;
        };
        let (Some(path), Some(symbol)) = (
            prefix.split_whitespace().last(),
            entry.split_whitespace().next(),
        ) else {
            continue;
        };
        let point = line[at + " probed at ".len()..]
            .split(')')
            .next()
            .unwrap_or("")
            .to_string()
            + ")";
        points.insert((canonical(path), symbol.to_string()), point);
    }
    points
}

fn canonical(path: &str) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| PathBuf::from(path))
}

/// Per-entry costs for every family present (of `only`, if not empty).
pub fn entries(allocbpf: &Path, rounds: usize, iterations: u64, only: &[String]) -> Result<()> {
    if let Some(unknown) = only.iter().find(|o| !FAMILIES.iter().any(|f| f.name == *o)) {
        bail!("unknown family {unknown:?}: one of glibc, musl, jemalloc, tcmalloc, mimalloc");
    }
    println!();
    println!(
        "entry points, ns per call (median of {rounds} rounds, {iterations} calls each), \
         deallocation not probed:"
    );
    println!(
        "  {:<9} {:<22} {:<24} {:>8} {:>10} {:>8} {:>9} {:>8}",
        "family", "entry", "probed at", "bare", "floor@+0", "floor", "allocbpf", "ratio"
    );
    let mut worst: f64 = 0.0;
    let mut single_stepped = Vec::new();
    for family in FAMILIES {
        if !only.is_empty() && !only.iter().any(|o| o == family.name) {
            continue;
        }
        if family.preload.is_some_and(|p| !Path::new(p).exists()) {
            println!("  {}: not installed, skipped", family.name);
            continue;
        }
        let binary = compile_c_with(family.compiler, "entries", &["-O2"])?;
        let mut rows: BTreeMap<String, Row> = BTreeMap::new();
        for _ in 0..rounds {
            for (config, (config_name, _, _)) in CONFIGS.iter().enumerate() {
                let (measured, log) = run_entries(family, &binary, allocbpf, config, iterations)?;
                if *config_name == "allocbpf" {
                    let points = probe_points(&log);
                    for (name, row) in rows.iter_mut() {
                        let key = (canonical(&row.object), name.clone());
                        // An alias (glibc's memalign is aligned_alloc) is logged under
                        // the name probed.
                        row.probed_at = points.get(&key).cloned().unwrap_or("(alias)".into());
                    }
                    single_stepped.extend(
                        log.iter()
                            .filter(|l| l.contains("single-steps"))
                            .map(|l| format!("{}: {l}", family.name)),
                    );
                }
                for (name, ns, object) in measured {
                    let row = rows.entry(name).or_default();
                    row.object = object;
                    row.ns[config].push(ns);
                }
            }
        }
        // The allocbpf run's log names the probe points; the order of entries is kept.
        for name in family.entries {
            let Some(row) = rows.get(*name) else { continue };
            if row.object == "absent" {
                continue;
            }
            // Under a preloaded allocator that lacks an entry, the call goes to libc's.
            let object = Path::new(&row.object).file_name();
            let label = match family.preload {
                Some(library) if object != Path::new(library).file_name() => format!(
                    "{name} ({})",
                    object.map(|o| o.to_string_lossy()).unwrap_or_default()
                ),
                _ => name.to_string(),
            };
            let m: Vec<f64> = row.ns.iter().map(|v| median(v)).collect();
            let ratios: Vec<f64> = row.ns[3]
                .iter()
                .zip(&row.ns[2])
                .map(|(a, f)| a / f)
                .collect();
            let ratio = median(&ratios);
            worst = worst.max(ratio);
            println!(
                "  {:<9} {:<22} {:<24} {:>8.1} {:>10.1} {:>8.1} {:>9.1} {:>8.3}",
                family.name, label, row.probed_at, m[0], m[1], m[2], m[3], ratio
            );
        }
    }
    println!(
        "  worst allocbpf/floor: {worst:.3} (target <= 1.10: {}); single-stepped entries: {}",
        if worst <= 1.10 { "met" } else { "NOT met" },
        if single_stepped.is_empty() {
            "none".to_string()
        } else {
            single_stepped.join("; ")
        }
    );
    Ok(())
}

/// A child killed when dropped.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// redis-benchmark requests/s (SET and GET, summed) against `port`.
fn redis_benchmark(port: &str, requests: u64) -> Result<f64> {
    // Bounded in time as well as in requests.
    let output = Command::new("timeout")
        .args(["120", "redis-benchmark"])
        .args(["-h", "127.0.0.1", "-p", port, "-q", "-t", "set,get"])
        .args(["-n", &requests.to_string(), "-c", "20", "-d", "256"])
        .output()
        .context("redis-benchmark (apt-get install redis-tools)")?;
    let text = String::from_utf8_lossy(&output.stdout);
    // "SET: 123456.79 requests per second, p50=0.095 msec" (after \r progress lines)
    let total: f64 = text
        .split(['\r', '\n'])
        .filter_map(|l| {
            let rest = l.split_once(": ")?.1;
            rest.split_whitespace()
                .next()?
                .parse::<f64>()
                .ok()
                .filter(|_| rest.contains("requests per second"))
        })
        .sum();
    if total == 0.0 {
        bail!("no figures from redis-benchmark: {text}");
    }
    Ok(total / 2.0)
}

/// redis-server throughput bare, at the floor and under allocbpf.
pub fn redis(allocbpf: &Path, rounds: usize, requests: u64) -> Result<()> {
    let port = TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port()
        .to_string();
    let dir = crate::util::root().join("target/xtask/redis");
    std::fs::create_dir_all(&dir)?;
    let server = Killed(
        Command::new("redis-server")
            .args(["--port", &port, "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "no", "--daemonize", "no", "--dir"])
            .arg(&dir)
            .stdout(Stdio::null())
            .spawn()
            .context("redis-server (apt-get install redis-server)")?,
    );
    let pid = server.0.id().to_string();
    let started = Instant::now();
    // redis-benchmark started before the server listens retries forever: ping first.
    while !Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port, "ping"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("PONG"))
    {
        if started.elapsed() > Duration::from_secs(10) {
            bail!("redis-server did not start");
        }
        thread::sleep(Duration::from_millis(100));
    }
    let configs: [(&str, Option<&[&str]>, bool); 4] = [
        ("bare", None, false),
        (
            "floor (empty program at allocbpf's points)",
            Some(&["--empty-probes"]),
            false,
        ),
        ("allocbpf (defaults)", Some(&[]), false),
        (
            "floor@+0 (empty program at entries' first bytes)",
            Some(&["--empty-probes"]),
            true,
        ),
    ];
    let mut results = vec![Vec::new(); configs.len()];
    for _ in 0..rounds {
        for (i, (_, args, at_entry)) in configs.iter().enumerate() {
            let profiler = match args {
                Some(extra) => {
                    let mut all = vec!["--pid", pid.as_str(), "--output", "/dev/null"];
                    all.extend_from_slice(extra);
                    Some(attach_with_env(allocbpf, &all, *at_entry)?)
                }
                None => None,
            };
            let rps = redis_benchmark(&port, requests)?;
            if let Some((child, stderr)) = profiler {
                Command::new("kill")
                    .args(["-INT", &child.id().to_string()])
                    .status()?;
                finish_collecting(child, stderr, false)?;
            }
            results[i].push(rps);
        }
    }
    println!();
    println!(
        "redis-server (jemalloc) under redis-benchmark SET+GET, requests/s (median of {rounds}):"
    );
    for ((name, _, _), values) in configs.iter().zip(&results) {
        println!("  {name:<44} {:>10.0}", median(values));
    }
    let ratio = |a: usize, b: usize| {
        let r: Vec<f64> = results[a]
            .iter()
            .zip(&results[b])
            .map(|(x, y)| x / y)
            .collect();
        median(&r)
    };
    let to_floor = ratio(2, 1);
    println!(
        "  allocbpf / floor: {to_floor:.3} (target >= 0.95: {}); floor / bare: {:.3}; allocbpf / bare: {:.3}; floor@+0 / bare: {:.3}",
        if to_floor >= 0.95 { "met" } else { "NOT met" },
        ratio(1, 0),
        ratio(2, 0),
        ratio(3, 0)
    );
    drop(server);
    Ok(())
}
