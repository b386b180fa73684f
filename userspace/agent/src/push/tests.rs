//! The delivery loop through fake transports: ordering, failure kinds, reloads.

use std::time::Duration;

use super::spool::{Next, Retry};
use super::{
    deliver::{after_failure, BACKOFF_MAX, MAX_STRIKES},
    *,
};

/// A stand-in for the server: answers by the profile's `pid` label, and records
/// each request's pid and body.
struct Fake {
    sent: Sent,
    answer: fn(&str) -> std::result::Result<(), Failure>,
}

impl Transport for Fake {
    fn send(&self, meta: &PushMeta, profile: &[u8]) -> std::result::Result<(), Failure> {
        let pid = meta
            .labels
            .iter()
            .find(|(k, _)| k == "pid")
            .map_or(String::new(), |(_, v)| v.clone());
        self.sent
            .lock()
            .unwrap()
            .push((pid.clone(), profile.to_vec()));
        (self.answer)(&pid)
    }
}

type Sent = Arc<std::sync::Mutex<Vec<(String, Vec<u8>)>>>;

fn fake_push(
    spool: &Arc<Spool>,
    stats: &Arc<PushStats>,
    answer: fn(&str) -> std::result::Result<(), Failure>,
) -> (PreparedPush, Sent) {
    let sent = Sent::default();
    let prepared = PreparedPush {
        destination: Destination::PyroscopePush,
        transport: Box::new(Fake {
            sent: sent.clone(),
            answer,
        }),
        url: "fake".into(),
        spool_max_bytes: 1 << 20,
        spool: spool.clone(),
        stats: stats.clone(),
    };
    (prepared, sent)
}

fn meta(pid: u32) -> PushMeta {
    PushMeta {
        labels: vec![("pid".into(), pid.to_string())],
        from: 1,
        until: 2,
    }
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("allocbpf-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A reload starts a new pusher on the same spool while profiles keep coming: every
/// profile is delivered exactly once, none overwrites another (one numbering).
#[test]
fn one_spool_is_shared_across_reloads() {
    let dir = scratch("spool-reload");
    let spool = Arc::new(Spool::open(&dir, 1 << 20).unwrap());
    let stats = Arc::new(PushStats::default());
    let mut all_sent = Vec::new();
    let mut pusher: Option<Pusher> = None;
    let mut n = 0u32;
    for _reload in 0..4 {
        let (prepared, sent) = fake_push(&spool, &stats, |_| Ok(()));
        all_sent.push(sent);
        let previous = pusher.take().and_then(Pusher::retire);
        let next = prepared.start(previous).unwrap();
        for _ in 0..5 {
            next.enqueue(&meta(n), format!("profile {n}").as_bytes());
            n += 1;
        }
        pusher = Some(next);
    }
    pusher
        .unwrap()
        .flush(Instant::now() + Duration::from_secs(10));
    let mut bodies: Vec<Vec<u8>> = all_sent
        .iter()
        .flat_map(|sent| sent.lock().unwrap().clone())
        .map(|(_, body)| body)
        .collect();
    bodies.sort();
    let mut expected: Vec<Vec<u8>> = (0..n)
        .map(|i| format!("profile {i}").into_bytes())
        .collect();
    expected.sort();
    assert_eq!(bodies, expected, "each profile exactly once");
    assert_eq!(stats.delivered.load(Ordering::Relaxed), u64::from(n));
    assert_eq!(stats.rejected.load(Ordering::Relaxed), 0);
    assert_eq!(spool.sizes(), (0, 0));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A record that fails on its own (a 500 for one series) does not hold back the
/// others, and is dropped after MAX_STRIKES failures while they were delivered.
#[test]
fn a_failing_record_does_not_hold_back_the_others() {
    let dir = scratch("spool-hol");
    let spool = Arc::new(Spool::open(&dir, 1 << 20).unwrap());
    let stats = Arc::new(PushStats::default());
    let (prepared, sent) = fake_push(&spool, &stats, |pid| match pid {
        "7" => Err(Failure::Record(anyhow::anyhow!("HTTP 500"))),
        _ => Ok(()),
    });
    // The bad record first in line, then a steady flow of good ones.
    for _ in 0..3 {
        spool.push(&meta(7), b"bad").unwrap();
    }
    let pusher = prepared.start(None).unwrap();
    let started = Instant::now();
    for i in 0..4 {
        pusher.enqueue(&meta(100 + i), b"good");
    }
    let delivered = |n| {
        let deadline = Instant::now() + Duration::from_secs(5);
        while stats.delivered.load(Ordering::Relaxed) < n && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        stats.delivered.load(Ordering::Relaxed)
    };
    // Three bad in a row back off everything for 1 s, then 2 s at most.
    assert_eq!(delivered(4), 4, "the good records were held back");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    // The bad ones wait in the spool, retried on their own schedule.
    assert_eq!(spool.sizes().0, 3);
    assert_eq!(stats.abandoned.load(Ordering::Relaxed), 0);
    drop(pusher);
    let tries = |sent: &Sent| {
        sent.lock()
            .unwrap()
            .iter()
            .filter(|(p, _)| p == "7")
            .count()
    };
    assert!(tries(&sent) >= 3, "{}", tries(&sent));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The strike rule: failures count towards dropping only after other records were
/// delivered since the previous one, so a server failing everything loses nothing.
#[test]
fn a_record_is_abandoned_only_while_others_are_delivered() {
    let dir = scratch("spool-strikes");
    let spool = Arc::new(Spool::open(&dir, 1 << 20).unwrap());
    let stats = Arc::new(PushStats::default());
    spool.push(&meta(7), b"bad").unwrap();
    let (bad, _) = match spool.next(Instant::now()) {
        Next::Ready(path, retry) => (path, retry),
        other => panic!("{other:?}"),
    };
    // Fails with no delivery in between, many times: never a strike.
    let now = Instant::now();
    let mut retry = None;
    for _ in 0..20 {
        retry = Some(after_failure(retry, 3, now));
    }
    let mut retry = retry.unwrap();
    assert_eq!((retry.failures, retry.strikes), (20, 0));
    assert_eq!(retry.not_before, now + BACKOFF_MAX);
    // Each failure after others were delivered is one.
    for delivered in 4..6 {
        retry = after_failure(Some(retry), delivered, now);
    }
    assert_eq!((retry.failures, retry.strikes), (22, 2));
    // Set aside: the spool offers nothing until its time, then it again.
    retry.not_before = now + Duration::from_secs(30);
    spool.set_retry(&bad, retry);
    assert_eq!(spool.next(now), Next::Later(now + Duration::from_secs(30)));
    assert!(
        matches!(spool.next(now + Duration::from_secs(31)), Next::Ready(p, Some(_)) if p == bad)
    );
    // A newer record that never failed goes first, even once the bad one is due.
    spool.push(&meta(8), b"good").unwrap();
    assert!(matches!(spool.next(now), Next::Ready(p, None) if p != bad));
    assert!(matches!(spool.next(now + Duration::from_secs(31)), Next::Ready(p, None) if p != bad));
    // Through the delivery loop: one bad record among good ones is dropped after
    // MAX_STRIKES strikes (back-offs shortened by failing it right away here).
    let (prepared, _) = fake_push(&spool, &stats, |pid| match pid {
        "7" => Err(Failure::Record(anyhow::anyhow!("HTTP 500"))),
        _ => Ok(()),
    });
    spool.set_retry(
        &bad,
        Retry {
            failures: 10,
            strikes: MAX_STRIKES - 1,
            delivered_at_failure: 0,
            not_before: now,
        },
    );
    let pusher = prepared.start(None).unwrap();
    pusher.flush(Instant::now() + Duration::from_secs(5));
    assert_eq!(stats.delivered.load(Ordering::Relaxed), 1);
    assert_eq!(stats.abandoned.load(Ordering::Relaxed), 1);
    assert_eq!(spool.sizes(), (0, 0));
    assert!(!bad.exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A server-wide failure holds everything (nothing is skipped or dropped), and a
/// flush starts no request after its deadline.
#[test]
fn a_server_failure_holds_everything_and_flush_keeps_its_deadline() {
    let dir = scratch("spool-server");
    let spool = Arc::new(Spool::open(&dir, 1 << 20).unwrap());
    let stats = Arc::new(PushStats::default());
    let (prepared, sent) = fake_push(&spool, &stats, |_| {
        Err(Failure::Server(anyhow::anyhow!("connection refused")))
    });
    for i in 0..3 {
        spool.push(&meta(i), b"x").unwrap();
    }
    let pusher = prepared.start(None).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    pusher.flush(Instant::now() + Duration::from_millis(500));
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // The first try, and the flush's one more: the first record both times.
    let sent = sent.lock().unwrap().clone();
    assert!(sent.iter().all(|(pid, _)| pid == "0"), "{sent:?}");
    assert_eq!(spool.sizes().0, 3);
    assert_eq!(
        stats.abandoned.load(Ordering::Relaxed) + stats.rejected.load(Ordering::Relaxed),
        0
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_spool_is_bounded_and_ordered() {
    let dir = std::env::temp_dir().join(format!("allocbpf-spool-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let spool = Spool::open(&dir, 900).unwrap();
    let meta = PushMeta {
        labels: vec![],
        from: 1,
        until: 2,
    };
    let mut dropped = 0;
    for _ in 0..5 {
        dropped += spool.push(&meta, &[7u8; 300]).unwrap();
    }
    let (files, bytes) = spool.sizes();
    assert!(bytes <= 900, "{bytes}");
    assert_eq!(files + dropped, 5);
    assert_eq!(dropped, 3);
    let first = spool.front().unwrap();
    assert!(spool.remove(&first));
    assert!(!spool.remove(&first), "removed twice");
    assert_eq!(spool.sizes().0, 1);
    // Records came and went: the directory is synced once, then nothing to do.
    spool.sync_dir().unwrap();
    spool.sync_dir().unwrap();
    // Reopened, the rest is still there, and new records sort after it.
    let reopened = Spool::open(&dir, 1000).unwrap();
    assert_eq!(reopened.sizes().0, 1);
    reopened.push(&meta, b"x").unwrap();
    assert!(reopened.front().unwrap() < dir.join("9999999999999999.spool"));
    // A lower bound (a reload) applies at once, keeping the newest.
    assert_eq!(reopened.set_max_bytes(10), 1);
    assert_eq!(reopened.sizes().0, 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every reload gets the spool the agent opened first for a store: one numbering, one
/// `.tmp` clean-up, whatever the reloads; each store has its own.
#[test]
fn each_store_has_one_spool_for_the_agents_life() {
    let store = scratch("lanes");
    let config = |otlp: bool| PushConfig {
        targets: std::iter::once(PushTarget {
            destination: Destination::PyroscopePush,
            url: "http://127.0.0.1:9".into(),
        })
        .chain(otlp.then(|| PushTarget {
            destination: Destination::Otlp,
            url: "http://127.0.0.1:9".into(),
        }))
        .collect(),
        service_name: None,
        credentials_file: None,
        tenant: None,
        timeout: Duration::from_secs(1),
        spool_max_bytes: 1 << 20,
        max_series: 10,
        allow_insecure_http: false,
        ca_file: None,
    };
    let mut lanes = Lanes::default();
    let first = lanes.prepare(&config(false), &store).unwrap();
    let again = lanes.prepare(&config(true), &store).unwrap();
    assert!(Arc::ptr_eq(&first[0].spool, &again[0].spool));
    assert!(Arc::ptr_eq(&first[0].stats, &again[0].stats));
    assert!(!Arc::ptr_eq(&again[0].spool, &again[1].spool));
    assert!(store.join("spool").is_dir() && store.join("spool-otlp").is_dir());
    assert_eq!(lanes.stats().len(), 2);
    std::fs::remove_dir_all(&store).unwrap();
}

/// A stand-in for a slow server: each send waits for the test to release it.
struct Gated {
    sent: Sent,
    gate: Arc<std::sync::Mutex<mpsc::Receiver<()>>>,
}

impl Transport for Gated {
    fn send(&self, _meta: &PushMeta, profile: &[u8]) -> std::result::Result<(), Failure> {
        self.gate.lock().unwrap().recv().unwrap();
        self.sent
            .lock()
            .unwrap()
            .push((String::new(), profile.to_vec()));
        Ok(())
    }
}

/// A pusher started while the one it replaces still has a request in flight waits for
/// it: the record in flight is sent once, not again by the new pusher.
#[test]
fn a_new_pusher_waits_for_the_request_in_flight_of_the_one_it_replaces() {
    let dir = scratch("spool-inflight");
    let spool = Arc::new(Spool::open(&dir, 1 << 20).unwrap());
    let stats = Arc::new(PushStats::default());
    let sent = Sent::default();
    let (release, gate) = mpsc::channel();
    let gate = Arc::new(std::sync::Mutex::new(gate));
    let prepared = |sent: &Sent| PreparedPush {
        destination: Destination::Otlp,
        transport: Box::new(Gated {
            sent: sent.clone(),
            gate: gate.clone(),
        }),
        url: "gated".into(),
        spool_max_bytes: 1 << 20,
        spool: spool.clone(),
        stats: stats.clone(),
    };
    let first = prepared(&sent).start(None).unwrap();
    first.enqueue(&meta(1), b"one");
    first.enqueue(&meta(2), b"two");
    // The first record is in flight (its send waits at the gate).
    let deadline = Instant::now() + Duration::from_secs(5);
    while gate.try_lock().is_ok() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let second = prepared(&sent).start(first.retire()).unwrap();
    release.send(()).unwrap();
    release.send(()).unwrap();
    second.flush(Instant::now() + Duration::from_secs(10));
    let bodies: Vec<Vec<u8>> = sent
        .lock()
        .unwrap()
        .iter()
        .map(|(_, b)| b.clone())
        .collect();
    assert_eq!(
        bodies,
        vec![b"one".to_vec(), b"two".to_vec()],
        "each once, in order"
    );
    assert_eq!(spool.sizes(), (0, 0));
    std::fs::remove_dir_all(&dir).unwrap();
}
