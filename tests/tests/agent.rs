//! End to end, as root: `allocbpf agent` against real processes through real probes.
//!
//! The agent is system-wide, so these tests run one at a time (a lock) and filter on
//! the workloads' command name to keep other processes' profiles out of the way.

use std::{
    path::{Path, PathBuf},
    sync::{Mutex, MutexGuard},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use allocbpf_e2e::{
    agent::{
        metric, parse_stored_name, scrape_within, stored_profiles, write_config, AgentProcess,
        Receiver,
    },
    compile_workload, go_pprof, require_root, scratch_dir, Workload,
};

static ONE_AGENT_AT_A_TIME: Mutex<()> = Mutex::new(());

/// What every test here starts with: root, the one-agent lock (held until the guard
/// drops), and a scratch directory named `name` (canonical: the maps show real paths)
/// with the store path under it.
fn one_agent_test(name: &str) -> (MutexGuard<'static, ()>, PathBuf, PathBuf) {
    require_root();
    let guard = ONE_AGENT_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let scratch = std::fs::canonicalize(scratch_dir(name)).unwrap();
    let store = scratch.join("store");
    (guard, scratch, store)
}

fn workload() -> PathBuf {
    compile_workload("agentwl", &["-O1", "-g", "-fno-omit-frame-pointer"]).unwrap()
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// `go tool pprof -raw` of a gzipped profile.
fn raw(profile: &Path, scratch: &Path) -> String {
    go_pprof(&["-raw"], profile, scratch)
}

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
    let binary = workload();
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
    // Started AFTER the agent, in its own mount namespace, with a copy of libc at a path
    // only that namespace has (a tmpfs: another device and inode).
    let private = scratch.join("private-lib");
    std::fs::create_dir_all(&private).unwrap();
    let script = format!(
        "mount -t tmpfs none {dir} && cp {libc} {dir}/libc.so.6 && \
         LD_LIBRARY_PATH={dir} exec {bin} 8",
        dir = private.display(),
        libc = host_libc().display(),
        bin = binary.display()
    );
    let mut inside = Workload::start(
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
    std::thread::sleep(Duration::from_secs(5));
    // 200 idle connections (anybody on the network can open them): the endpoint keeps
    // at most 16, closes each within 2 s, and still answers a scrape.
    let idle: Vec<std::net::TcpStream> = (0..200)
        .map(|_| std::net::TcpStream::connect("127.0.0.1:19464").unwrap())
        .collect();
    let flooded = Instant::now();
    let metrics = loop {
        let answer = scrape_within("127.0.0.1:19464", Duration::from_secs(3));
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
    inside.wait(Duration::from_secs(30)).unwrap();
    before.wait(Duration::from_secs(30)).unwrap();
    let log = agent.terminate(Duration::from_secs(60)).unwrap();

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
    assert!(
        metric(&metrics, "allocbpf_attached_images").unwrap() >= 2.0,
        "{metrics}"
    );
    assert!(
        metric(&metrics, "allocbpf_samples_total").unwrap() > 0.0,
        "{metrics}"
    );
    // Samples were read, so the ring held at least one record; nothing was
    // undecodable, and the kernel counters of full maps are exported.
    assert!(
        metric(&metrics, "allocbpf_ring_buffer_peak_bytes").unwrap() > 0.0,
        "{metrics}"
    );
    assert_eq!(
        metric(&metrics, "allocbpf_malformed_records_total"),
        Some(0.0),
        "{metrics}"
    );
    assert!(
        metric(&metrics, "allocbpf_process_map_full_total").is_some(),
        "{metrics}"
    );

    let profiles = stored_profiles(&store);
    for (workload, started_after) in [(&before, false), (&inside, true)] {
        let mine: Vec<&PathBuf> = profiles
            .iter()
            .filter(|p| parse_stored_name(p).2 == workload.pid)
            .collect();
        assert!(
            !mine.is_empty(),
            "no profile of pid {} (started after the agent: {started_after}); store has {profiles:?}",
            workload.pid
        );
        let text = raw(mine[mine.len() / 2], &scratch);
        assert!(text.contains("agentwl_alloc_site"), "{text}");
        let exe = std::fs::canonicalize(&binary).unwrap();
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

#[test]
fn profiles_reach_the_receiver_and_the_spool_delivers_them_after_an_outage() {
    let (_one, scratch, store) = one_agent_test("agent-push");
    let binary = workload();
    // Reserve a port, then close it: the receiver is down when the agent starts.
    let port = Receiver::start(0).unwrap().port();
    std::thread::sleep(Duration::from_millis(100));
    let config = write_config(
        &scratch,
        &format!(
            "comm = \"^agentwl\"\nmetrics_address = \"off\"\n[push]\nurl = \"http://127.0.0.1:{port}\"\napplication = \"allocbpf-test\"\ntimeout = \"2s\"\n# The receiver is local plain HTTP; credentials over http:// must be allowed.\nallow_insecure_http = true\n"
        ),
    );
    let test_started_ms = unix_ms();
    let agent = start_filtered(
        &config,
        &store,
        "1s",
        &["--rate", "64KiB"],
        &[("ALLOCBPF_PUSH_TOKEN", "s3cret")],
    );
    let mut work = Workload::start(&binary, &["14"]).unwrap();
    // Down for ~5 intervals: profiles pile up in the spool.
    std::thread::sleep(Duration::from_secs(5));
    let spooled = std::fs::read_dir(store.join("spool")).unwrap().count();
    assert!(spooled >= 2, "nothing spooled while the receiver was down");
    let up_ms = unix_ms();
    let receiver = Receiver::start(port).unwrap();
    work.wait(Duration::from_secs(30)).unwrap();
    // The back-off is at most 60 s; here it is 8 s or less after 5 s down.
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let got = receiver.received.lock().unwrap().len();
        let left = std::fs::read_dir(store.join("spool")).unwrap().count();
        if got > spooled && left == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let log = agent.terminate(Duration::from_secs(60)).unwrap();
    let received = receiver.received.lock().unwrap().clone();
    assert!(!received.is_empty(), "nothing received; agent log: {log}");
    let left: Vec<_> = std::fs::read_dir(store.join("spool")).unwrap().collect();
    assert!(left.is_empty(), "spool not drained: {left:?}");

    let mut from_outage = 0;
    let mut with_site = 0;
    for (i, request) in received.iter().enumerate() {
        assert!(request.target.starts_with("/ingest?"), "{}", request.target);
        assert_eq!(request.query("format").as_deref(), Some("pprof"));
        let name = request.query("name").unwrap();
        assert!(name.starts_with("allocbpf-test{"), "{name}");
        assert!(name.contains(&format!("pid={}", work.pid)), "{name}");
        assert!(name.contains("comm=agentwl"), "{name}");
        assert!(name.contains("hostname="), "{name}");
        let from: u64 = request.query("from").unwrap().parse().unwrap();
        let until: u64 = request.query("until").unwrap().parse().unwrap();
        assert!(from < until, "{from} {until}");
        assert!(
            from * 1000 + 1000 >= test_started_ms,
            "{from} vs {test_started_ms}"
        );
        assert!(until * 1000 <= unix_ms() + 1000);
        if until * 1000 < up_ms {
            from_outage += 1;
        }
        let auth = request
            .headers
            .iter()
            .find(|(k, _)| k == "authorization")
            .map(|(_, v)| v.as_str());
        assert_eq!(auth, Some("Bearer s3cret"));
        let profile = request.profile_part().expect("multipart profile part");
        let path = scratch.join(format!("received-{i}.pb.gz"));
        std::fs::write(&path, profile).unwrap();
        let text = raw(&path, &scratch);
        assert!(text.contains(&format!("pid:[{}]", work.pid)), "{text}");
        if text.contains("agentwl_alloc_site") {
            with_site += 1;
        }
    }
    assert!(
        from_outage >= 2,
        "profiles cut during the outage did not arrive ({from_outage} of {})",
        received.len()
    );
    assert!(
        with_site >= received.len() / 2,
        "{with_site} of {}",
        received.len()
    );
}

/// An agent with `config` storing into `store`, cutting every `interval`, with `extra`
/// flags and `env` variables.
fn start_filtered(
    config: &Path,
    store: &Path,
    interval: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> AgentProcess {
    let mut args = vec![
        "--config",
        config.to_str().unwrap(),
        "--store",
        store.to_str().unwrap(),
        "--interval",
        interval,
    ];
    args.extend_from_slice(extra);
    AgentProcess::start(&args, env).unwrap()
}

#[test]
fn sigterm_flushes_the_current_interval_and_retention_bounds_the_store() {
    let (_one, scratch, store) = one_agent_test("agent-flush");
    let binary = workload();
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
    assert!(raw(&flushed[0], &scratch).contains("agentwl_alloc_site"));
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

/// Delivery never stops on what can never succeed: a corrupt spool record and the
/// profiles a receiver answers 400 are dropped and counted at once, a 500 is retried,
/// and when the receiver answers 200 again the spool drains. A `.tmp` left by a crash
/// is removed.
#[test]
fn rejected_and_corrupt_records_are_dropped_and_delivery_goes_on() {
    let (_one, scratch, store) = one_agent_test("agent-reject");
    let spool = store.join("spool");
    std::fs::create_dir_all(&spool).unwrap();
    // First in line: a record that does not parse; beside it, half a write.
    let corrupt = spool.join("0000000000000000.spool");
    std::fs::write(&corrupt, b"not json\nnot a profile").unwrap();
    let leftover = spool.join("0000000000000001.tmp");
    std::fs::write(&leftover, b"half").unwrap();
    let receiver = Receiver::start(0).unwrap();
    receiver.answer(400);
    let config = write_config(
        &scratch,
        &format!(
            "comm = \"^agentwl\"\nmetrics_address = \"127.0.0.1:19465\"\n[push]\nurl = \"http://127.0.0.1:{}\"\ntimeout = \"2s\"\n",
            receiver.port()
        ),
    );
    let agent = start_filtered(&config, &store, "1s", &["--rate", "64KiB"], &[]);
    let mut work = Workload::start(&workload(), &["20"]).unwrap();
    std::thread::sleep(Duration::from_secs(4));
    assert!(!corrupt.exists(), "the corrupt record blocks the spool");
    assert!(
        !leftover.exists(),
        "the .tmp left by a crash is still there"
    );
    let status_count = |code: u16| {
        receiver
            .received
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.status == code)
            .count()
    };
    let rejected = status_count(400);
    assert!(
        rejected >= 2,
        "only {rejected} profile(s) reached the 400 receiver"
    );
    // A server error: retried, so profiles wait in the spool.
    receiver.answer(500);
    std::thread::sleep(Duration::from_secs(4));
    let waiting = std::fs::read_dir(&spool).unwrap().count();
    assert!(waiting >= 1, "nothing kept for retry during the 500s");
    receiver.answer(200);
    let deadline = Instant::now() + Duration::from_secs(40);
    while Instant::now() < deadline {
        let left = std::fs::read_dir(&spool).unwrap().count();
        if left == 0 && status_count(200) >= waiting {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        status_count(200) >= waiting,
        "{} delivered after the outage, {waiting} were waiting",
        status_count(200)
    );
    let metrics = scrape_within("127.0.0.1:19465", Duration::from_secs(3)).unwrap();
    // Every 400 and the corrupt record.
    let counted = metric(&metrics, "allocbpf_push_rejected_total").unwrap_or(0.0);
    assert!(
        counted >= rejected as f64 + 1.0,
        "{counted} rejected counted: {metrics}"
    );
    work.wait(Duration::from_secs(30)).unwrap();
    agent.terminate(Duration::from_secs(60)).unwrap();
}

/// SIGHUP applies a config whole or not at all, and reads the push credentials again
/// each time (a rotated token is used without a restart).
#[test]
fn sighup_rereads_credentials_and_rejects_a_broken_config_whole() {
    let (_one, scratch, store) = one_agent_test("agent-sighup");
    let receiver = Receiver::start(0).unwrap();
    let credentials = scratch.join("credentials");
    let write_credentials = |text: &str, mode: u32| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(&credentials, text).unwrap();
        std::fs::set_permissions(&credentials, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    write_credentials("Bearer first\n", 0o600);
    let config_text = |extra: &str| {
        format!(
            "comm = \"^agentwl\"\nmetrics_address = \"off\"\n{extra}[push]\nurl = \"http://127.0.0.1:{}\"\ntimeout = \"2s\"\nallow_insecure_http = true\ncredentials_file = \"{}\"\n",
            receiver.port(),
            credentials.display()
        )
    };
    let config = write_config(&scratch, &config_text(""));
    let mut agent = start_filtered(&config, &store, "1s", &["--rate", "64KiB"], &[]);
    let mut work = Workload::start(&workload(), &["16"]).unwrap();
    let tokens = || -> Vec<String> {
        receiver
            .received
            .lock()
            .unwrap()
            .iter()
            .filter_map(|r| {
                r.headers
                    .iter()
                    .find(|(k, _)| k == "authorization")
                    .map(|(_, v)| v.clone())
            })
            .collect()
    };
    let wait_for_token = |token: &str| {
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if tokens().iter().any(|t| t == token) {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!("no push with {token:?}; seen {:?}", tokens());
    };
    wait_for_token("Bearer first");

    // A config that does not parse: nothing of it applies.
    write_config(&scratch, &config_text("colour = \"blue\"\n"));
    let verdict = agent.reload(Duration::from_secs(10)).unwrap();
    assert!(verdict.contains("not reloaded"), "{verdict}");
    // A config whose push cannot start (credentials readable by others): rejected whole,
    // the running push goes on.
    write_config(&scratch, &config_text(""));
    write_credentials("Bearer second\n", 0o644);
    let verdict = agent.reload(Duration::from_secs(10)).unwrap();
    assert!(
        verdict.contains("not reloaded") && verdict.contains("chmod 600"),
        "{verdict}"
    );
    let before_rotation = tokens().len();
    // The token rotated properly: used from the reload on, with no restart.
    write_credentials("Bearer second\n", 0o600);
    let verdict = agent.reload(Duration::from_secs(10)).unwrap();
    assert!(verdict.contains("config reloaded"), "{verdict}");
    wait_for_token("Bearer second");
    let after: Vec<String> = tokens().split_off(before_rotation);
    let first_new = after.iter().position(|t| t == "Bearer second").unwrap();
    assert!(
        after[first_new..].iter().all(|t| t == "Bearer second"),
        "the old token was used after the rotation: {after:?}"
    );
    work.wait(Duration::from_secs(30)).unwrap();
    agent.terminate(Duration::from_secs(60)).unwrap();
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
    let mut work = Workload::start_env(&workload(), &["4"], &[("LD_PRELOAD", preload)]).unwrap();
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
    // again at the next sample: every interval's profile is still symbolized.
    let mine: Vec<PathBuf> = stored_profiles(&store)
        .into_iter()
        .filter(|p| parse_stored_name(p).2 == work.pid)
        .collect();
    assert!(mine.len() >= 3, "{mine:?}");
    for profile in &mine {
        assert!(
            raw(profile, &scratch).contains("agentwl_alloc_site"),
            "{} is not symbolized",
            profile.display()
        );
    }
}
