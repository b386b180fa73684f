//! End to end, as root: `allocbpf agent` against real processes through real probes.
//!
//! The agent is system-wide, so its tests run one at a time (a lock) and filter on
//! the workloads' command name to keep other processes' profiles out of the way.
//! This file: what a profile holds and when it is cut, flushed and released.
//! `agent_delivery.rs`: the push. `agent_host.rs`: the agent among the host's services
//! (a full disk, systemd).

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use allocbpf_e2e::{
    agent::{
        agent_workload, metric, one_agent_test, parse_stored_name, raw_pprof, scrape_within,
        start_filtered, stored_profiles, unix_ms, write_config,
    },
    Workload,
};

/// The libc the test itself uses.
fn host_libc() -> PathBuf {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.ends_with("/libc.so.6"))
        .map(PathBuf::from)
        .expect("glibc")
}

#[test]
fn two_workloads_one_in_its_own_mount_namespace_are_profiled_and_labelled() {
    let (_one, scratch, store) = one_agent_test("agent-two");
    let binary = agent_workload();
    // Started BEFORE the agent: found by the start-up scan.
    let mut before = Workload::start(&binary, &["12"]).unwrap();
    let config = write_config(&scratch, "comm = \"^agentwl\"\n");
    let agent = start_filtered(
        &config,
        &store,
        "2s",
        &["--rate", "64KiB", "--metrics-address", "127.0.0.1:19464"],
        &[],
    );
    let private = scratch.join("private-lib");
    let mut inside = start_with_private_libc(&binary, &private);
    std::thread::sleep(Duration::from_secs(5));
    let metrics = scrape_under_idle_connections("127.0.0.1:19464");
    inside.wait(Duration::from_secs(30)).unwrap();
    before.wait(Duration::from_secs(30)).unwrap();
    let log = agent.terminate(Duration::from_secs(60)).unwrap();
    check_both_libcs_and_metrics(&log, &metrics, &private);
    check_stored_labels(
        &store,
        &scratch,
        &binary,
        [(&before, false), (&inside, true)],
    );
    check_store_report(&store, &scratch, [before.pid, inside.pid]);
}

/// Starts the workload `binary` AFTER the agent, in its own mount namespace, with a
/// copy of libc at a path only that namespace has (a tmpfs under `private`: another
/// device and inode), and checks the copy is what it uses and that the host cannot see
/// it.
fn start_with_private_libc(binary: &Path, private: &Path) -> Workload {
    std::fs::create_dir_all(private).unwrap();
    let script = format!(
        "mount -t tmpfs none {dir} && cp {libc} {dir}/libc.so.6 && \
         LD_LIBRARY_PATH={dir} exec {bin} 8",
        dir = private.display(),
        libc = host_libc().display(),
        bin = binary.display()
    );
    let inside = Workload::start(
        Path::new("unshare"),
        &["--mount", "--propagation", "private", "sh", "-c", &script],
    )
    .unwrap();
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", inside.pid)).unwrap();
    assert!(
        maps.contains(&format!("{}/libc.so.6", private.display())),
        "the namespaced workload does not use the copy: {maps}"
    );
    assert!(
        !private.join("libc.so.6").exists(),
        "the copy must be invisible from the host namespace"
    );
    inside
}

/// Scrapes the metrics at `address` under 200 idle connections (anybody on the network
/// can open them): the endpoint keeps at most 16, closes each within 2 s, and still
/// answers a scrape, whose text this returns.
fn scrape_under_idle_connections(address: &str) -> String {
    let idle: Vec<std::net::TcpStream> = (0..200)
        .map(|_| std::net::TcpStream::connect(address).unwrap())
        .collect();
    let flooded = Instant::now();
    let metrics = loop {
        let answer = scrape_within(address, Duration::from_secs(3));
        match answer {
            Ok(text) if text.contains("allocbpf_samples_total") => break text,
            _ if flooded.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(200))
            }
            other => panic!("no answer under 200 idle connections: {other:?}"),
        }
    };
    for mut connection in idle {
        connection
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut byte = [0u8; 1];
        let read = std::io::Read::read(&mut connection, &mut byte);
        let closed = matches!(read, Ok(0))
            || matches!(read, Err(ref e) if e.kind() == std::io::ErrorKind::ConnectionReset);
        assert!(closed, "an idle metrics connection was kept open: {read:?}");
    }
    assert!(
        metric(&metrics, "allocbpf_metrics_connections_refused_total").unwrap_or(0.0) > 0.0,
        "{metrics}"
    );
    metrics
}

/// Checks the agent's `log` and a scrape's `metrics`: both libcs attached (the host's
/// and the copy in `private`), samples read and nothing undecodable.
fn check_both_libcs_and_metrics(log: &str, metrics: &str, private: &Path) {
    // Two images attached: the host libc and the namespace's copy.
    let attached: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("attached") && l.contains("libc.so.6"))
        .collect();
    assert!(
        attached
            .iter()
            .any(|l| l.contains(&format!("{}/libc.so.6", private.display()))),
        "the namespace's libc was not attached: {log}"
    );
    assert!(attached.len() >= 2, "{attached:?}");
    // Probes in at the scrape: under the default overhead budget an image's probes are
    // in only during its windows, and a scrape between them reads fewer (seen: 0, with
    // both images windowed). The budget names every image it plans, attached at least
    // once, in its per-image series: both libcs must be there, the copy by its path.
    let planned: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("allocbpf_budget_image_probed_fraction{"))
        .filter(|l| l.contains("libc.so.6"))
        .collect();
    assert!(
        metric(metrics, "allocbpf_attached_images").unwrap() >= 2.0
            || (planned.len() >= 2
                && planned
                    .iter()
                    .any(|l| l.contains(&format!("{}/libc.so.6", private.display())))),
        "{metrics}"
    );
    assert!(
        metric(metrics, "allocbpf_samples_total").unwrap() > 0.0,
        "{metrics}"
    );
    // Samples were read, so the ring held at least one record; nothing was
    // undecodable, and the kernel counters of full maps are exported.
    assert!(
        metric(metrics, "allocbpf_ring_buffer_peak_bytes").unwrap() > 0.0,
        "{metrics}"
    );
    assert_eq!(
        metric(metrics, "allocbpf_malformed_records_total"),
        Some(0.0),
        "{metrics}"
    );
    assert!(
        metric(metrics, "allocbpf_process_map_full_total").is_some(),
        "{metrics}"
    );
}

/// Checks that each of `workloads` (with whether it started after the agent) has
/// profiles in `store`, symbolized and carrying every process label, and that only
/// our workloads passed the filter.
fn check_stored_labels(
    store: &Path,
    scratch: &Path,
    binary: &Path,
    workloads: [(&Workload, bool); 2],
) {
    let profiles = stored_profiles(store);
    for (workload, started_after) in workloads {
        let mine: Vec<&PathBuf> = profiles
            .iter()
            .filter(|p| parse_stored_name(p).2 == workload.pid)
            .collect();
        assert!(
            !mine.is_empty(),
            "no profile of pid {} (started after the agent: {started_after}); store has {profiles:?}",
            workload.pid
        );
        let text = raw_pprof(mine[mine.len() / 2], scratch);
        assert!(text.contains("agentwl_alloc_site"), "{text}");
        let exe = std::fs::canonicalize(binary).unwrap();
        for label in [
            "comm:[agentwl".to_string(),
            format!("exe:[{}]", exe.display()),
            format!("pid:[{}]", workload.pid),
            "hostname:[".to_string(),
            "exe_build_id:[".to_string(),
            "cgroup:[".to_string(),
        ] {
            assert!(text.contains(&label), "missing {label} in {text}");
        }
        // Only our workloads pass the filter.
        assert!(profiles
            .iter()
            .all(|p| parse_stored_name(p).3.starts_with("agentwl")));
    }
}

/// `allocbpf report` of our workloads' profiles in `store`, in `format`, with `more`
/// arguments.
fn store_report(store: &Path, format: &str, more: &[&str]) -> allocbpf_e2e::Finished {
    let mut args = vec![
        "report",
        "--store",
        store.to_str().unwrap(),
        "--comm",
        "^agentwl",
        "--format",
        format,
    ];
    args.extend_from_slice(more);
    allocbpf_e2e::run_allocbpf(&args, Duration::from_secs(60)).unwrap()
}

/// Checks that `allocbpf report` merges what the agent stored, as JSON and as one page
/// with a timeline point per stored profile of each workload (`pids`), in a browser.
fn check_store_report(store: &Path, scratch: &Path, pids: [u32; 2]) {
    // `allocbpf report` merges what the agent stored.
    let merged = store_report(store, "json", &[]);
    assert_eq!(merged.code, Some(0), "{}", merged.stderr);
    assert!(
        merged.stderr.contains("merged") && !merged.stderr.contains("merged 0 "),
        "{}",
        merged.stderr
    );
    let json: serde_json::Value = serde_json::from_str(&merged.stdout).unwrap();
    assert!(
        json["totals"]["samples"].as_u64().unwrap_or(0) > 0,
        "{:#}",
        json["totals"]
    );
    assert!(merged.stdout.contains("agentwl_alloc_site"));

    // The same store as one page: a timeline point per stored profile, in a browser.
    let page = scratch.join("store.html");
    let html = store_report(store, "html", &["--output", page.to_str().unwrap()]);
    assert_eq!(html.code, Some(0), "{}", html.stderr);
    let data = allocbpf_e2e::page::page_data(&page).unwrap();
    let timelines = data["timelines"].as_array().unwrap();
    let points_of = |pid: u32| {
        timelines
            .iter()
            .find(|t| t["pid"] == pid)
            .map_or(0, |t| t["points"].as_array().unwrap().len())
    };
    let [before, inside] = pids;
    assert!(
        points_of(before) >= 2 && points_of(inside) >= 2,
        "a point per stored profile of each workload: {timelines:?}"
    );
    let seen =
        allocbpf_e2e::page::check_in_browser(&page, "agentwl_alloc_site", "report-store.png")
            .unwrap();
    // The page shows the timeline of the process that allocated most: its heap in use
    // is drawn where it was followed (live tracking observed full time), from each
    // profile's end.
    let allocated = |t: &serde_json::Value| -> f64 {
        t["points"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p[2].as_f64().unwrap())
            .sum()
    };
    let shown = timelines
        .iter()
        .max_by(|a, b| allocated(a).total_cmp(&allocated(b)))
        .unwrap();
    let charts = if shown["live"] == true { 2 } else { 1 };
    assert_eq!(seen.chart_points.len(), charts, "{seen:?}");
}

#[test]
fn sigterm_flushes_the_current_interval_and_retention_bounds_the_store() {
    let (_one, scratch, store) = one_agent_test("agent-flush");
    let binary = agent_workload();
    let config_text = |max_bytes: u64| {
        format!("comm = \"^agentwl\"\nmetrics_address = \"off\"\n[retention]\nmax_bytes = \"{max_bytes}\"\n")
    };
    let config = write_config(&scratch, &config_text(1 << 30));
    // Phase 1: a long interval; only SIGTERM can produce a profile.
    let agent = start_filtered(&config, &store, "1h", &[], &[]);
    let mut work = Workload::start(&binary, &["30"]).unwrap();
    std::thread::sleep(Duration::from_secs(3));
    let term_ms = unix_ms();
    agent.terminate(Duration::from_secs(60)).unwrap();
    let flushed: Vec<_> = stored_profiles(&store)
        .into_iter()
        .filter(|p| parse_stored_name(p).2 == work.pid)
        .collect();
    assert_eq!(flushed.len(), 1, "SIGTERM must store the partial interval");
    let (_, end_ms, _, _) = parse_stored_name(&flushed[0]);
    assert!(end_ms >= term_ms, "flushed profile ends before SIGTERM");
    assert!(raw_pprof(&flushed[0], &scratch).contains("agentwl_alloc_site"));
    // A bound of about four profiles of this workload.
    let one = std::fs::metadata(&flushed[0]).unwrap().len();
    let max_bytes = 4 * one;
    let config = write_config(&scratch, &config_text(max_bytes));

    // Phase 2: short intervals until retention must delete.
    let agent = start_filtered(&config, &store, "1s", &[], &[]);
    let mut largest = 0;
    let deadline = Instant::now() + Duration::from_secs(12);
    while Instant::now() < deadline {
        let total: u64 = stored_profiles(&store)
            .iter()
            .map(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
            .sum();
        largest = largest.max(total);
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = agent.terminate(Duration::from_secs(60)).unwrap();
    let _ = work.child.kill();
    let written: u64 = log
        .lines()
        .find_map(|l| {
            l.split(" written in all")
                .next()?
                .rsplit(' ')
                .next()?
                .parse()
                .ok()
        })
        .expect("agent summary line");
    let left = stored_profiles(&store);
    let total: u64 = left
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum();
    assert!(
        total <= max_bytes,
        "store holds {total} bytes > {max_bytes}"
    );
    // Between a write and its retention pass the store may exceed the bound by at most
    // one interval's profiles (one here: one process).
    // Between a write and its retention pass the store may exceed the bound by one
    // interval's profiles (one here: one process; allow twice the first one's size).
    assert!(
        largest <= max_bytes + 2 * one,
        "store reached {largest} bytes"
    );
    assert!(
        (left.len() as u64) < written,
        "retention deleted nothing: {} stored of {written} written",
        left.len()
    );
    // The oldest (the flushed one) went first.
    assert!(
        !left.contains(&flushed[0]),
        "the oldest profile was kept: {left:?} (written {written}); log: {log}"
    );
}

/// Probes, descriptors and cached facts follow the processes running now: an allocator
/// image only one process mapped (a private copy of mimalloc, LD_PRELOADed) is
/// attached while it runs and detached at the first cut after it exited.
#[test]
fn an_image_no_process_maps_any_more_is_detached() {
    let (_one, scratch, store) = one_agent_test("agent-release");
    let library = scratch.join("libmimalloc-private.so.2");
    std::fs::copy("/usr/lib/x86_64-linux-gnu/libmimalloc.so.2", &library)
        .expect("libmimalloc2.0 is installed by the test setup");
    let config = write_config(&scratch, "comm = \"^agentwl\"\nmetrics_address = \"off\"\n");
    let agent = start_filtered(&config, &store, "1s", &[], &[]);
    let preload = library.to_str().unwrap();
    let mut work =
        Workload::start_env(&agent_workload(), &["4"], &[("LD_PRELOAD", preload)]).unwrap();
    work.child.wait().unwrap();
    // Two cuts after the exit: the one that stores its last profile, and the next.
    std::thread::sleep(Duration::from_secs(3));
    let log = agent.terminate(Duration::from_secs(60)).unwrap();
    let path = library.display().to_string();
    let attached = log
        .lines()
        .position(|l| l.contains("attached") && l.contains("probes to") && l.contains(&path));
    let detached = log
        .lines()
        .position(|l| l.contains(&format!("detached {path}")) && l.contains("no process maps it"));
    assert!(
        matches!((attached, detached), (Some(a), Some(d)) if a < d),
        "the private image was not attached, then detached: {log}"
    );
    // The host's libc, mapped by processes still running, stays attached.
    assert!(
        !log.lines()
            .any(|l| l.contains("detached") && l.contains("/libc.so.6 (")),
        "{log}"
    );
    // Module files are closed at each cut once no stack refers to them, and taken
    // again at the next sample: every interval's profile with samples is still
    // symbolized. (An interval the workload began just before its cut holds its first
    // few calls, counted exactly and possibly not sampled: such a profile is stored,
    // with no stack to name.)
    let mine: Vec<PathBuf> = stored_profiles(&store)
        .into_iter()
        .filter(|p| parse_stored_name(p).2 == work.pid)
        .collect();
    assert!(mine.len() >= 3, "{mine:?}");
    let mut symbolized = 0;
    for profile in &mine {
        let raw = raw_pprof(profile, &scratch);
        // `pprof -raw`: "Samples:", a header line, one line per sample, "Locations".
        let sampled = raw
            .split("\nLocations")
            .next()
            .and_then(|head| head.split("Samples:\n").nth(1))
            .is_some_and(|samples| samples.lines().skip(1).any(|l| !l.trim().is_empty()));
        if sampled {
            assert!(
                raw.contains("agentwl_alloc_site"),
                "{} is not symbolized",
                profile.display()
            );
            symbolized += 1;
        }
    }
    assert!(
        symbolized >= 3,
        "{symbolized} of {} profiles had samples",
        mine.len()
    );
}
