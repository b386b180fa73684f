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
//! Every profile is first written to the spool (`STORE/spool/`), then delivered by a
//! separate thread, oldest first, and deleted once the server answered 2xx. Failures
//! are retried with exponential back-off (1 s doubling to 60 s). The spool is bounded
//! in bytes: when a new profile does not fit, the oldest are dropped and counted. It
//! survives restarts. Sampling never waits for any of this.

use std::{
    collections::VecDeque,
    io::Read,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU64, Ordering},
        mpsc, Arc, Mutex,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use super::config::PushConfig;

/// Delivery counts, shared with the metrics endpoint.
#[derive(Debug, Default)]
pub struct PushStats {
    /// Profiles delivered.
    pub delivered: AtomicU64,
    /// Failed delivery attempts.
    pub errors: AtomicU64,
    /// Profiles dropped because the spool was full.
    pub dropped: AtomicU64,
    /// Bytes in the spool.
    pub spool_bytes: AtomicU64,
    /// Profiles in the spool.
    pub spool_files: AtomicU64,
}

/// How a push authenticates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Credentials {
    /// No Authorization header.
    None,
    /// `Authorization: Bearer TOKEN`.
    Bearer(String),
    /// `Authorization: Basic ...`.
    Basic(String, String),
}

impl Credentials {
    /// From `file` (`Bearer TOKEN`, `USER:PASSWORD`, or a bare token), else from
    /// `ALLOCBPF_PUSH_TOKEN` or `ALLOCBPF_PUSH_USER` + `ALLOCBPF_PUSH_PASSWORD`.
    /// A credentials file others can read is refused: it would give any local user
    /// the profile store.
    pub fn load(file: Option<&Path>) -> Result<Credentials> {
        if let Some(path) = file {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(path)
                .with_context(|| format!("reading the credentials file {}", path.display()))?
                .permissions()
                .mode();
            if mode & 0o077 != 0 {
                bail!(
                    "the credentials file {} can be read by others (mode {:o}): chmod 600 it",
                    path.display(),
                    mode & 0o777
                );
            }
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the credentials file {}", path.display()))?;
            return Ok(Self::parse(text.trim()));
        }
        if let Ok(token) = std::env::var("ALLOCBPF_PUSH_TOKEN") {
            return Ok(Credentials::Bearer(token));
        }
        match (
            std::env::var("ALLOCBPF_PUSH_USER"),
            std::env::var("ALLOCBPF_PUSH_PASSWORD"),
        ) {
            (Ok(user), Ok(password)) => Ok(Credentials::Basic(user, password)),
            (Ok(_), Err(_)) => bail!("ALLOCBPF_PUSH_USER is set but ALLOCBPF_PUSH_PASSWORD is not"),
            _ => Ok(Credentials::None),
        }
    }

    fn parse(text: &str) -> Credentials {
        if let Some(token) = text.strip_prefix("Bearer ") {
            return Credentials::Bearer(token.trim().to_string());
        }
        match text.split_once(':') {
            Some((user, password)) => Credentials::Basic(user.into(), password.into()),
            None if text.is_empty() => Credentials::None,
            None => Credentials::Bearer(text.into()),
        }
    }

    fn header(&self) -> Option<String> {
        match self {
            Credentials::None => None,
            Credentials::Bearer(token) => Some(format!("Bearer {token}")),
            Credentials::Basic(user, password) => Some(format!(
                "Basic {}",
                base64(format!("{user}:{password}").as_bytes())
            )),
        }
    }
}

fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
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

/// The bounded on-disk queue of undelivered profiles.
#[derive(Debug)]
struct Spool {
    dir: PathBuf,
    max_bytes: u64,
    files: Mutex<(VecDeque<(PathBuf, u64)>, u64)>,
    next: AtomicU64,
}

impl Spool {
    fn open(dir: &Path, max_bytes: u64) -> Result<Spool> {
        super::store::create_private_dir(dir)
            .with_context(|| format!("creating the spool directory {}", dir.display()))?;
        let mut files: Vec<(PathBuf, u64)> = std::fs::read_dir(dir)?
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "spool"))
            .map(|e| (e.path(), e.metadata().map(|m| m.len()).unwrap_or(0)))
            .collect();
        files.sort();
        let next = files
            .last()
            .and_then(|(p, _)| p.file_stem()?.to_str()?.parse::<u64>().ok())
            .map_or(0, |n| n + 1);
        let bytes = files.iter().map(|f| f.1).sum();
        Ok(Spool {
            dir: dir.to_path_buf(),
            max_bytes,
            files: Mutex::new((files.into(), bytes)),
            next: AtomicU64::new(next),
        })
    }

    /// Adds a profile; drops the oldest while it does not fit. Returns how many were
    /// dropped.
    fn push(&self, meta: &PushMeta, gzipped: &[u8]) -> Result<u64> {
        let mut record = serde_json::to_vec(meta)?;
        record.push(b'\n');
        record.extend_from_slice(gzipped);
        let seq = self.next.fetch_add(1, Ordering::Relaxed);
        let path = self.dir.join(format!("{seq:016}.spool"));
        let temp = self.dir.join(format!("{seq:016}.tmp"));
        super::store::write_private(&temp, &path, &record)
            .with_context(|| format!("writing {}", path.display()))?;
        let mut guard = self.files.lock().expect("spool lock");
        let (files, bytes) = &mut *guard;
        files.push_back((path, record.len() as u64));
        *bytes += record.len() as u64;
        let mut dropped = 0;
        while *bytes > self.max_bytes && files.len() > 1 {
            let (oldest, size) = files.pop_front().expect("non-empty");
            let _ = std::fs::remove_file(oldest);
            *bytes -= size;
            dropped += 1;
        }
        Ok(dropped)
    }

    fn front(&self) -> Option<PathBuf> {
        self.files
            .lock()
            .expect("spool lock")
            .0
            .front()
            .map(|f| f.0.clone())
    }

    /// Deletes `path` if it is still the oldest (it may have been dropped meanwhile).
    fn delivered(&self, path: &Path) {
        let mut guard = self.files.lock().expect("spool lock");
        let (files, bytes) = &mut *guard;
        if files.front().is_some_and(|f| f.0 == path) {
            let (_, size) = files.pop_front().expect("non-empty");
            *bytes -= size;
            let _ = std::fs::remove_file(path);
        }
    }

    fn sizes(&self) -> (u64, u64) {
        let guard = self.files.lock().expect("spool lock");
        (guard.0.len() as u64, guard.1)
    }
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
    stats: Arc<PushStats>,
}

impl Pusher {
    /// Opens the spool under `store` and starts delivering.
    pub fn start(config: PushConfig, store: &Path, stats: Arc<PushStats>) -> Result<Pusher> {
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
        let spool = Arc::new(Spool::open(&store.join("spool"), config.spool_max_bytes)?);
        let (sender, receiver) = mpsc::channel();
        let thread = {
            let spool = spool.clone();
            let stats = stats.clone();
            std::thread::Builder::new()
                .name("allocbpf-push".into())
                .spawn(move || deliver(config, credentials, spool, stats, receiver))
                .context("starting the push thread")?
        };
        let pusher = Pusher {
            spool,
            sender,
            thread: Some(thread),
            stats,
        };
        pusher.update_gauges();
        let _ = pusher.sender.send(Message::Wake);
        Ok(pusher)
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

    /// Delivers what it can within `timeout`, then stops; the rest stays spooled.
    pub fn flush(mut self, timeout: Duration) {
        let _ = self.sender.send(Message::Flush(Instant::now() + timeout));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        self.update_gauges();
    }
}

impl Drop for Pusher {
    fn drop(&mut self) {
        if let Some(thread) = self.thread.take() {
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
    credentials: Credentials,
    spool: Arc<Spool>,
    stats: Arc<PushStats>,
    receiver: mpsc::Receiver<Message>,
) {
    // No redirects: following one would send the credentials to another server.
    let agent = ureq::AgentBuilder::new()
        .timeout(config.timeout)
        .redirects(0)
        .build();
    let mut backoff = BACKOFF_INITIAL;
    let mut next_attempt = Instant::now();
    let mut flush_until: Option<Instant> = None;
    loop {
        if Instant::now() >= next_attempt {
            while let Some(path) = spool.front() {
                if flush_until.is_some_and(|t| Instant::now() >= t) {
                    return;
                }
                match send_one(&agent, &config, &credentials, &path) {
                    Ok(()) => {
                        spool.delivered(&path);
                        stats.delivered.fetch_add(1, Ordering::Relaxed);
                        backoff = BACKOFF_INITIAL;
                        publish_sizes(&spool, &stats);
                    }
                    Err(error) => {
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

fn send_one(
    agent: &ureq::Agent,
    config: &PushConfig,
    credentials: &Credentials,
    path: &Path,
) -> Result<()> {
    let mut record = Vec::new();
    std::fs::File::open(path)?.read_to_end(&mut record)?;
    let split = record
        .iter()
        .position(|&b| b == b'\n')
        .context("spool record without metadata")?;
    let meta: PushMeta = serde_json::from_slice(&record[..split])?;
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
        Ok(response) if (300..400).contains(&response.status()) => bail!(
            "HTTP {}: redirected to {:?}, not followed (set push.url to the final address)",
            response.status(),
            response.header("Location").unwrap_or("")
        ),
        Ok(_) => Ok(()),
        Err(ureq::Error::Status(code, response)) => {
            let text = response.into_string().unwrap_or_default();
            bail!(
                "HTTP {code}: {}",
                text.chars().take(200).collect::<String>()
            )
        }
        Err(error) => Err(error.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_credentials_file_others_can_read_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let path =
            std::env::temp_dir().join(format!("allocbpf-credentials-{}", std::process::id()));
        std::fs::write(&path, "Bearer t0ken\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let error = format!("{:#}", Credentials::load(Some(&path)).unwrap_err());
        assert!(error.contains("chmod 600"), "{error}");
        assert!(!error.contains("t0ken"), "{error}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(
            Credentials::load(Some(&path)).unwrap(),
            Credentials::Bearer("t0ken".into())
        );
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn credentials_and_names() {
        assert_eq!(
            Credentials::parse("Bearer abc"),
            Credentials::Bearer("abc".into())
        );
        assert_eq!(
            Credentials::parse("user:pa:ss"),
            Credentials::Basic("user".into(), "pa:ss".into())
        );
        assert_eq!(
            Credentials::Basic("Aladdin".into(), "open sesame".into()).header(),
            Some("Basic QWxhZGRpbjpvcGVuIHNlc2FtZQ==".into())
        );
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
