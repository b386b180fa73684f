//! `allocbpf agent`: the fleet node agent.
//!
//! It profiles every process of the host (the engine's host scope, [`allocbpf_collect::engine`]) continuously, and every
//! interval cuts one profile per process that allocated (alloc and, with live tracking,
//! inuse sample types), labelled with hostname, pid, comm, exe, build id and cgroup /
//! container id. Profiles go to the local `store` (always) and, when configured, to
//! Pyroscope through the bounded spool of `push`. Sampling never waits for either:
//! encoding, store and spool writes run on the `writer` thread, and pushing on its
//! own thread.
//!
//! Signals: SIGTERM (and Ctrl-C) cut the current, partial interval, store it, deliver
//! what can be delivered of the spool now, and exit within [`STOP_DEADLINE`]; SIGHUP
//! reloads the config file. docs/operations.md is the operator's guide.
//!
//! The agent sits above the collection engine ([`allocbpf_collect`]) and the exporters
//! ([`allocbpf_export`]). What the binary calls has typed errors
//! ([`config::ConfigError`], [`StoreError`]) except [`run`], the agent's top
//! level, which returns `anyhow` errors like the private modules below it (store,
//! spool, push, writer, metrics): nothing else calls them.
#![deny(missing_docs)]

pub mod config;
pub mod merge;
mod metrics;
mod push;
mod store;
mod tls;
mod watchdog;
mod writer;

pub use store::StoreError;

use std::{
    path::PathBuf,
    sync::{atomic::Ordering, Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use tokio::signal::unix::{signal, SignalKind};

use self::{
    config::{AgentConfig, AgentOverrides},
    metrics::Metrics,
    push::{Lanes, PreparedPush},
    store::ProfileStore,
    watchdog::Notifier,
    writer::Writer,
};
use allocbpf_collect::{
    budget::CalibrationChild,
    engine::{window_wait, Collector, HOUSEKEEPING_TICK},
    filter::ProcessFilter,
    identity::hostname,
    kernel::KernelLoader,
    options::{CollectOptions, LiveMechanism, LiveOptions, Scope},
    preflight,
};

/// How often metrics are refreshed from the kernel and the collector.
const METRICS_REFRESH: Duration = Duration::from_secs(1);

/// From SIGTERM to exit at most: stopping the collector, writing what is queued and
/// delivering the spool share it (the push starts no request later than this minus
/// its timeout). The unit's `TimeoutStopSec=60` leaves 15 s to spare.
pub const STOP_DEADLINE: Duration = Duration::from_secs(45);

/// How the agent stopped, for the binary to say.
#[derive(Debug)]
pub struct Stopped {
    /// Profiles of the last, partial interval.
    pub flushed: usize,
    /// Profiles written over the agent's life.
    pub written: u64,
    /// Profiles left in the push spools.
    pub spooled: u64,
    /// The ring buffer could not be read any more (the agent stopped on it: a
    /// supervisor restarts an agent that can no longer sample).
    pub read_error: Option<std::io::Error>,
}

/// Runs the agent until SIGTERM through the kernel side `loader` loads, with the config
/// file `config_file` (re-read at SIGHUP) under `overrides`.
///
/// `calibration` starts the child that measures a probe hit's cost for the budget.
pub fn run(
    loader: &dyn KernelLoader,
    config_file: Option<PathBuf>,
    overrides: AgentOverrides,
    calibration: CalibrationChild,
) -> Result<Stopped> {
    let source = ConfigSource {
        file: config_file,
        overrides,
    };
    let config = source.load()?;
    let filter = ProcessFilter::new(&config.filter)?;
    // An unusable store fails before anything is attached.
    let store = ProfileStore::open(&config.store, config.retention)?;
    preflight::check_privileges()?;
    preflight::check_kernel()?;
    preflight::raise_descriptor_limit();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(Agent::new(source, config, store)?.run(loader, filter, calibration))
}

/// What the engine collects for the agent: the config's choices, the defaults elsewhere.
fn collect_options(config: &AgentConfig) -> CollectOptions {
    CollectOptions {
        rate: config.rate,
        live: config.live.then_some(LiveOptions {
            mechanism: LiveMechanism::Auto,
            leaks_min_age: None,
        }),
        unwind: config.unwind,
        allocator_prefixes: config.allocator_symbols.clone(),
        budget: config.budget,
        ..CollectOptions::default()
    }
}

/// Where the agent's config comes from, for the first load and every reload.
struct ConfigSource {
    file: Option<PathBuf>,
    overrides: AgentOverrides,
}

impl ConfigSource {
    fn load(&self) -> Result<AgentConfig> {
        Ok(AgentConfig::load(self.file.as_deref(), &self.overrides)?)
    }
}

struct Agent {
    source: ConfigSource,
    config: AgentConfig,
    /// Each store's push spool and counts, opened at the first push to it and kept
    /// for the agent's life: every pusher a reload starts shares them.
    lanes: Lanes,
    writer: Writer,
    metrics: Arc<Mutex<Metrics>>,
}

impl Agent {
    fn new(source: ConfigSource, config: AgentConfig, store: ProfileStore) -> Result<Agent> {
        let mut lanes = Lanes::default();
        let prepared = match &config.push {
            Some(push) => lanes.prepare(push, &config.store)?,
            None => Vec::new(),
        };
        let pushers = prepared
            .into_iter()
            .map(|push| push.start(None))
            .collect::<Result<Vec<_>>>()?;
        let writer = Writer::start(store, pushers, hostname())?;
        Ok(Agent {
            source,
            config,
            lanes,
            writer,
            metrics: Arc::new(Mutex::new(Metrics::new())),
        })
    }

    async fn run(
        mut self,
        loader: &dyn KernelLoader,
        filter: ProcessFilter,
        calibration: CalibrationChild,
    ) -> Result<Stopped> {
        // Bound before anything is attached: a configured endpoint that cannot exist is
        // an error at start, not a silent task failure.
        let listener = match self.config.metrics_address {
            Some(address) => Some(metrics::bind(address).await?),
            None => None,
        };
        let metrics_task =
            listener.map(|listener| tokio::spawn(metrics::serve(listener, self.metrics.clone())));
        // Before the long start-up: a SIGHUP or SIGTERM meanwhile must not take the
        // default action (end the process).
        let mut sigterm = signal(SignalKind::terminate()).context("SIGTERM handler")?;
        let mut sighup = signal(SignalKind::hangup()).context("SIGHUP handler")?;
        let mut collector = Collector::start(
            loader,
            CollectOptions {
                calibration,
                ..collect_options(&self.config)
            },
            Scope::Host { filter },
        )?;
        tracing::info!(
            "agent started: {} image(s) attached, interval {}s, store {}{}",
            collector.stats.images_attached,
            self.config.interval.as_secs(),
            self.config.store.display(),
            match &self.config.push {
                Some(push) => format!(
                    ", pushing to {}",
                    push.targets
                        .iter()
                        .map(|t| format!("{} ({})", t.url, t.destination.name()))
                        .collect::<Vec<_>>()
                        .join(" and ")
                ),
                None => String::new(),
            }
        );
        let mut notifier = Notifier::from_env();
        if let Some(notifier) = &notifier {
            notifier.ready();
        }
        let mut tick = tokio::time::interval(HOUSEKEEPING_TICK);
        let mut metrics_tick = tokio::time::interval(METRICS_REFRESH);
        let mut cut = new_cut_timer(self.config.interval);
        let mut read_error = None;
        loop {
            let window_at = collector.next_window_change();
            tokio::select! {
                read = collector.read() => {
                    if let Err(error) = read {
                        // Stop, flush what was collected, then exit non-zero: a
                        // supervisor restarts an agent that can no longer sample.
                        tracing::error!("reading the ring buffer failed: {error}; stopping");
                        read_error = Some(error);
                        break;
                    }
                }
                _ = tick.tick() => {
                    collector.housekeeping();
                    if let Some(notifier) = notifier.as_mut() {
                        notifier.feed(self.writer.stats.stalled_for());
                    }
                }
                _ = window_wait(window_at) => collector.windows_tick(),
                _ = metrics_tick.tick() => self.update_metrics(&mut collector),
                _ = cut.tick() => {
                    // Dropped (counted, logged) if the writer already holds too many.
                    let _ = self.writer.export(collector.cut());
                }
                _ = sighup.recv() => {
                    if let Some(interval) = self.reload(&mut collector) {
                        cut = new_cut_timer(interval);
                    }
                }
                _ = sigterm.recv() => break,
                _ = tokio::signal::ctrl_c() => break,
            }
        }
        self.shut_down(collector, notifier, metrics_task, read_error)
    }

    /// Stops collecting; the current, partial interval is stored and pushed before exit.
    fn shut_down(
        self,
        collector: Collector,
        notifier: Option<Notifier>,
        metrics_task: Option<tokio::task::JoinHandle<()>>,
        read_error: Option<std::io::Error>,
    ) -> Result<Stopped> {
        let deadline = Instant::now() + STOP_DEADLINE;
        tracing::info!("stopping: flushing the current interval");
        if let Some(notifier) = &notifier {
            notifier.stopping();
        }
        let profiles = collector.stop();
        let flushed = profiles.len();
        self.writer.export_last(profiles);
        // A request started then ends by the deadline.
        let timeout = self
            .config
            .push
            .as_ref()
            .map_or(Duration::ZERO, |p| p.timeout);
        let push_until = deadline.checked_sub(timeout).unwrap_or_else(Instant::now);
        let stats = self.writer.stats.clone();
        if !self.writer.finish(push_until, deadline) {
            tracing::warn!(
                "stopping: the profile writer had not finished {}s after SIGTERM; exiting without it",
                STOP_DEADLINE.as_secs()
            );
        }
        if let Some(task) = metrics_task {
            task.abort();
        }
        Ok(Stopped {
            flushed,
            written: stats.profiles_written.load(Ordering::Relaxed),
            spooled: self
                .lanes
                .stats()
                .iter()
                .map(|(_, stats)| stats.spool_files.load(Ordering::Relaxed))
                .sum::<u64>(),
            read_error,
        })
    }

    fn update_metrics(&mut self, collector: &mut Collector) {
        let kernel = collector.counters();
        let metrics = self.metrics.lock().expect("metrics lock");
        metrics.update(&metrics::Sources {
            engine: &collector.stats,
            kernel: &kernel,
            stores: &self.lanes.stats(),
            writer: &self.writer.stats,
        });
        metrics.update_budget(&collector.budget_figures());
    }

    /// SIGHUP: re-reads the config; applies filters, interval, retention and push.
    /// Returns the new interval if it changed.
    fn reload(&mut self, collector: &mut Collector) -> Option<Duration> {
        let config = match self.source.load() {
            Ok(config) => config,
            Err(error) => {
                tracing::error!("SIGHUP: config not reloaded: {error:#}");
                return None;
            }
        };
        let filter = match ProcessFilter::new(&config.filter) {
            Ok(filter) => filter,
            Err(error) => {
                tracing::error!("SIGHUP: config not reloaded: {error}");
                return None;
            }
        };
        // Every fallible part before anything changes: a reload applies whole or not
        // at all. The push is restarted on every reload, so a changed credentials file
        // is read again; each profile store keeps its one spool, under the running
        // store directory (a change of that waits for a restart), its new bound
        // applied by the writer.
        let push: Vec<PreparedPush> = match &config.push {
            Some(push) => match self.lanes.prepare(push, &self.config.store) {
                Ok(prepared) => prepared,
                Err(error) => {
                    tracing::error!("SIGHUP: config not reloaded: push: {error:#}");
                    return None;
                }
            },
            None => Vec::new(),
        };
        collector.set_filter(filter);
        // Applied by the writer thread after the profiles queued before; the old
        // pusher finishes its request in flight in the background, so no thread waits
        // on the network.
        self.writer.reconfigure(config.retention, push);
        for (what, changed) in [
            ("rate", config.rate != self.config.rate),
            ("live", config.live != self.config.live),
            ("unwind", config.unwind != self.config.unwind),
            ("store", config.store != self.config.store),
            (
                "metrics_address",
                config.metrics_address != self.config.metrics_address,
            ),
            (
                "allocator_symbols",
                config.allocator_symbols != self.config.allocator_symbols,
            ),
            ("budget", config.budget != self.config.budget),
        ] {
            if changed {
                tracing::warn!("SIGHUP: {what} changes take effect at the next restart");
            }
        }
        let interval = (config.interval != self.config.interval).then_some(config.interval);
        tracing::info!("SIGHUP: config reloaded");
        self.config = AgentConfig {
            rate: self.config.rate,
            live: self.config.live,
            unwind: self.config.unwind,
            store: self.config.store.clone(),
            metrics_address: self.config.metrics_address,
            allocator_symbols: self.config.allocator_symbols.clone(),
            budget: self.config.budget,
            ..config
        };
        interval
    }
}

fn new_cut_timer(interval: Duration) -> tokio::time::Interval {
    let mut timer = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    timer
}
