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
//! 2xx. What can never succeed is dropped and counted (`rejected`), so one bad record
//! cannot stop delivery: a spool record that does not parse or has vanished, and a
//! 4xx the request itself caused (400 too-long labels, 413 too many samples, 422...).
//! What may succeed later is retried with exponential back-off (1 s doubling to 60 s):
//! network errors, 5xx, 408 and 429, and 3xx, 401, 403, 404 (a configuration problem
//! a reload fixes). The spool is bounded in bytes: when a new profile does not fit, the
//! oldest are dropped and counted. It survives restarts. Sampling never waits for any
//! of this.

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
use super::{config::PushConfig, spool::Spool};

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
    /// Deliver what can be delivered before this instant, then stop.
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

/// A push whose fallible parts (credentials, their transport, the spool) are ready:
/// [`PreparedPush::start`] cannot fail on them, so a reload can check everything
/// before it changes anything.
pub struct PreparedPush {
    config: PushConfig,
    agent: ureq::Agent,
    credentials: Credentials,
    spool: Arc<Spool>,
    stats: Arc<PushStats>,
}

impl Pusher {
    /// Reads the credentials (every time: a reload picks up a changed token), checks
    /// their transport, and opens the spool under `store`.
    pub fn prepare(
        config: PushConfig,
        store: &Path,
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
        let spool = Arc::new(Spool::open(&store.join("spool"), config.spool_max_bytes)?);
        Ok(PreparedPush {
            config,
            agent,
            credentials,
            spool,
            stats,
        })
    }

    /// [`Pusher::prepare`], then [`PreparedPush::start`].
    pub fn start(config: PushConfig, store: &Path, stats: Arc<PushStats>) -> Result<Pusher> {
        Self::prepare(config, store, stats)?.start(None)
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

    /// Delivers what it can within `timeout`, then stops; the rest stays spooled. The
    /// request in flight at `timeout` is cut short by its own timeout at most.
    pub fn flush(mut self, timeout: Duration) {
        let _ = self.sender.send(Message::Flush(Instant::now() + timeout));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        self.update_gauges();
    }
}

impl PreparedPush {
    /// Starts the delivery thread; it first waits for `previous` (a retired pusher's
    /// thread) to finish its request in flight.
    pub fn start(self, previous: Option<JoinHandle<()>>) -> Result<Pusher> {
        let PreparedPush {
            config,
            agent,
            credentials,
            spool,
            stats,
        } = self;
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
                    deliver(config, agent, credentials, spool, stats, receiver, stop)
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

fn deliver(
    config: PushConfig,
    agent: ureq::Agent,
    credentials: Credentials,
    spool: Arc<Spool>,
    stats: Arc<PushStats>,
    receiver: mpsc::Receiver<Message>,
    stop: Arc<AtomicBool>,
) {
    let mut backoff = BACKOFF_INITIAL;
    let mut next_attempt = Instant::now();
    let mut flush_until: Option<Instant> = None;
    loop {
        if Instant::now() >= next_attempt {
            while let Some(path) = spool.front() {
                if flush_until.is_some_and(|t| Instant::now() >= t) || stop.load(Ordering::Relaxed)
                {
                    return;
                }
                match send_one(&agent, &config, &credentials, &path) {
                    Ok(()) => {
                        spool.delivered(&path);
                        stats.delivered.fetch_add(1, Ordering::Relaxed);
                        backoff = BACKOFF_INITIAL;
                        publish_sizes(&spool, &stats);
                    }
                    Err(Failure::Permanent(error)) => {
                        // Never deliverable: dropped, so the ones behind it go on.
                        spool.delivered(&path);
                        stats.rejected.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(
                            "push to {} rejected {}: {error:#}; dropped",
                            config.url,
                            path.display()
                        );
                        publish_sizes(&spool, &stats);
                    }
                    Err(Failure::Retry(error)) => {
                        stats.errors.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(
                            "push to {} failed: {error:#}; retrying in {}s ({} profile(s) spooled)",
                            config.url,
                            backoff.as_secs(),
                            spool.sizes().0
                        );
                        next_attempt = Instant::now() + backoff;
                        backoff = (backoff * 2).min(BACKOFF_MAX);
                        break;
                    }
                }
            }
        }
        let now = Instant::now();
        if let Some(until) = flush_until {
            if spool.front().is_none() || now >= until {
                return;
            }
        }
        let mut wait = match spool.front() {
            None => Duration::from_secs(3600),
            Some(_) => next_attempt.saturating_duration_since(now),
        };
        if let Some(until) = flush_until {
            wait = wait.min(until.saturating_duration_since(now));
        }
        match receiver.recv_timeout(wait) {
            // New profiles wait for the back-off like the others.
            Ok(Message::Wake) | Err(mpsc::RecvTimeoutError::Timeout) => {}
            Ok(Message::Flush(until)) => {
                flush_until = Some(until);
                next_attempt = Instant::now();
            }
            Ok(Message::Stop) | Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// Why one delivery failed.
enum Failure {
    /// It can never succeed: drop the record.
    Permanent(anyhow::Error),
    /// It may succeed later: retry after a back-off.
    Retry(anyhow::Error),
}

/// A status the request itself caused, which sending it again cannot change. 401,
/// 403, 404 and 3xx are configuration (credentials, URL) that a reload may fix; 408
/// and 429 ask to retry.
fn permanent_status(code: u16) -> bool {
    (400..500).contains(&code) && !matches!(code, 401 | 403 | 404 | 408 | 429)
}

fn send_one(
    agent: &ureq::Agent,
    config: &PushConfig,
    credentials: &Credentials,
    path: &Path,
) -> std::result::Result<(), Failure> {
    let mut record = Vec::new();
    let read = std::fs::File::open(path).and_then(|mut f| f.read_to_end(&mut record));
    match read {
        Ok(_) => {}
        // Deleted under us (the spool directory removed): nothing left to send.
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            return Err(Failure::Permanent(error.into()))
        }
        Err(error) => return Err(Failure::Retry(error.into())),
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
    let profile = &record[split + 1..];
    let boundary = format!("allocbpf{:016x}", rand::random::<u64>());
    let mut body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"profile\"; filename=\"profile.pprof\"\r\nContent-Type: application/octet-stream\r\n\r\n"
    )
    .into_bytes();
    body.extend_from_slice(profile);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    let mut request = agent
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
    if let Some(header) = credentials.header() {
        request = request.set("Authorization", &header);
    }
    if let Some(tenant) = &config.tenant {
        request = request.set("X-Scope-OrgID", tenant);
    }
    match request.send_bytes(&body) {
        // Redirects are not followed (they would carry the credentials elsewhere).
        Ok(response) if (300..400).contains(&response.status()) => {
            Err(Failure::Retry(anyhow::anyhow!(
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
            Err(if permanent_status(code) {
                Failure::Permanent(error)
            } else {
                Failure::Retry(error)
            })
        }
        Err(error) => Err(Failure::Retry(error.into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_the_request_caused_are_permanent() {
        for code in [400, 413, 415, 422] {
            assert!(permanent_status(code), "{code}");
        }
        for code in [200, 301, 401, 403, 404, 408, 429, 500, 503] {
            assert!(!permanent_status(code), "{code}");
        }
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
        spool.delivered(&first);
        assert_eq!(spool.sizes().0, 1);
        // Reopened, the rest is still there, and new records sort after it.
        let reopened = Spool::open(&dir, 1000).unwrap();
        assert_eq!(reopened.sizes().0, 1);
        reopened.push(&meta, b"x").unwrap();
        assert!(reopened.front().unwrap() < dir.join("9999999999999999.spool"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
