//! Pushing profiles to profile stores, each through its own bounded on-disk spool.
//!
//! The stores ([`Destination`]), each in its own module:
//! - Grafana Pyroscope ([`pyroscope`]): its Connect API `push.v1.PusherService/Push`
//!   by default, or its legacy `/ingest`, with the labels it needs ([`labels`]);
//! - an OpenTelemetry endpoint (a Collector, or Pyroscope's own) over OTLP/HTTP
//!   profiles ([`otlp`]).
//!
//! Every profile is first written to each store's spool (`STORE/spool/`,
//! `STORE/spool-otlp/`, [`spool`]), then delivered by that store's thread
//! ([`deliver`]), oldest first, and deleted once the server answered 2xx: a store that
//! fails never makes another receive a profile twice. Failures are of three kinds
//! ([`http::status_kind`]), so one bad record cannot stop delivery:
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
//!   [`deliver::MAX_STRIKES`] times after other records were delivered since its previous
//!   failure is dropped and counted (`abandoned`); one that fails while nothing else
//!   goes through is kept, however long the outage.
//!
//! A spool is bounded in bytes: when a new profile does not fit, the oldest are
//! dropped and counted. It survives restarts. Sampling never waits for any of this.

use std::{
    collections::HashMap,
    path::Path,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        mpsc, Arc, Mutex,
    },
    thread::JoinHandle,
    time::Instant,
};

use anyhow::{bail, Context, Result};

mod credentials;
mod deliver;
mod http;
pub mod labels;
mod otlp;
mod pyroscope;
pub(crate) mod spool;
#[cfg(test)]
mod tests;

pub use self::credentials::Credentials;
use self::{deliver::deliver, http::Failure, labels::SeriesLimit, spool::Spool};
use super::config::{Destination, PushConfig, PushTarget};

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
    /// Profiles dropped after failing on their own [`deliver::MAX_STRIKES`] times while
    /// others were delivered.
    pub abandoned: AtomicU64,
    /// Bytes in the spool.
    pub spool_bytes: AtomicU64,
    /// Profiles in the spool.
    pub spool_files: AtomicU64,
    /// Labels left out of a push because Pyroscope would refuse them (a name it does
    /// not accept, a value too long, more labels than a series may have).
    pub labels_dropped: AtomicU64,
    /// Profiles not pushed because their series would exceed `push.max_series`.
    pub series_dropped: AtomicU64,
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

enum Message {
    /// A profile was spooled.
    Wake,
    /// Deliver what can be delivered, starting no request after this instant, then
    /// stop.
    Flush(Instant),
    /// Stop now (the spool stays on disk).
    Stop,
}

/// The pushing side of one store: its spool and its delivery thread.
pub struct Pusher {
    destination: Destination,
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
    destination: Destination,
    transport: Box<dyn Transport>,
    /// For messages.
    url: String,
    spool_max_bytes: u64,
    spool: Arc<Spool>,
    stats: Arc<PushStats>,
}

/// Largest decompressed pprof a transport reads from the spool: a record is the
/// agent's own, but a bound keeps a corrupt one from taking the agent's memory (stores
/// refuse profiles far smaller).
const MAX_PPROF_BYTES: u64 = 256 << 20;

/// The pprof of a spool record (gzipped), decoded within [`MAX_PPROF_BYTES`].
fn decode_spooled(gzipped: &[u8]) -> anyhow::Result<allocbpf_export::pprof::proto::Profile> {
    Ok(allocbpf_export::pprof::decode_gzipped(
        gzipped,
        MAX_PPROF_BYTES,
    )?)
}

/// Sends one profile to a store (or a stand-in, in tests).
trait Transport: Send {
    /// Delivers `profile` (a gzipped pprof, as spooled) with its metadata.
    fn send(&self, meta: &PushMeta, profile: &[u8]) -> std::result::Result<(), Failure>;
}

impl Pusher {
    /// Reads the credentials (every time: a reload picks up a changed token) and
    /// checks their transport to `target`. `spool` is that store's one spool (its
    /// bound becomes `config.spool_max_bytes` when the push starts).
    /// `series` is the store's series bound (Pyroscope's), kept across reloads.
    pub fn prepare(
        config: &PushConfig,
        target: &PushTarget,
        spool: Arc<Spool>,
        stats: Arc<PushStats>,
        series: Arc<Mutex<SeriesLimit>>,
    ) -> Result<PreparedPush> {
        let url = &target.url;
        let credentials = Credentials::load(config.credentials_file.as_deref())?;
        if credentials != Credentials::None
            && url.starts_with("http://")
            && !config.allow_insecure_http
        {
            bail!(
                "push credentials over plain http:// ({url}) would travel in clear text: use \
                 https://, or set push.allow_insecure_http = true"
            );
        }
        if config.ca_file.is_some() && url.starts_with("http://") {
            tracing::warn!("push.ca_file is set but {url} is plain http://: the CA is not used");
        }
        let host = |url: &str| url.split('/').nth(2).unwrap_or("").to_string();
        if credentials != Credentials::None
            && config
                .targets
                .iter()
                .any(|other| host(&other.url) != host(url))
        {
            tracing::warn!(
                "push credentials go to every store, {url} among them: the stores are on \
                 different hosts"
            );
        }
        let agent = super::tls::http_agent(config.timeout, config.ca_file.as_deref())?;
        let transport: Box<dyn Transport> = match target.destination {
            Destination::PyroscopePush | Destination::PyroscopeIngest => {
                Box::new(pyroscope::Pyroscope::new(
                    agent,
                    config,
                    target,
                    credentials,
                    stats.clone(),
                    series,
                ))
            }
            Destination::Otlp => Box::new(otlp::Otlp::new(
                agent,
                config,
                target,
                credentials,
                stats.clone(),
            )),
        };
        Ok(PreparedPush {
            destination: target.destination,
            url: url.clone(),
            spool_max_bytes: config.spool_max_bytes,
            transport,
            spool,
            stats,
        })
    }

    /// Stops delivering after the request in flight, without waiting for it: returns
    /// the thread, for the next pusher to wait on before it sends anything (so no
    /// profile is sent twice, and the caller never blocks on the network).
    pub fn retire(mut self) -> Option<JoinHandle<()>> {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.sender.send(Message::Stop);
        self.thread.take()
    }
    /// The store this pusher delivers to.
    pub fn destination(&self) -> Destination {
        self.destination
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
    /// The store this push delivers to.
    pub fn destination(&self) -> Destination {
        self.destination
    }

    /// Starts the delivery thread; it first waits for `previous` (a retired pusher's
    /// thread) to finish its request in flight.
    pub fn start(self, previous: Option<JoinHandle<()>>) -> Result<Pusher> {
        let PreparedPush {
            destination,
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
            destination,
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

/// Each store's spool and counts, kept for the agent's life: every push a reload
/// prepares for a store shares them (two spools on one directory would number records
/// apart and clean each other's `.tmp` files).
#[derive(Default)]
pub struct Lanes {
    spools: HashMap<&'static str, Arc<Spool>>,
    stats: HashMap<&'static str, Arc<PushStats>>,
    series: HashMap<&'static str, Arc<Mutex<SeriesLimit>>>,
}

impl Lanes {
    /// A prepared push per target of `config`, each on its store's spool under `store`
    /// (opened the first time, bounded by `config.spool_max_bytes`).
    pub fn prepare(&mut self, config: &PushConfig, store: &Path) -> Result<Vec<PreparedPush>> {
        config
            .targets
            .iter()
            .map(|target| {
                let dir = target.destination.spool_dir();
                let spool = match self.spools.get(dir) {
                    Some(spool) => spool.clone(),
                    None => {
                        let opened =
                            Arc::new(Spool::open(&store.join(dir), config.spool_max_bytes)?);
                        self.spools.insert(dir, opened.clone());
                        opened
                    }
                };
                let stats = self.stats.entry(dir).or_default().clone();
                let series = self
                    .series
                    .entry(dir)
                    .or_insert_with(|| {
                        Arc::new(Mutex::new(SeriesLimit::new(
                            config.max_series,
                            pyroscope::SERIES_WINDOW,
                        )))
                    })
                    .clone();
                if let Ok(mut limit) = series.lock() {
                    limit.set_max(config.max_series);
                }
                Pusher::prepare(config, target, spool, stats, series)
            })
            .collect()
    }

    /// Every store's counts so far, by store name.
    pub fn stats(&self) -> Vec<(&'static str, Arc<PushStats>)> {
        let mut all: Vec<_> = self
            .stats
            .iter()
            .map(|(dir, stats)| {
                let name = if *dir == Destination::Otlp.spool_dir() {
                    Destination::Otlp.name()
                } else {
                    Destination::PyroscopePush.name()
                };
                (name, stats.clone())
            })
            .collect();
        all.sort_by_key(|(name, _)| *name);
        all
    }
}
