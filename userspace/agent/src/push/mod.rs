//! Pushing profiles to Grafana Pyroscope, through a bounded on-disk spool.
//!
//! The request (Pyroscope's HTTP ingest API,
//! <https://grafana.com/docs/pyroscope/latest/configure-server/about-server-api/>):
//!
//! ```text
//! POST {url}/ingest?name={application}{hostname=h,pid=1234,comm=nginx,...}
//!                  &from={unix s}&until={unix s}&format=pprof&spyName=allocbpf
//! Content-Type: multipart/form-data; boundary=...
//! Authorization: Bearer TOKEN | Basic base64(USER:PASSWORD)   (if configured)
//! X-Scope-OrgID: TENANT                                       (if configured)
//!
//! one form field "profile" (filename profile.pprof): the gzipped pprof
//! ```
//!
//! Every profile is first written to the spool (`STORE/spool/`, [`super::spool`]), then
//! delivered by a separate thread, oldest first, and deleted once the server answered
//! 2xx. Failures are of three kinds ([`status_kind`]), so one bad record cannot stop
//! delivery:
//! - never deliverable, dropped at once and counted (`rejected`): a spool record that
//!   does not parse or has vanished, and a 4xx the request itself caused (400 too-long
//!   labels, 413 too many samples, 422...);
//! - the server or the way to it (network and TLS errors, 3xx, 401, 403, 404, 407,
//!   408, 429, 501-505, 507, 511): nothing else would go through either, so everything
//!   waits, with exponential back-off (1 s doubling to 60 s); 3xx/401/403/404 are
//!   configuration a reload fixes;
//! - this record failed on the server (500 and the other 5xx, or the record cannot be
//!   read): it is set aside for its own back-off (1 s doubling to 60 s) and the records
//!   behind it go on. Two such failures in a row (two records) look like the server
//!   and back off everything as above. A record that fails on its own
//!   [`MAX_STRIKES`] times after other records were delivered since its previous
//!   failure is dropped and counted (`abandoned`); one that fails while nothing else
//!   goes through is kept, however long the outage.
//!
//! The spool is bounded in bytes: when a new profile does not fit, the oldest are
//! dropped and counted. It survives restarts. Sampling never waits for any of this.

use std::{
    io::Read,
    path::Path,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        mpsc, Arc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

mod credentials;

pub use self::credentials::Credentials;
use super::{
    config::PushConfig,
    spool::{Next, Retry, Spool},
};

/// Delivery counts, shared with the metrics endpoint.
#[derive(Debug, Default)]
pub struct PushStats {
    /// Profiles delivered.
    pub delivered: AtomicU64,
    /// Failed delivery attempts.
    pub errors: AtomicU64,
    /// Profiles dropped because the spool was full.
    pub dropped: AtomicU64,
    /// Profiles dropped because they can never be delivered (corrupt or vanished
    /// spool record, a 4xx the request caused).
    pub rejected: AtomicU64,
    /// Profiles dropped after failing on their own [`MAX_STRIKES`] times while
    /// others were delivered.
    pub abandoned: AtomicU64,
    /// Bytes in the spool.
    pub spool_bytes: AtomicU64,
    /// Profiles in the spool.
    pub spool_files: AtomicU64,
}

/// What one spooled profile is pushed with.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PushMeta {
    /// Labels, in order.
    pub labels: Vec<(String, String)>,
    /// Interval start, Unix seconds.
    pub from: u64,
    /// Interval end, Unix seconds.
    pub until: u64,
}

/// Pyroscope's `name` parameter: `application{k=v,...}`, values with the characters
/// the syntax reserves replaced by `_`.
pub fn pyroscope_name(application: &str, labels: &[(String, String)]) -> String {
    let clean = |s: &str| -> String {
        s.chars()
            .map(|c| {
                if ",{}=\"".contains(c) || c.is_whitespace() {
                    '_'
                } else {
                    c
                }
            })
            .collect()
    };
    let pairs: Vec<String> = labels
        .iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, v)| format!("{k}={}", clean(v)))
        .collect();
    format!("{application}{{{}}}", pairs.join(","))
}

enum Message {
    /// A profile was spooled.
    Wake,
    /// Deliver what can be delivered, starting no request after this instant, then
    /// stop.
    Flush(Instant),
    /// Stop now (the spool stays on disk).
    Stop,
}

/// The pushing side: a spool and its delivery thread.
pub struct Pusher {
    spool: Arc<Spool>,
    sender: mpsc::Sender<Message>,
    thread: Option<JoinHandle<()>>,
    /// Set to make the delivery thread stop after the request in flight.
    stop: Arc<AtomicBool>,
    stats: Arc<PushStats>,
}

/// A push whose fallible parts (credentials, their transport) are ready:
/// [`PreparedPush::start`] cannot fail on them, so a reload can check everything
/// before it changes anything.
pub struct PreparedPush {
    transport: Box<dyn Transport>,
    /// For messages.
    url: String,
    spool_max_bytes: u64,
    spool: Arc<Spool>,
    stats: Arc<PushStats>,
}

/// Sends one profile: Pyroscope over HTTP, or a stand-in in tests.
trait Transport: Send {
    fn send(&self, meta: &PushMeta, profile: &[u8]) -> std::result::Result<(), Failure>;
}

/// Pyroscope's ingest API over HTTP(S).
struct Http {
    agent: ureq::Agent,
    config: PushConfig,
    credentials: Credentials,
}

impl Pusher {
    /// Reads the credentials (every time: a reload picks up a changed token) and
    /// checks their transport. `spool` is the agent's one spool (its bound becomes
    /// `config.spool_max_bytes` when the push starts).
    pub fn prepare(
        config: PushConfig,
        spool: Arc<Spool>,
        stats: Arc<PushStats>,
    ) -> Result<PreparedPush> {
        let credentials = Credentials::load(config.credentials_file.as_deref())?;
        if credentials != Credentials::None
            && config.url.starts_with("http://")
            && !config.allow_insecure_http
        {
            bail!(
                "push credentials over plain http:// ({}) would travel in clear text: use \
                 https://, or set push.allow_insecure_http = true",
                config.url
            );
        }
        if config.ca_file.is_some() && config.url.starts_with("http://") {
            tracing::warn!(
                "push.ca_file is set but {} is plain http://: the CA is not used",
                config.url
            );
        }
        let agent = super::tls::http_agent(config.timeout, config.ca_file.as_deref())?;
        Ok(PreparedPush {
            url: config.url.clone(),
            spool_max_bytes: config.spool_max_bytes,
            transport: Box::new(Http {
                agent,
                config,
                credentials,
            }),
            spool,
            stats,
        })
    }

    /// [`Pusher::prepare`], then [`PreparedPush::start`].
    pub fn start(config: PushConfig, spool: Arc<Spool>, stats: Arc<PushStats>) -> Result<Pusher> {
        Self::prepare(config, spool, stats)?.start(None)
    }

    /// Stops delivering after the request in flight, without waiting for it: returns
    /// the thread, for the next pusher to wait on before it sends anything (so no
    /// profile is sent twice, and the caller never blocks on the network).
    pub fn retire(mut self) -> Option<JoinHandle<()>> {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.sender.send(Message::Stop);
        self.thread.take()
    }
    fn update_gauges(&self) {
        publish_sizes(&self.spool, &self.stats);
    }

    /// Spools one profile for delivery (never waits for the network).
    pub fn enqueue(&self, meta: &PushMeta, gzipped: &[u8]) {
        match self.spool.push(meta, gzipped) {
            Ok(dropped) => {
                if dropped > 0 {
                    tracing::warn!("push spool full: {dropped} oldest profile(s) dropped");
                    self.stats.dropped.fetch_add(dropped, Ordering::Relaxed);
                }
            }
            Err(error) => {
                tracing::warn!("cannot spool a profile for push: {error:#}");
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.update_gauges();
        let _ = self.sender.send(Message::Wake);
    }

    /// Delivers what it can now, starting no request after `until` (a request then
    /// lasts the push timeout at most) and waiting for no back-off (one more try of a
    /// server backed off from; a server-wide failure ends it), then stops; the rest
    /// stays spooled.
    pub fn flush(mut self, until: Instant) {
        let _ = self.sender.send(Message::Flush(until));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        self.update_gauges();
        // The records delivered during the flush.
        let _ = self.spool.sync_dir();
    }

    /// fsyncs the spool directory if records came or went since the last call.
    pub fn sync_spool(&self) -> std::io::Result<()> {
        self.spool.sync_dir()
    }
}

impl PreparedPush {
    /// Starts the delivery thread; it first waits for `previous` (a retired pusher's
    /// thread) to finish its request in flight.
    pub fn start(self, previous: Option<JoinHandle<()>>) -> Result<Pusher> {
        let PreparedPush {
            transport,
            url,
            spool_max_bytes,
            spool,
            stats,
        } = self;
        let dropped = spool.set_max_bytes(spool_max_bytes);
        if dropped > 0 {
            tracing::warn!("push spool over its new bound: {dropped} oldest profile(s) dropped");
            stats.dropped.fetch_add(dropped, Ordering::Relaxed);
        }
        let (sender, receiver) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let spool = spool.clone();
            let stats = stats.clone();
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("allocbpf-push".into())
                .spawn(move || {
                    if let Some(previous) = previous {
                        let _ = previous.join();
                    }
                    deliver(&*transport, &url, &spool, &stats, &receiver, &stop)
                })
                .context("starting the push thread")?
        };
        let pusher = Pusher {
            spool,
            sender,
            thread: Some(thread),
            stop,
            stats,
        };
        pusher.update_gauges();
        let _ = pusher.sender.send(Message::Wake);
        Ok(pusher)
    }
}

impl Drop for Pusher {
    /// Waits for the request in flight at most (the thread checks `stop` before each).
    fn drop(&mut self) {
        if let Some(thread) = self.thread.take() {
            self.stop.store(true, Ordering::Relaxed);
            let _ = self.sender.send(Message::Stop);
            let _ = thread.join();
        }
    }
}

/// Publishes the spool's size to the metrics.
fn publish_sizes(spool: &Spool, stats: &PushStats) {
    let (files, bytes) = spool.sizes();
    stats.spool_files.store(files, Ordering::Relaxed);
    stats.spool_bytes.store(bytes, Ordering::Relaxed);
}

const BACKOFF_INITIAL: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(60);

/// A record that failed on its own this many times, each after other records had been
/// delivered since its previous failure, is dropped (`abandoned`): at least six
/// failures over about half a minute (its back-off) while the server took the rest.
pub const MAX_STRIKES: u32 = 5;

/// The back-off after `failures` failures in a row: 1 s doubling to 60 s.
fn backoff_after(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(6);
    (BACKOFF_INITIAL * (1 << doublings)).min(BACKOFF_MAX)
}

/// The retry state of a record that failed on its own (`retry`: its state before, if
/// it failed before), `delivered` profiles having been delivered in all: a strike if
/// some were delivered since its previous failure, and its next try after its back-off.
fn after_failure(retry: Option<Retry>, delivered: u64, now: Instant) -> Retry {
    let mut retry = retry.unwrap_or(Retry {
        failures: 0,
        strikes: 0,
        delivered_at_failure: delivered,
        not_before: now,
    });
    if retry.failures > 0 && delivered > retry.delivered_at_failure {
        retry.strikes += 1;
    }
    retry.failures += 1;
    retry.delivered_at_failure = delivered;
    retry.not_before = now + backoff_after(retry.failures);
    retry
}

fn deliver(
    transport: &dyn Transport,
    url: &str,
    spool: &Spool,
    stats: &PushStats,
    receiver: &mpsc::Receiver<Message>,
    stop: &AtomicBool,
) {
    // Server-wide back-off: nothing is sent before `paused_until`.
    let mut server_failures = 0u32;
    let mut paused_until = Instant::now();
    // Records that failed on their own since the last delivery.
    let mut failed_in_a_row = 0u32;
    let mut flush_until: Option<Instant> = None;
    loop {
        let now = Instant::now();
        if stop.load(Ordering::Relaxed) || flush_until.is_some_and(|until| now >= until) {
            return;
        }
        // When the next record may be sent (`None`: nothing spooled).
        let due = match spool.next(now) {
            Next::Empty => None,
            Next::Later(at) => Some(at.max(paused_until)),
            Next::Ready(_, _) if now < paused_until => Some(paused_until),
            Next::Ready(path, retry) => {
                let outcome = send_record(transport, &path);
                let now = Instant::now();
                match outcome {
                    Ok(()) => {
                        spool.remove(&path);
                        stats.delivered.fetch_add(1, Ordering::Relaxed);
                        server_failures = 0;
                        failed_in_a_row = 0;
                    }
                    Err(Failure::Permanent(error)) => {
                        // Never deliverable: dropped, so the ones behind it go on.
                        if spool.remove(&path) {
                            stats.rejected.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(
                                "push to {url} rejected {}: {error:#}; dropped",
                                path.display()
                            );
                        }
                    }
                    Err(Failure::Server(error)) => {
                        stats.errors.fetch_add(1, Ordering::Relaxed);
                        server_failures += 1;
                        let wait = backoff_after(server_failures);
                        paused_until = now + wait;
                        tracing::warn!(
                            "push to {url} failed: {error:#}; retrying in {}s ({} profile(s) spooled)",
                            wait.as_secs(),
                            spool.sizes().0
                        );
                    }
                    Err(Failure::Record(error)) => {
                        stats.errors.fetch_add(1, Ordering::Relaxed);
                        failed_in_a_row += 1;
                        let delivered = stats.delivered.load(Ordering::Relaxed);
                        let retry = after_failure(retry, delivered, now);
                        if retry.strikes >= MAX_STRIKES {
                            if spool.remove(&path) {
                                stats.abandoned.fetch_add(1, Ordering::Relaxed);
                                tracing::warn!(
                                    "push to {url}: {} failed {} times while other profiles were delivered (last: {error:#}); dropped",
                                    path.display(),
                                    retry.failures
                                );
                            }
                        } else {
                            spool.set_retry(&path, retry);
                            tracing::warn!(
                                "push to {url} failed for {}: {error:#}; retrying it in {}s, the others go first",
                                path.display(),
                                backoff_after(retry.failures).as_secs()
                            );
                        }
                        if failed_in_a_row >= 2 {
                            // Two records in a row: more likely the server than them.
                            server_failures += 1;
                            paused_until = now + backoff_after(server_failures);
                        }
                    }
                }
                publish_sizes(spool, stats);
                continue;
            }
        };
        // A flush (stopping) sends what may be sent now, and waits for no back-off:
        // after a server-wide failure, or with only set-aside records left, it ends.
        if flush_until.is_some() && due.is_none_or(|due| due > now) {
            return;
        }
        let wait = due.map_or(Duration::from_secs(3600), |due| {
            due.saturating_duration_since(now)
        });
        match receiver.recv_timeout(wait) {
            // New profiles wait for the back-off like the others.
            Ok(Message::Wake) | Err(mpsc::RecvTimeoutError::Timeout) => {}
            Ok(Message::Flush(until)) => {
                flush_until = Some(until);
                // One more try of a server backed off from, before the agent stops.
                paused_until = Instant::now();
            }
            Ok(Message::Stop) | Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// Why one delivery failed.
#[derive(Debug)]
enum Failure {
    /// It can never succeed: drop the record.
    Permanent(anyhow::Error),
    /// The server, or the way to it: nothing else would go through, everything waits.
    Server(anyhow::Error),
    /// This record failed: it waits, the others go on.
    Record(anyhow::Error),
}

/// What an HTTP status says about a failed request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StatusKind {
    /// The request itself is refused (400, 413, 415, 422...): sending it again cannot
    /// change that.
    Permanent,
    /// The server or the way to it: 3xx, 401, 403, 404 (configuration a reload
    /// fixes), 407, 408, 429 (asks to slow down), 501-505, 507, 511.
    Server,
    /// This request failed on the server (500 and the other 5xx): others may not.
    Record,
}

fn status_kind(code: u16) -> StatusKind {
    match code {
        401 | 403 | 404 | 407 | 408 | 429 | 501..=505 | 507 | 511 => StatusKind::Server,
        400..=499 => StatusKind::Permanent,
        500..=599 => StatusKind::Record,
        _ => StatusKind::Server,
    }
}

/// Reads the spool record at `path` and sends it.
fn send_record(transport: &dyn Transport, path: &Path) -> std::result::Result<(), Failure> {
    let mut record = Vec::new();
    let read = std::fs::File::open(path).and_then(|mut f| f.read_to_end(&mut record));
    match read {
        Ok(_) => {}
        // Deleted under us (the spool directory removed): nothing left to send.
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            return Err(Failure::Permanent(error.into()))
        }
        Err(error) => {
            return Err(Failure::Record(
                anyhow::Error::new(error).context(format!("reading {}", path.display())),
            ))
        }
    }
    let parsed = record
        .iter()
        .position(|&b| b == b'\n')
        .context("spool record without metadata")
        .and_then(|split| {
            let meta: PushMeta =
                serde_json::from_slice(&record[..split]).context("spool record metadata")?;
            Ok((split, meta))
        });
    let (split, meta) = parsed.map_err(Failure::Permanent)?;
    transport.send(&meta, &record[split + 1..])
}

impl Transport for Http {
    fn send(&self, meta: &PushMeta, profile: &[u8]) -> std::result::Result<(), Failure> {
        let config = &self.config;
        let boundary = format!("allocbpf{:016x}", rand::random::<u64>());
        let mut body = format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"profile\"; filename=\"profile.pprof\"\r\nContent-Type: application/octet-stream\r\n\r\n"
        )
        .into_bytes();
        body.extend_from_slice(profile);
        body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
        let mut request = self
            .agent
            .post(&format!("{}/ingest", config.url))
            .query("name", &pyroscope_name(&config.application, &meta.labels))
            .query("from", &meta.from.to_string())
            .query("until", &meta.until.to_string())
            .query("format", "pprof")
            .query("spyName", "allocbpf")
            .set(
                "Content-Type",
                &format!("multipart/form-data; boundary={boundary}"),
            );
        if let Some(header) = self.credentials.header() {
            request = request.set("Authorization", &header);
        }
        if let Some(tenant) = &config.tenant {
            request = request.set("X-Scope-OrgID", tenant);
        }
        match request.send_bytes(&body) {
            // Redirects are not followed (they would carry the credentials elsewhere).
            Ok(response) if (300..400).contains(&response.status()) => {
                Err(Failure::Server(anyhow::anyhow!(
                    "HTTP {}: redirected to {:?}, not followed (set push.url to the final address)",
                    response.status(),
                    response.header("Location").unwrap_or("")
                )))
            }
            Ok(_) => Ok(()),
            Err(ureq::Error::Status(code, response)) => {
                let text = response.into_string().unwrap_or_default();
                let error = anyhow::anyhow!(
                    "HTTP {code}: {}",
                    text.chars().take(200).collect::<String>()
                );
                Err(match status_kind(code) {
                    StatusKind::Permanent => Failure::Permanent(error),
                    StatusKind::Server => Failure::Server(error),
                    StatusKind::Record => Failure::Record(error),
                })
            }
            Err(error) => Err(Failure::Server(error.into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_classified() {
        for code in [400, 409, 413, 415, 422] {
            assert_eq!(status_kind(code), StatusKind::Permanent, "{code}");
        }
        for code in [301, 401, 403, 404, 407, 408, 429, 502, 503, 504, 507] {
            assert_eq!(status_kind(code), StatusKind::Server, "{code}");
        }
        for code in [500, 506, 599] {
            assert_eq!(status_kind(code), StatusKind::Record, "{code}");
        }
        assert_eq!(backoff_after(1), Duration::from_secs(1));
        assert_eq!(backoff_after(3), Duration::from_secs(4));
        assert_eq!(backoff_after(30), BACKOFF_MAX);
    }

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
        assert!(
            matches!(spool.next(now + Duration::from_secs(31)), Next::Ready(p, None) if p != bad)
        );
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
    fn names() {
        let labels = vec![
            ("hostname".to_string(), "h".to_string()),
            ("comm".to_string(), "a,b{c}".to_string()),
            ("container_id".to_string(), String::new()),
        ];
        assert_eq!(
            pyroscope_name("allocbpf", &labels),
            "allocbpf{hostname=h,comm=a_b_c_}"
        );
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
}
