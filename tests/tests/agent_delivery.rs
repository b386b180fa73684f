//! End to end, as root: `allocbpf agent` against real processes through real probes.
//!
//! The agent is system-wide, so its tests run one at a time (a lock) and filter on
//! the workloads' command name to keep other processes' profiles out of the way.
//! This file: delivery to a Pyroscope-compatible receiver.

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use allocbpf_e2e::{
    agent::{
        agent_workload, metric, one_agent_test, raw_pprof, scrape_within, start_filtered, unix_ms,
        write_config, Receiver,
    },
    Lines, Workload,
};

/// What tells a profile apart however it travels: its start and its comments (pid,
/// exact totals...). The push sends Pyroscope a copy without per-sample string labels,
/// so bytes differ from the stored file's.
type Identity = (i64, Vec<String>);

fn identity(gzipped: &[u8]) -> Identity {
    let profile = allocbpf_export::pprof::decode_gzipped(gzipped, 1 << 30).expect("a pprof");
    let comments = profile
        .comment
        .iter()
        .map(|&i| profile.string_table[i as usize].clone())
        .collect();
    (profile.time_nanos, comments)
}

#[test]
fn profiles_reach_the_receiver_and_the_spool_delivers_them_after_an_outage() {
    let (_one, scratch, store) = one_agent_test("agent-push");
    let binary = agent_workload();
    // Reserve a port, then close it: the receiver is down when the agent starts.
    let port = Receiver::start(0).unwrap().port();
    std::thread::sleep(Duration::from_millis(100));
    let config = write_config(
        &scratch,
        &format!(
            "comm = \"^agentwl\"\nmetrics_address = \"off\"\n[push]\nprotocol = \"ingest\"\nurl = \"http://127.0.0.1:{port}\"\napplication = \"allocbpf-test\"\ntimeout = \"2s\"\n# The receiver is local plain HTTP; credentials over http:// must be allowed.\nallow_insecure_http = true\n"
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
        let text = raw_pprof(&path, &scratch);
        // Every sample is labelled with the pid; a profile of an interval in which the
        // workload made a call or three can hold no sample at all (at 64 KiB, three
        // 64 KiB calls all go unsampled with probability 0.37^3 = 5%), and then says
        // whose it is in its comments.
        assert!(
            text.contains(&format!("pid:[{}]", work.pid))
                || text.contains(&format!("Comment: pid={}\n", work.pid)),
            "{text}"
        );
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
            "comm = \"^agentwl\"\nmetrics_address = \"127.0.0.1:19465\"\n[push]\nprotocol = \"ingest\"\nurl = \"http://127.0.0.1:{}\"\ntimeout = \"2s\"\n",
            receiver.port()
        ),
    );
    let agent = start_filtered(&config, &store, "1s", &["--rate", "64KiB"], &[]);
    let mut work = Workload::start(&agent_workload(), &["20"]).unwrap();
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
            "comm = \"^agentwl\"\nmetrics_address = \"off\"\n{extra}[push]\nprotocol = \"ingest\"\nurl = \"http://127.0.0.1:{}\"\ntimeout = \"2s\"\nallow_insecure_http = true\ncredentials_file = \"{}\"\n",
            receiver.port(),
            credentials.display()
        )
    };
    let config = write_config(&scratch, &config_text(""));
    let mut agent = start_filtered(&config, &store, "1s", &["--rate", "64KiB"], &[]);
    let mut work = Workload::start(&agent_workload(), &["16"]).unwrap();
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

/// A CA and a server certificate for `localhost` and 127.0.0.1 it signed, made with the
/// openssl command line in `dir`: returns (CA bundle, server certificate, server key).
fn private_ca(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let run = |args: &[&str]| {
        let status = std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stderr(std::process::Stdio::null())
            .status()
            .expect("openssl is installed by the test setup");
        assert!(status.success(), "openssl {args:?}");
    };
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n",
    )
    .unwrap();
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-subj",
        "/CN=allocbpf test CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign",
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
    ]);
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-out",
        "server.pem",
        "-extfile",
        "server.ext",
    ]);
    (
        dir.join("ca.pem"),
        dir.join("server.pem"),
        dir.join("server.key"),
    )
}

/// An HTTPS receiver (Python's ssl module) that answers 200 to every POST and prints a
/// line for each; returns the process and its port.
fn https_receiver(certificate: &Path, key: &Path) -> (std::process::Child, u16, Lines) {
    const SERVER: &str = r#"
import http.server, ssl, sys
class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.end_headers()
        print("POST", self.path, flush=True)
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(sys.argv[1], sys.argv[2])
server.socket = context.wrap_socket(server.socket, server_side=True)
print(server.server_address[1], flush=True)
server.serve_forever()
"#;
    let mut child = std::process::Command::new("python3")
        .args(["-c", SERVER])
        .arg(certificate)
        .arg(key)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = Lines::spawn(child.stdout.take().unwrap());
    let port = lines
        .wait_for("", Duration::from_secs(10))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    (child, port, lines)
}

/// A Pyroscope behind a private CA: with `push.ca_file` naming the CA, profiles are
/// delivered over https; without it, the server's certificate is refused (counted as
/// export errors, nothing delivered), never accepted blindly.
#[test]
fn a_private_ca_bundle_is_trusted_for_the_push_and_nothing_else_is() {
    let (_one, scratch, store) = one_agent_test("agent-private-ca");
    let (ca, certificate, key) = private_ca(&scratch);
    let (mut server, port, mut posts) = https_receiver(&certificate, &key);
    let binary = agent_workload();
    let run = |ca_line: &str, seconds: u64| {
        let config = write_config(
            &scratch,
            &format!(
                "comm = \"^agentwl\"\nmetrics_address = \"127.0.0.1:19468\"\n[push]\nprotocol = \"ingest\"\nurl = \"https://localhost:{port}\"\ntimeout = \"2s\"\n{ca_line}"
            ),
        );
        let agent = start_filtered(&config, &store, "1s", &[], &[]);
        let mut work = Workload::start(&binary, &[&seconds.to_string()]).unwrap();
        std::thread::sleep(Duration::from_secs(seconds + 2));
        let metrics = scrape_within("127.0.0.1:19468", Duration::from_secs(5)).unwrap();
        let log = agent.terminate(Duration::from_secs(60)).unwrap();
        let _ = work.child.kill();
        (
            metric(&metrics, "allocbpf_push_delivered_total").unwrap_or(0.0),
            metric(&metrics, "allocbpf_export_errors_total").unwrap_or(0.0),
            log,
        )
    };
    // Without the CA: refused, and nothing reaches the server.
    let (delivered, errors, log) = run("", 3);
    assert_eq!(delivered, 0.0, "delivered without trusting the CA: {log}");
    assert!(errors > 0.0, "no export error counted: {log}");
    let seen = posts.rest(Duration::from_millis(500));
    assert!(!seen.contains("POST"), "the server got a request: {seen}");
    // With it: delivered (the spool of the first run too).
    let (delivered, _, log) = run(&format!("ca_file = \"{}\"\n", ca.display()), 4);
    let _ = server.kill();
    let _ = server.wait();
    assert!(delivered >= 2.0, "delivered {delivered}: {log}");
    assert!(
        posts.rest(Duration::from_secs(1)).contains("POST /ingest"),
        "the server saw no ingest"
    );
}

/// SIGHUP restarts the push while 1 s cuts keep coming: every stored profile reaches
/// the receiver exactly once. Each reload used to open a second spool on the directory
/// the writer still wrote through the first, numbering records alike: records were
/// overwritten (lost) or found gone (counted as rejected).
#[test]
fn sighup_during_one_second_cuts_delivers_every_profile_exactly_once() {
    let (_one, scratch, store) = one_agent_test("agent-sighup-once");
    let receiver = Receiver::start(0).unwrap();
    let config = write_config(
        &scratch,
        &format!(
            "comm = \"^agentwl\"\nmetrics_address = \"127.0.0.1:19469\"\n[push]\nprotocol = \"ingest\"\nurl = \"http://127.0.0.1:{}\"\ntimeout = \"2s\"\n",
            receiver.port()
        ),
    );
    let mut agent = start_filtered(&config, &store, "1s", &["--rate", "64KiB"], &[]);
    let mut work = Workload::start(&agent_workload(), &["10"]).unwrap();
    let mut reloads = 0;
    let reloading_until = Instant::now() + Duration::from_secs(8);
    while Instant::now() < reloading_until {
        let verdict = agent.reload(Duration::from_secs(10)).unwrap();
        assert!(verdict.contains("config reloaded"), "{verdict}");
        reloads += 1;
        std::thread::sleep(Duration::from_millis(150));
    }
    work.wait(Duration::from_secs(30)).unwrap();
    std::thread::sleep(Duration::from_secs(2));
    let metrics = scrape_within("127.0.0.1:19469", Duration::from_secs(5)).unwrap();
    let log = agent.terminate(Duration::from_secs(60)).unwrap();
    let stored: Vec<Identity> = allocbpf_e2e::agent::stored_profiles(&store)
        .iter()
        .map(|p| identity(&std::fs::read(p).unwrap()))
        .collect();
    let received: Vec<Identity> = receiver
        .received
        .lock()
        .unwrap()
        .iter()
        .map(|r| identity(&r.profile_part().expect("profile part")))
        .collect();
    assert!(
        stored.len() >= 8,
        "{} profiles stored in 10 s of 1 s cuts",
        stored.len()
    );
    for (i, body) in stored.iter().enumerate() {
        let times = received.iter().filter(|r| *r == body).count();
        assert_eq!(
            times,
            1,
            "stored profile {i} of {} received {times} times ({} received, {reloads} reloads); log: {log}",
            stored.len(),
            received.len()
        );
    }
    assert_eq!(
        received.len(),
        stored.len(),
        "received a profile never stored"
    );
    for name in [
        "allocbpf_push_rejected_total",
        "allocbpf_push_dropped_total",
    ] {
        assert_eq!(
            metric(&metrics, name).unwrap_or(0.0),
            0.0,
            "{name}: {metrics}"
        );
    }
    let left = std::fs::read_dir(store.join("spool")).unwrap().count();
    assert_eq!(left, 0, "spool not drained");
}

/// A receiver that answers 500 for one series (one process's profiles) only: the other
/// process's profiles are delivered as they come, the failing ones wait in the spool
/// behind them (retried on their own back-off), nothing is dropped as never
/// deliverable. Before, the first 500 held every profile behind it.
#[test]
fn a_receiver_failing_one_series_does_not_hold_back_the_others() {
    let (_one, scratch, store) = one_agent_test("agent-one-series");
    let receiver = Receiver::start(0).unwrap();
    let binary = agent_workload();
    let config = write_config(
        &scratch,
        &format!(
            "comm = \"^agentwl\"\nmetrics_address = \"127.0.0.1:19470\"\n[push]\nprotocol = \"ingest\"\nurl = \"http://127.0.0.1:{}\"\ntimeout = \"2s\"\n",
            receiver.port()
        ),
    );
    let agent = start_filtered(&config, &store, "1s", &["--rate", "64KiB"], &[]);
    let mut failing = Workload::start(&binary, &["12"]).unwrap();
    receiver.answer_when(&format!("pid={},", failing.pid), 500);
    let mut good = Workload::start(&binary, &["12"]).unwrap();
    failing.wait(Duration::from_secs(30)).unwrap();
    good.wait(Duration::from_secs(30)).unwrap();
    // A profile behind a failing one waits a back-off pause of a few seconds at most.
    std::thread::sleep(Duration::from_secs(8));
    let metrics = scrape_within("127.0.0.1:19470", Duration::from_secs(5)).unwrap();
    let received = receiver.received.lock().unwrap().clone();
    let stored_of = |pid: u32| -> Vec<Identity> {
        allocbpf_e2e::agent::stored_profiles(&store)
            .iter()
            .filter(|p| allocbpf_e2e::agent::parse_stored_name(p).2 == pid)
            .map(|p| identity(&std::fs::read(p).unwrap()))
            .collect()
    };
    let good_stored = stored_of(good.pid);
    assert!(good_stored.len() >= 8, "{} profiles", good_stored.len());
    let delivered: Vec<Identity> = received
        .iter()
        .filter(|r| r.status == 200)
        .filter_map(|r| r.profile_part())
        .map(|body| identity(&body))
        .collect();
    let missing = good_stored
        .iter()
        .filter(|body| !delivered.contains(body))
        .count();
    assert_eq!(
        missing,
        0,
        "{missing} of the other series' {} profiles held back ({} requests, {} answered 500)",
        good_stored.len(),
        received.len(),
        received.iter().filter(|r| r.status == 500).count()
    );
    // The failing series was tried, and retried.
    let failing_stored = stored_of(failing.pid);
    let failed: Vec<Identity> = received
        .iter()
        .filter(|r| r.status == 500)
        .filter_map(|r| r.profile_part())
        .map(|body| identity(&body))
        .collect();
    assert!(
        failing_stored
            .iter()
            .any(|body| failed.iter().filter(|f| *f == body).count() >= 2),
        "no failing profile retried ({} failures)",
        failed.len()
    );
    assert!(metric(&metrics, "allocbpf_export_errors_total").unwrap_or(0.0) >= 2.0);
    assert_eq!(
        metric(&metrics, "allocbpf_push_rejected_total").unwrap_or(0.0),
        0.0,
        "a 500 is not a rejection: {metrics}"
    );
    let log = agent.terminate(Duration::from_secs(60)).unwrap();
    // What was not delivered is still spooled (or counted as abandoned), not lost.
    let spooled = std::fs::read_dir(store.join("spool")).unwrap().count() as f64;
    let abandoned = metric(&metrics, "allocbpf_push_abandoned_total").unwrap_or(0.0);
    assert!(
        spooled + abandoned >= 1.0,
        "the failing series vanished: {log}"
    );
}
