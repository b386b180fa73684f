//! End to end, as root: the agent pushing to a real Grafana Pyroscope (v1.21.1,
//! single binary, filesystem storage), and what Pyroscope then shows: per process, the
//! same totals and stacks as the agent's local store, under the labels the
//! agent sends, whichever way they went (the Connect push API, the legacy `/ingest`,
//! OTLP); none of our values differenced again by the server; and the faults a real
//! store brings: down for 30 s, a missing tenant, slower than the interval.
//!
//! Pyroscope is AGPL and the Go module proxy refuses its modules, so CI cannot build
//! it: the binary comes from `$ALLOCBPF_PYROSCOPE` (docs/build.md), and every test
//! here is ignored unless asked for (`--ignored`), when a missing binary fails it.
//!
//! Why the totals must be equal, not close: Pyroscope stores each sample's int64
//! values as given (it merges samples of equal stacks by adding them, and drops zero
//! ones), and a merged query adds them up again; nothing on the way rounds. A
//! difference means a profile missing, twice, or altered.
//!
//! The helpers these tests share (the agent's config, the `leaks.c` workload, the
//! comparisons with the store) are in `allocbpf_e2e::pyroscope::scenario`.

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use allocbpf_e2e::{
    agent::{agent_workload, metric, one_agent_test, scrape_within, start_filtered},
    compile_workload,
    pyroscope::{
        profile_type_id,
        scenario::{
            assert_a_push_without_delta_false_is_differenced, assert_matches_store,
            assert_observed_fraction_is_no_series_label, assert_series_labels,
            assert_sites_match_truth, by_pid, process_labels, push_to, pyroscope_config, run_leaks,
            start_leaks, stored_types, MEMORY_TYPES,
        },
        time_range, Pyroscope, PyroscopeOptions,
    },
    slow_proxy::SlowProxy,
    stores::{default_service_name, read_store, sum_stored, StoredProfile},
    Workload,
};

/// Two workloads with known allocation sites (64 KiB and 4 KiB blocks), pushed
/// through the push API, and a third that keeps memory (`leaks.c`: the agent's
/// workload frees each block at once, so its in-use values are zero at almost every
/// cut, and Pyroscope keeps no series of a type whose values are all zero): per
/// process, each of the four profile types merged over the run equals the sum of the
/// process's stored profiles (totals and every stack exactly); the series carry the
/// process's labels and no others but the server's own; the profile types are the
/// four memory ones; and Pyroscope's figures agree with the workloads'
/// truth (bytes per object at the site is its block size; the estimate is within the
/// derived bound of the probe's exact count).
#[test]
#[ignore = "needs a Pyroscope server binary in $ALLOCBPF_PYROSCOPE: the Go module proxy refuses github.com/grafana/pyroscope (AGPL), see docs/build.md"]
fn pyroscope_shows_what_the_agent_pushes() {
    let (_one, scratch, store) = one_agent_test("pyroscope-push");
    let pyroscope =
        Pyroscope::start(&scratch.join("pyroscope"), PyroscopeOptions::default()).unwrap();
    let big = agent_workload();
    let small = compile_workload("agentwl", &["-O2", "-g", "-fno-omit-frame-pointer"]).unwrap();
    // Probed full time: the exact counts then cover every call (under the budget they
    // count the observed windows only, while the estimates cover the whole interval).
    let config = pyroscope_config(
        &scratch,
        19483,
        &push_to(&pyroscope),
        "[budget]\nenabled = false\n",
    );
    let agent = start_filtered(&config, &store, "2s", &["--rate", "64KiB"], &[]);
    let mut work_big = Workload::start(&big, &["7"]).unwrap();
    let mut work_small = Workload::start(&small, &["7", "4096"]).unwrap();
    let mut work_leaks = start_leaks();
    let pids = [work_big.pid, work_small.pid, work_leaks.pid];
    let selector = by_pid(&pids);
    let labels = pids.map(process_labels);
    run_leaks(&mut work_leaks);
    work_big.wait(Duration::from_secs(30)).unwrap();
    work_small.wait(Duration::from_secs(30)).unwrap();
    // Stopping cuts the last interval and delivers it.
    let log = agent.terminate(Duration::from_secs(60)).unwrap();
    let stored = read_store(&store, &pids);
    assert!(
        stored.len() >= 7,
        "{} profiles stored; agent log: {log}",
        stored.len()
    );
    let leaks = sum_stored(stored.iter().filter(|p| p.pid == work_leaks.pid));
    let inuse = leaks.totals.get("inuse_space").copied().unwrap_or(0);
    assert!(
        inuse >= 10 << 20,
        "leaks.c keeps 20 MiB: {inuse} bytes in use"
    );
    let compared = assert_matches_store(&pyroscope, &stored, "memory", &selector, None, &log);
    assert_eq!(compared, 3 * 4, "three processes, four types each");

    let all: Vec<&StoredProfile> = stored.iter().collect();
    let (start, end) = time_range(&all);
    assert_eq!(stored_types(&stored, "memory"), MEMORY_TYPES);
    assert_eq!(
        pyroscope.profile_types(start, end, None).unwrap(),
        MEMORY_TYPES
    );
    for (pid, labels) in pids.iter().zip(&labels) {
        let mine: Vec<StoredProfile> = stored.iter().filter(|p| p.pid == *pid).cloned().collect();
        assert_series_labels(
            &pyroscope,
            (&selector(*pid), "memory"),
            labels,
            &[],
            &stored_types(&mine, "memory"),
            (start, end),
        );
    }
    // (Subsets: an agentwl of another test run on this host is profiled too.)
    let pids_seen = pyroscope
        .label_values("pid", &[], start, end, None)
        .unwrap();
    for pid in pids {
        assert!(pids_seen.contains(&pid.to_string()), "{pid}: {pids_seen:?}");
    }

    assert_sites_match_truth(
        &pyroscope,
        &stored,
        &pids,
        [65536.0, 4096.0],
        &selector,
        (start, end),
    );
}

/// The agent's values are per interval already, and it says so (`__delta__=false`):
/// Pyroscope stores each interval as it is, the first one included. Without the
/// label the server would difference the `memory:alloc_*` series itself
/// (pkg/phlaredb/delta.go): the first profile of a series only becomes its baseline
/// and is dropped, each later one loses the previous one's values, and one with a
/// stack smaller than before is dropped whole as a "reset". So each interval's
/// query equals that profile's store total only if the label was sent; and to show
/// the difference is real, the same stored profiles pushed here without the label
/// (to another service) lose their first interval's alloc values and part of the
/// rest, while the first one pushed with it in the same request (to a third) lands
/// whole.
///
/// Under the overhead budget (the default here) the stored profiles carry the
/// per-interval `observed_fraction`: it must not become a series label (a new
/// series every interval).
#[test]
#[ignore = "needs a Pyroscope server binary in $ALLOCBPF_PYROSCOPE: the Go module proxy refuses github.com/grafana/pyroscope (AGPL), see docs/build.md"]
fn no_push_is_differenced_by_the_server() {
    let (_one, scratch, store) = one_agent_test("pyroscope-delta");
    let pyroscope =
        Pyroscope::start(&scratch.join("pyroscope"), PyroscopeOptions::default()).unwrap();
    let config = pyroscope_config(&scratch, 19484, &push_to(&pyroscope), "");
    let agent = start_filtered(&config, &store, "1s", &["--rate", "64KiB"], &[]);
    let mut work = Workload::start(&agent_workload(), &["8"]).unwrap();
    let selector = by_pid(&[work.pid]);
    work.wait(Duration::from_secs(30)).unwrap();
    let log = agent.terminate(Duration::from_secs(60)).unwrap();
    let mut stored = read_store(&store, &[work.pid]);
    stored.sort_by_key(|p| p.time_nanos);
    assert!(
        stored.len() >= 6,
        "{} profiles stored; agent log: {log}",
        stored.len()
    );
    assert_matches_store(&pyroscope, &stored, "memory", &selector, None, &log);

    // Each interval as stored, the first included.
    let compared = pyroscope
        .check_each_profile(&stored, "memory", &selector, None)
        .unwrap_or_else(|error| panic!("{error:#}"));
    // Four types each (live tracking on), but for a last profile cut after the
    // process's last allocation, which has no samples.
    assert!(compared >= (stored.len() - 1) * 4, "{compared} compared");
    assert!(
        stored[0].totals.get("alloc_space").is_some_and(|&t| t > 0),
        "the first interval allocated nothing: the test shows nothing"
    );
    // The same through the time series a dashboard plots, by the second.
    let all: Vec<&StoredProfile> = stored.iter().collect();
    let range = time_range(&all);
    let alloc_space = profile_type_id("memory", "alloc_space");
    let series = pyroscope
        .select_series(&alloc_space, &selector(work.pid), range, 1.0, &[], None)
        .unwrap();
    assert_eq!(series.len(), 1, "{series:?}");
    let plotted: f64 = series[0].points.iter().map(|(_, value)| value).sum();
    let stored_total = sum_stored(&stored).totals["alloc_space"];
    assert_eq!(plotted as i64, stored_total, "{series:?}");

    assert_a_push_without_delta_false_is_differenced(
        &pyroscope,
        &stored,
        &alloc_space,
        range,
        stored_total,
    );

    assert_observed_fraction_is_no_series_label(&pyroscope, &stored, &selector(work.pid), range);
}

/// `push.protocol = "ingest"` (`/ingest?format=pprof`): the profiles land where the
/// push API puts them, under the default service name with the memory profile types,
/// with the same totals and stacks.
#[test]
#[ignore = "needs a Pyroscope server binary in $ALLOCBPF_PYROSCOPE: the Go module proxy refuses github.com/grafana/pyroscope (AGPL), see docs/build.md"]
fn the_legacy_ingest_protocol_lands_in_the_same_place() {
    let (_one, scratch, store) = one_agent_test("pyroscope-ingest");
    let pyroscope =
        Pyroscope::start(&scratch.join("pyroscope"), PyroscopeOptions::default()).unwrap();
    let push = format!("{}\nprotocol = \"ingest\"", push_to(&pyroscope));
    // Probed full time: leaks.c runs for well under a second, which the budget's
    // windows may miss.
    let config = pyroscope_config(&scratch, 19485, &push, "[budget]\nenabled = false\n");
    let agent = start_filtered(&config, &store, "2s", &["--rate", "64KiB"], &[]);
    let mut work = Workload::start(&agent_workload(), &["7"]).unwrap();
    let mut leaks = start_leaks();
    let pids = [work.pid, leaks.pid];
    let labels = pids.map(process_labels);
    let selector = by_pid(&pids);
    run_leaks(&mut leaks);
    work.wait(Duration::from_secs(30)).unwrap();
    let log = agent.terminate(Duration::from_secs(60)).unwrap();
    let stored = read_store(&store, &pids);
    assert!(
        stored.len() >= 4,
        "{} profiles stored; agent log: {log}",
        stored.len()
    );
    let compared = assert_matches_store(&pyroscope, &stored, "memory", &selector, None, &log);
    assert_eq!(compared, 2 * 4);
    let all: Vec<&StoredProfile> = stored.iter().collect();
    let range = time_range(&all);
    assert_eq!(stored_types(&stored, "memory"), MEMORY_TYPES);
    assert_eq!(
        pyroscope.profile_types(range.0, range.1, None).unwrap(),
        MEMORY_TYPES
    );
    let services = pyroscope
        .label_values("service_name", &[], range.0, range.1, None)
        .unwrap();
    for labels in &labels {
        assert!(services.contains(&labels["service_name"]), "{services:?}");
    }
    for (pid, labels) in pids.iter().zip(&labels) {
        let mine: Vec<StoredProfile> = stored.iter().filter(|p| p.pid == *pid).cloned().collect();
        // /ingest adds one label: the spy name, the agent's.
        assert_series_labels(
            &pyroscope,
            (&selector(*pid), "memory"),
            labels,
            &["pyroscope_spy"],
            &stored_types(&mine, "memory"),
            range,
        );
        assert_eq!(
            pyroscope
                .label_values("pyroscope_spy", &[&selector(*pid)], range.0, range.1, None)
                .unwrap(),
            ["allocbpf"]
        );
    }
}

/// Pyroscope is down for 30 s in the middle of a run: the spool keeps what is cut
/// meanwhile, and after the restart (same data directories) every stored profile is
/// queryable, once: a profile sent twice would double its interval's totals.
#[test]
#[ignore = "needs a Pyroscope server binary in $ALLOCBPF_PYROSCOPE: the Go module proxy refuses github.com/grafana/pyroscope (AGPL), see docs/build.md"]
fn pyroscope_down_for_30_seconds_gets_everything_once_afterwards() {
    let (_one, scratch, store) = one_agent_test("pyroscope-outage");
    let mut pyroscope =
        Pyroscope::start(&scratch.join("pyroscope"), PyroscopeOptions::default()).unwrap();
    let config = pyroscope_config(&scratch, 19486, &push_to(&pyroscope), "");
    let agent = start_filtered(&config, &store, "1s", &["--rate", "256KiB"], &[]);
    let mut work = Workload::start(&agent_workload(), &["40"]).unwrap();
    let selector = by_pid(&[work.pid]);
    std::thread::sleep(Duration::from_secs(4));
    pyroscope.stop().unwrap();
    std::thread::sleep(Duration::from_secs(30));
    let waiting = std::fs::read_dir(store.join("spool")).unwrap().count();
    assert!(
        waiting >= 20,
        "{waiting} profiles spooled during the outage"
    );
    let restarted = Instant::now();
    pyroscope.restart().unwrap();
    eprintln!("restarted in {:.1} s", restarted.elapsed().as_secs_f64());
    work.wait(Duration::from_secs(60)).unwrap();
    let log = agent.terminate(Duration::from_secs(60)).unwrap();
    let stored = read_store(&store, &[work.pid]);
    assert_matches_store(&pyroscope, &stored, "memory", &selector, None, &log);
    // Each profile once, whether it went before the outage (now in a block the
    // stopping server wrote), was spooled through it, or came after.
    pyroscope
        .check_each_profile(&stored, "memory", &selector, None)
        .unwrap_or_else(|error| panic!("{error:#}\n{log}"));
    let left = std::fs::read_dir(store.join("spool")).unwrap().count();
    assert_eq!(left, 0, "spool not drained");
}

/// Multitenancy on and no `push.tenant`: every push is refused (401), counted as an
/// error, and kept; with the tenant set (SIGHUP) everything goes, once, and is
/// queryable as that tenant.
#[test]
#[ignore = "needs a Pyroscope server binary in $ALLOCBPF_PYROSCOPE: the Go module proxy refuses github.com/grafana/pyroscope (AGPL), see docs/build.md"]
fn a_missing_tenant_is_refused_counted_and_nothing_is_lost() {
    let (_one, scratch, store) = one_agent_test("pyroscope-tenant");
    let pyroscope = Pyroscope::start(
        &scratch.join("pyroscope"),
        PyroscopeOptions { multitenancy: true },
    )
    .unwrap();
    let config = pyroscope_config(&scratch, 19487, &push_to(&pyroscope), "");
    let mut agent = start_filtered(&config, &store, "1s", &["--rate", "256KiB"], &[]);
    let mut work = Workload::start(&agent_workload(), &["12"]).unwrap();
    let selector = by_pid(&[work.pid]);
    std::thread::sleep(Duration::from_secs(5));
    let metrics = scrape_within("127.0.0.1:19487", Duration::from_secs(5)).unwrap();
    let errors = metric(&metrics, "allocbpf_export_errors_total").unwrap_or(0.0);
    assert!(errors >= 1.0, "no export error counted:\n{metrics}");
    assert_eq!(metric(&metrics, "allocbpf_push_delivered_total"), Some(0.0));
    assert_eq!(metric(&metrics, "allocbpf_push_rejected_total"), Some(0.0));
    let now = allocbpf_e2e::agent::unix_ms();
    let hour_ago = now - 3_600_000;
    assert!(
        pyroscope
            .profile_types(hour_ago, now, Some("team-a"))
            .unwrap()
            .is_empty(),
        "something reached the tenant already"
    );
    pyroscope_config(
        &scratch,
        19487,
        &format!("{}\ntenant = \"team-a\"", push_to(&pyroscope)),
        "",
    );
    let verdict = agent.reload(Duration::from_secs(10)).unwrap();
    assert!(verdict.contains("config reloaded"), "{verdict}");
    work.wait(Duration::from_secs(30)).unwrap();
    let log = agent.terminate(Duration::from_secs(60)).unwrap();
    assert!(log.contains("HTTP 401"), "the refusal is not logged: {log}");
    let stored = read_store(&store, &[work.pid]);
    assert_matches_store(
        &pyroscope,
        &stored,
        "memory",
        &selector,
        Some("team-a"),
        &log,
    );
    pyroscope
        .check_each_profile(&stored, "memory", &selector, Some("team-a"))
        .unwrap_or_else(|error| panic!("{error:#}\n{log}"));
    let all: Vec<&StoredProfile> = stored.iter().collect();
    let (start, end) = time_range(&all);
    let refused = pyroscope.profile_types(start, end, None).unwrap_err();
    assert!(format!("{refused:#}").contains("HTTP 401"), "{refused:#}");
    assert!(
        pyroscope
            .profile_types(start, end, Some("anonymous"))
            .unwrap()
            .is_empty(),
        "profiles under another tenant"
    );
    let left = std::fs::read_dir(store.join("spool")).unwrap().count();
    assert_eq!(left, 0, "spool not drained");
}

/// Pyroscope slower than the interval (every answer 2.5 s late through a proxy, 1 s
/// cuts): sampling and the local store keep their pace, the spool absorbs the
/// difference, and once it is fast again everything is delivered, once.
#[test]
#[ignore = "needs a Pyroscope server binary in $ALLOCBPF_PYROSCOPE: the Go module proxy refuses github.com/grafana/pyroscope (AGPL), see docs/build.md"]
fn a_pyroscope_slower_than_the_interval_loses_nothing() {
    let (_one, scratch, store) = one_agent_test("pyroscope-slow");
    let pyroscope =
        Pyroscope::start(&scratch.join("pyroscope"), PyroscopeOptions::default()).unwrap();
    let proxy = SlowProxy::start(pyroscope.port(), Duration::from_millis(2500)).unwrap();
    let push = format!("url = \"http://127.0.0.1:{}\"", proxy.port());
    let config = pyroscope_config(&scratch, 19488, &push, "");
    let agent = start_filtered(&config, &store, "1s", &["--rate", "256KiB"], &[]);
    let started = Instant::now();
    let mut work = Workload::start(&agent_workload(), &["10"]).unwrap();
    let selector = by_pid(&[work.pid]);
    work.wait(Duration::from_secs(30)).unwrap();
    let elapsed = started.elapsed().as_secs_f64();
    let stored_now = read_store(&store, &[work.pid]).len() as f64;
    assert!(
        stored_now >= elapsed - 3.0,
        "{stored_now} profiles stored in {elapsed:.1} s of 1 s cuts"
    );
    let metrics = scrape_within("127.0.0.1:19488", Duration::from_secs(5)).unwrap();
    let delivered = metric(&metrics, "allocbpf_push_delivered_total").unwrap_or(0.0);
    assert!(
        delivered < stored_now,
        "the slow store kept up ({delivered} of {stored_now}): not a slow-store test"
    );
    proxy.set_delay(Duration::ZERO);
    let log = agent.terminate(Duration::from_secs(60)).unwrap();
    let stored = read_store(&store, &[work.pid]);
    assert_matches_store(&pyroscope, &stored, "memory", &selector, None, &log);
    pyroscope
        .check_each_profile(&stored, "memory", &selector, None)
        .unwrap_or_else(|error| panic!("{error:#}\n{log}"));
    let left = std::fs::read_dir(store.join("spool")).unwrap().count();
    assert_eq!(left, 0, "spool not drained");
}

/// `push.otlp_endpoint` at Pyroscope (no `url`): its OTLP receiver takes our
/// profiles, and files them under the period type's name (v1.21.1 names an OTLP
/// profile's `__name__` after its period type unless it is CPU), so
/// `space:alloc_space:bytes:space:bytes` and its three siblings hold, per process,
/// what the store holds, one series per type with the resource's attributes as
/// labels (the samples' labels, which differ per stack and interval, are not sent).
#[test]
#[ignore = "needs a Pyroscope server binary in $ALLOCBPF_PYROSCOPE: the Go module proxy refuses github.com/grafana/pyroscope (AGPL), see docs/build.md"]
fn pyroscope_accepts_our_otlp_profiles() {
    let (_one, scratch, store) = one_agent_test("pyroscope-otlp");
    let pyroscope =
        Pyroscope::start(&scratch.join("pyroscope"), PyroscopeOptions::default()).unwrap();
    let push = format!("otlp_endpoint = \"{}\"", pyroscope.endpoint());
    // Probed full time: leaks.c runs for well under a second, which the budget's
    // windows may miss.
    let config = pyroscope_config(&scratch, 19489, &push, "[budget]\nenabled = false\n");
    let agent = start_filtered(&config, &store, "2s", &["--rate", "64KiB"], &[]);
    let mut work = Workload::start(&agent_workload(), &["7"]).unwrap();
    let mut leaks = start_leaks();
    let pids = [work.pid, leaks.pid];
    let services: BTreeMap<u32, String> = pids
        .iter()
        .map(|&pid| (pid, default_service_name(pid)))
        .collect();
    let labels = pids.map(process_labels);
    run_leaks(&mut leaks);
    work.wait(Duration::from_secs(30)).unwrap();
    let log = agent.terminate(Duration::from_secs(60)).unwrap();
    let stored = read_store(&store, &pids);
    assert!(
        stored.len() >= 4,
        "{} profiles stored; agent log: {log}",
        stored.len()
    );
    // The resource's attributes are series labels, dots made underscores.
    let selector = |pid: u32| {
        format!(
            "{{service_name=\"{}\", process_pid=\"{pid}\"}}",
            services[&pid]
        )
    };
    let compared = assert_matches_store(&pyroscope, &stored, "space", &selector, None, &log);
    assert_eq!(compared, 2 * 4);
    let all: Vec<&StoredProfile> = stored.iter().collect();
    let (start, end) = time_range(&all);
    assert_eq!(
        pyroscope.profile_types(start, end, None).unwrap(),
        MEMORY_TYPES.map(|t| t.replacen("memory:", "space:", 1))
    );
    // The resource's attributes, in the semantic conventions' names; the scope's
    // one attribute; and nothing of the samples (the agent leaves their labels out).
    for (pid, labels) in pids.iter().zip(&labels) {
        let exe_name = labels["exe"].rsplit('/').next().unwrap().to_string();
        let resource = BTreeMap::from([
            ("service_name", labels["service_name"].clone()),
            ("host_name", labels["hostname"].clone()),
            ("process_pid", labels["pid"].clone()),
            ("comm", labels["comm"].clone()),
            ("process_executable_name", exe_name),
            ("process_executable_path", labels["exe"].clone()),
            (
                "process_executable_build_id_gnu",
                labels["exe_build_id"].clone(),
            ),
            ("process_linux_cgroup", format!("0::{}", labels["cgroup"])),
        ]);
        let mine: Vec<StoredProfile> = stored.iter().filter(|p| p.pid == *pid).cloned().collect();
        assert_series_labels(
            &pyroscope,
            (&selector(*pid), "space"),
            &resource,
            &["pprof_scope_default_sample_type"],
            &stored_types(&mine, "space"),
            (start, end),
        );
    }
    let left = std::fs::read_dir(store.join("spool-otlp")).unwrap().count();
    assert_eq!(left, 0, "spool not drained");
}
