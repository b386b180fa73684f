//! End to end, as root: the agent exporting OTLP profiles to a real OpenTelemetry
//! Collector (built from its Go modules by `cargo xtask setup`: OTLP receiver, file
//! exporter, bearer-token auth), and the faults a real store brings: down for 30 s,
//! a wrong token, slower than the interval.

use std::{
    collections::BTreeSet,
    path::Path,
    time::{Duration, Instant},
};

use allocbpf_e2e::{
    agent::{agent_workload, metric, one_agent_test, scrape_within, start_filtered, write_config},
    compile_workload,
    otelcol::{Collector, CollectorOptions, ReceivedProfile},
    slow_proxy::SlowProxy,
    stores::{
        check_otlp_matches_store, default_service_name, read_store, truth_bound, StoredProfile,
    },
    Workload,
};

/// The agent's config for these tests: the workloads only, metrics on `metrics_port`,
/// OTLP to `endpoint`.
fn otlp_config(
    scratch: &Path,
    metrics_port: u16,
    endpoint: &str,
    extra: &str,
) -> std::path::PathBuf {
    write_config(
        scratch,
        &format!(
            "comm = \"^agentwl\"\nmetrics_address = \"127.0.0.1:{metrics_port}\"\n[push]\n\
             otlp_endpoint = \"{endpoint}\"\ntimeout = \"5s\"\n{extra}"
        ),
    )
}

/// (pid, start) of each distinct profile received (any sample type).
fn received_profiles(received: &[ReceivedProfile]) -> BTreeSet<(String, u64)> {
    received
        .iter()
        .map(|r| {
            (
                r.resource.get("process.pid").cloned().unwrap_or_default(),
                r.time_unix_nano,
            )
        })
        .collect()
}

/// Each profile stored for `pids` has reached the collector (every sample type).
fn wait_for_store(collector: &Collector, stored: &[StoredProfile]) -> Vec<ReceivedProfile> {
    // A Collector's OTLP receiver answers 200 to a request without a sample and passes
    // nothing on (otlpreceiver internal/profiles/otlp.go): the last interval of a
    // process that exited early in it is not there to find.
    let wanted: BTreeSet<(String, u64)> = stored
        .iter()
        .filter(|p| !p.is_empty())
        .map(|p| (p.pid.to_string(), p.time_nanos))
        .collect();
    collector
        .wait_for(
            |received| wanted.is_subset(&received_profiles(received)),
            Duration::from_secs(90),
        )
        .unwrap_or_else(|error| panic!("{error:#}; collector log: {}", collector.log()))
}

/// Two workloads with known allocation sites (64 KiB and 4 KiB blocks): what the
/// Collector received is what the local store holds, profile by profile (totals and
/// top stacks of alloc and inuse types), each once; resources name the process; and
/// both agree with the workloads' truth.
///
/// The truth bound: at rate R every call of size S is sampled with probability
/// p = 1 - exp(-S/R) and weighted 1/p, so the estimated count over N calls has
/// relative standard deviation sqrt((1-p)/(pN)); the bytes estimate is that count
/// times S. Both sides cover the same intervals (probed full time, the exact count is
/// of every call the estimate stands for): six standard deviations, a chance of about
/// 2e-9 per check.
#[test]
fn the_collector_receives_what_the_agent_stores() {
    let (_one, scratch, store) = one_agent_test("otlp-collector");
    let collector =
        Collector::start(&scratch.join("otelcol"), CollectorOptions::default()).unwrap();
    let big = agent_workload();
    let small = compile_workload("agentwl", &["-O2", "-g", "-fno-omit-frame-pointer"]).unwrap();
    // Probed full time: the exact counts then cover every call (under the budget they
    // count the observed windows only, while the estimates cover the whole interval).
    let config = otlp_config(
        &scratch,
        19471,
        &collector.endpoint(),
        "[budget]\nenabled = false\n",
    );
    let agent = start_filtered(&config, &store, "2s", &["--rate", "64KiB"], &[]);
    let mut work_big = Workload::start(&big, &["7"]).unwrap();
    let mut work_small = Workload::start(&small, &["7", "4096"]).unwrap();
    let pids = [work_big.pid, work_small.pid];
    let services = pids.map(default_service_name);
    work_big.wait(Duration::from_secs(30)).unwrap();
    work_small.wait(Duration::from_secs(30)).unwrap();
    // Stopping cuts the last interval and delivers it.
    let log = agent.terminate(Duration::from_secs(60)).unwrap();
    let stored = read_store(&store, &pids);
    assert!(
        stored.len() >= 6,
        "{} profiles stored; agent log: {log}",
        stored.len()
    );
    let received = wait_for_store(&collector, &stored);
    let compared =
        check_otlp_matches_store(&stored, &received).unwrap_or_else(|error| panic!("{error:#}"));
    assert!(
        compared >= stored.len() * 4,
        "alloc and inuse types: {compared}"
    );

    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    for ((pid, service), (binary, size)) in pids
        .iter()
        .zip(&services)
        .zip([(&big, 65536.0), (&small, 4096.0)])
    {
        let mine: Vec<&ReceivedProfile> = received
            .iter()
            .filter(|r| r.resource.get("process.pid") == Some(&pid.to_string()))
            .collect();
        check_resource(&mine, service, hostname.trim(), binary);
        check_site_estimate(&mine, &stored, *pid, size);
    }
}

/// Checks that the resource of a process's profiles (`mine`) names it: its `service`,
/// the `hostname`, its executable (`binary`) and that executable's build id.
fn check_resource(mine: &[&ReceivedProfile], service: &str, hostname: &str, binary: &Path) {
    let resource = &mine[0].resource;
    assert_eq!(
        resource.get("service.name").map(String::as_str),
        Some(service),
        "{resource:?}"
    );
    assert_eq!(
        resource.get("host.name").map(String::as_str),
        Some(hostname)
    );
    assert_eq!(
        resource.get("process.executable.path").map(String::as_str),
        Some(std::fs::canonicalize(binary).unwrap().to_str().unwrap()),
        "{resource:?}"
    );
    assert!(
        resource.contains_key("process.executable.build_id.gnu"),
        "{resource:?}"
    );
}

/// Checks the allocation site of process `pid`, which allocates blocks of `size`
/// bytes, in its received profiles (`mine`): sampled, its bytes per object the block
/// size, and its estimate within the truth bound of the probe's exact count (from the
/// `stored` profiles).
fn check_site_estimate(mine: &[&ReceivedProfile], stored: &[StoredProfile], pid: u32, size: f64) {
    // The site's own stack: bytes per object is its block size.
    let site = |t: &str| -> f64 {
        mine.iter()
            .filter(|r| r.sample_type == t)
            .flat_map(|r| &r.samples)
            .filter(|s| s.stack.iter().any(|f| f == "agentwl_alloc_site"))
            .map(|s| s.values.iter().sum::<i64>() as f64)
            .sum()
    };
    let (space, objects) = (site("alloc_space"), site("alloc_objects"));
    assert!(
        objects > 0.0,
        "pid {pid}: no sampled calls at agentwl_alloc_site"
    );
    // Each profile's objects value of a stack is its estimate rounded (at most half
    // an object off), its bytes exact: bytes per object is the block size within
    // size * (profiles / 2) / objects.
    let profiles = mine
        .iter()
        .filter(|r| r.sample_type == "alloc_objects")
        .count();
    let per_object = space / objects;
    assert!(
        (per_object - size).abs() <= size * (profiles as f64 / 2.0) / objects + 1e-9,
        "pid {pid}: {per_object} bytes per object where the site allocates {size}"
    );
    // The estimate against the probe's exact count.
    let exact: u64 = stored
        .iter()
        .filter(|p| p.pid == pid)
        .filter_map(|p| p.exact_bytes)
        .sum();
    let calls = exact as f64 / size;
    let bound = truth_bound(size, 65536.0, calls);
    let estimate: f64 = mine
        .iter()
        .filter(|r| r.sample_type == "alloc_space")
        .map(|r| r.total() as f64)
        .sum();
    let error = (estimate / exact as f64 - 1.0).abs();
    assert!(
        error <= bound,
        "pid {pid}: estimate {estimate} vs exact {exact} ({error:.4} > {bound:.4})"
    );
}

/// The Collector is down for 30 s in the middle of a run: the spool keeps what is
/// cut meanwhile, and after the restart every stored profile is delivered, once.
#[test]
fn a_collector_down_for_30_seconds_gets_everything_once_afterwards() {
    let (_one, scratch, store) = one_agent_test("otlp-outage");
    let mut collector =
        Collector::start(&scratch.join("otelcol"), CollectorOptions::default()).unwrap();
    let config = otlp_config(&scratch, 19472, &collector.endpoint(), "");
    let agent = start_filtered(&config, &store, "1s", &["--rate", "256KiB"], &[]);
    let mut work = Workload::start(&agent_workload(), &["40"]).unwrap();
    std::thread::sleep(Duration::from_secs(4));
    collector.stop().unwrap();
    std::thread::sleep(Duration::from_secs(30));
    // 1 s cuts for 30 s: about 30 profiles wait; fewer than 20 would mean cuts stalled
    // behind the dead store.
    let waiting = std::fs::read_dir(store.join("spool-otlp")).unwrap().count();
    assert!(
        waiting >= 20,
        "{waiting} profiles spooled during the outage"
    );
    collector.restart().unwrap();
    work.wait(Duration::from_secs(30)).unwrap();
    let log = agent.terminate(Duration::from_secs(60)).unwrap();
    let stored = read_store(&store, &[work.pid]);
    let received = wait_for_store(&collector, &stored);
    check_otlp_matches_store(&stored, &received).unwrap_or_else(|e| panic!("{e:#}\n{log}"));
    // Nothing twice, even across the restart: one request per profile.
    let requests: BTreeSet<usize> = received.iter().map(|r| r.request).collect();
    assert_eq!(requests.len(), received_profiles(&received).len());
    let left = std::fs::read_dir(store.join("spool-otlp")).unwrap().count();
    assert_eq!(left, 0, "spool not drained");
}

/// A wrong token: every push is refused (401), counted as an error, and kept; with
/// the right token (SIGHUP re-reads the credentials file) everything goes, once.
#[test]
fn a_wrong_token_is_refused_counted_and_nothing_is_lost() {
    let (_one, scratch, store) = one_agent_test("otlp-token");
    let collector = Collector::start(
        &scratch.join("otelcol"),
        CollectorOptions {
            bearer_token: Some("right-token".into()),
            ..CollectorOptions::default()
        },
    )
    .unwrap();
    let credentials = scratch.join("credentials");
    let write_token = |token: &str| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(&credentials, format!("Bearer {token}\n")).unwrap();
        std::fs::set_permissions(&credentials, std::fs::Permissions::from_mode(0o600)).unwrap();
    };
    write_token("wrong-token");
    let config = otlp_config(
        &scratch,
        19473,
        &collector.endpoint(),
        &format!(
            "allow_insecure_http = true\ncredentials_file = \"{}\"\n",
            credentials.display()
        ),
    );
    let mut agent = start_filtered(&config, &store, "1s", &["--rate", "256KiB"], &[]);
    let mut work = Workload::start(&agent_workload(), &["12"]).unwrap();
    std::thread::sleep(Duration::from_secs(5));
    let metrics = scrape_within("127.0.0.1:19473", Duration::from_secs(5)).unwrap();
    let errors = metric(&metrics, "allocbpf_export_errors_total").unwrap_or(0.0);
    assert!(errors >= 1.0, "no export error counted:\n{metrics}");
    assert_eq!(metric(&metrics, "allocbpf_push_delivered_total"), Some(0.0));
    assert_eq!(metric(&metrics, "allocbpf_push_rejected_total"), Some(0.0));
    assert!(collector.received().unwrap().is_empty());
    write_token("right-token");
    let verdict = agent.reload(Duration::from_secs(10)).unwrap();
    assert!(verdict.contains("config reloaded"), "{verdict}");
    work.wait(Duration::from_secs(30)).unwrap();
    let log = agent.terminate(Duration::from_secs(60)).unwrap();
    assert!(log.contains("HTTP 401"), "the refusal is not logged: {log}");
    let stored = read_store(&store, &[work.pid]);
    let received = wait_for_store(&collector, &stored);
    check_otlp_matches_store(&stored, &received).unwrap_or_else(|e| panic!("{e:#}"));
}

/// A store slower than the interval (every answer 2.5 s late, 1 s cuts): sampling
/// and the local store keep their pace, the spool absorbs the difference, and once
/// the store is fast again everything is delivered, once.
#[test]
fn a_store_slower_than_the_interval_loses_nothing() {
    let (_one, scratch, store) = one_agent_test("otlp-slow");
    let collector =
        Collector::start(&scratch.join("otelcol"), CollectorOptions::default()).unwrap();
    let proxy = SlowProxy::start(collector.port(), Duration::from_millis(2500)).unwrap();
    let endpoint = format!("http://127.0.0.1:{}", proxy.port());
    let config = otlp_config(&scratch, 19474, &endpoint, "");
    let agent = start_filtered(&config, &store, "1s", &["--rate", "256KiB"], &[]);
    let started = Instant::now();
    let mut work = Workload::start(&agent_workload(), &["10"]).unwrap();
    work.wait(Duration::from_secs(30)).unwrap();
    let elapsed = started.elapsed().as_secs_f64();
    // One profile per 1 s cut while the process lived: the first cut after the agent
    // saw it and the last one before it ended may be missing, and a cut may run a
    // little late on a busy machine; three short would mean cuts waited for the store.
    let stored_now = read_store(&store, &[work.pid]).len() as f64;
    assert!(
        stored_now >= elapsed - 3.0,
        "{stored_now} profiles stored in {elapsed:.1} s of 1 s cuts"
    );
    let metrics = scrape_within("127.0.0.1:19474", Duration::from_secs(5)).unwrap();
    let delivered = metric(&metrics, "allocbpf_push_delivered_total").unwrap_or(0.0);
    assert!(
        delivered < stored_now,
        "the slow store kept up ({delivered} of {stored_now}): not a slow-store test"
    );
    proxy.set_delay(Duration::ZERO);
    let log = agent.terminate(Duration::from_secs(60)).unwrap();
    let stored = read_store(&store, &[work.pid]);
    let received = wait_for_store(&collector, &stored);
    check_otlp_matches_store(&stored, &received).unwrap_or_else(|e| panic!("{e:#}\n{log}"));
}
