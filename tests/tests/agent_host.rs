//! End to end, as root: `allocbpf agent` against real processes through real probes.
//!
//! The agent is system-wide, so its tests run one at a time (a lock) and filter on
//! the workloads' command name to keep other processes' profiles out of the way.
//! This file: the agent among the host's services: a full disk, systemd.

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use allocbpf_e2e::{
    agent::{
        agent_workload, metric, one_agent_test, parse_stored_name, scrape_within, start_filtered,
        stored_profiles, unix_ms, write_config,
    },
    Workload,
};

/// Unmounts a test's file system when the test ends, passed or not.
struct Mounted(PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// A store on a file system far smaller than `retention.max_bytes` fills up: the agent
/// makes room by deleting the oldest profiles (counted), so the newest keep landing,
/// leaves no partial file, answers metrics meanwhile and exits on SIGTERM.
#[test]
fn a_store_on_a_small_full_tmpfs_keeps_the_newest_profiles() {
    let (_one, scratch, store) = one_agent_test("agent-full-store");
    let _ = std::process::Command::new("umount").arg(&store).status();
    std::fs::create_dir_all(&store).unwrap();
    // 8 pages: each profile takes at least one page on tmpfs, and two workloads at a
    // 1 s interval write two a second.
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=32k,mode=0700", "allocbpf-test"])
        .arg(&store)
        .status()
        .unwrap();
    assert!(mounted.success(), "mount tmpfs");
    let _mount = Mounted(store.clone());
    let binary = agent_workload();
    let config = write_config(
        &scratch,
        "comm = \"^agentwl\"\nmetrics_address = \"127.0.0.1:19467\"\n",
    );
    let agent = start_filtered(&config, &store, "1s", &[], &[]);
    let mut first = Workload::start(&binary, &["30"]).unwrap();
    let mut second = Workload::start(&binary, &["30"]).unwrap();
    std::thread::sleep(Duration::from_secs(10));
    let metrics = scrape_within("127.0.0.1:19467", Duration::from_secs(5))
        .expect("metrics answer while the store is full");
    let before_term = unix_ms();
    let log = agent.terminate(Duration::from_secs(60)).unwrap();
    let _ = first.child.kill();
    let _ = second.child.kill();
    let deleted = metric(&metrics, "allocbpf_store_deleted_total").unwrap_or(0.0);
    let written = metric(&metrics, "allocbpf_profiles_written_total").unwrap_or(0.0);
    assert!(
        deleted > 0.0 && written > deleted,
        "deleted {deleted}, written {written}; log: {log}"
    );
    let left = stored_profiles(&store);
    assert!(!left.is_empty(), "nothing stored; log: {log}");
    let newest_end = left.iter().map(|p| parse_stored_name(p).1).max().unwrap();
    assert!(
        newest_end + 3000 >= before_term,
        "the newest profile ended {} ms before SIGTERM: new profiles stopped landing",
        before_term - newest_end
    );
    let partial: Vec<_> = walk(&store)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "tmp"))
        .collect();
    assert!(partial.is_empty(), "partial files left: {partial:?}");
    assert!(log.contains("file system is full"), "log: {log}");
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}

/// Under systemd (`Type=notify`, `WatchdogSec=`) the agent says when it is ready, feeds
/// the watchdog from its main loop, and says when it stops.
#[test]
fn the_agent_speaks_the_systemd_notify_protocol() {
    use std::os::{linux::net::SocketAddrExt, unix::net::SocketAddr};
    let (_one, scratch, store) = one_agent_test("agent-notify");
    let name = format!("allocbpf-e2e-notify-{}", std::process::id());
    let systemd = std::os::unix::net::UnixDatagram::bind_addr(
        &SocketAddr::from_abstract_name(&name).unwrap(),
    )
    .unwrap();
    systemd
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let config = write_config(&scratch, "comm = \"^agentwl\"\nmetrics_address = \"off\"\n");
    let socket = format!("@{name}");
    let agent = start_filtered(
        &config,
        &store,
        "1h",
        &[],
        &[("NOTIFY_SOCKET", &socket), ("WATCHDOG_USEC", "1000000")],
    );
    let mut messages = Vec::new();
    let started = Instant::now();
    let mut buf = [0u8; 256];
    while started.elapsed() < Duration::from_secs(3) {
        if let Ok(n) = systemd.recv(&mut buf) {
            messages.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
    }
    agent.terminate(Duration::from_secs(60)).unwrap();
    while let Ok(n) = systemd.recv(&mut buf) {
        messages.push(String::from_utf8_lossy(&buf[..n]).into_owned());
    }
    assert_eq!(
        messages.first().map(String::as_str),
        Some("READY=1"),
        "{messages:?}"
    );
    // Fed every half period (0.5 s): about 6 in 3 s.
    let fed = messages.iter().filter(|m| *m == "WATCHDOG=1").count();
    assert!(fed >= 4, "watchdog fed {fed} times in 3 s: {messages:?}");
    assert_eq!(
        messages.last().map(String::as_str),
        Some("STOPPING=1"),
        "{messages:?}"
    );
}

/// A host's cron jobs and scripts: 20,000 processes that allocate a little and exit
/// within milliseconds, never sampled, so never tracked. Each leaves kernel entries
/// (exact totals, gate) that only the agent removes; kept, they would fill the
/// 16,384-entry per-process map within the run and every process's totals after it
/// would be lost. The entries must follow the processes running, and a steady process
/// must keep its profiles through the churn.
#[test]
fn short_lived_process_churn_does_not_fill_the_kernel_maps() {
    let (_one, scratch, store) = one_agent_test("agent-churn");
    let churn = scratch.join("churn");
    std::fs::copy(
        allocbpf_e2e::compile_workload("churn", &["-O1"]).unwrap(),
        &churn,
    )
    .unwrap();
    let config = write_config(
        &scratch,
        "comm = \"^(agentwl|churn)\"\nmetrics_address = \"127.0.0.1:19469\"\n",
    );
    let agent = start_filtered(&config, &store, "1s", &[], &[]);
    let mut steady = Workload::start(&agent_workload(), &["30"]).unwrap();
    let forked = std::process::Command::new(&churn)
        .arg("20000")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&forked.stdout).contains("done"));
    // Two cuts after the churn.
    std::thread::sleep(Duration::from_secs(3));
    let metrics = scrape_within("127.0.0.1:19469", Duration::from_secs(5)).unwrap();
    let ended_ms = unix_ms();
    let log = agent.terminate(Duration::from_secs(60)).unwrap();
    let _ = steady.child.kill();
    let value = |name: &str| metric(&metrics, name).unwrap_or(f64::NAN);
    assert!(
        value("allocbpf_exit_events_total") >= 19_000.0,
        "the churn was not seen: {} exits",
        value("allocbpf_exit_events_total")
    );
    assert_eq!(value("allocbpf_process_map_full_total"), 0.0, "{log}");
    let entries = value("allocbpf_kernel_process_entries");
    assert!(
        entries < 200.0,
        "{entries} processes have kernel entries after the churn"
    );
    let newest = stored_profiles(&store)
        .iter()
        .map(|p| parse_stored_name(p))
        .filter(|(_, _, pid, _)| *pid == steady.pid)
        .map(|(_, end, _, _)| end)
        .max()
        .expect("the steady process was profiled");
    assert!(
        newest + 3000 >= ended_ms,
        "the steady process's last profile ended {} ms before the end",
        ended_ms - newest
    );
}
