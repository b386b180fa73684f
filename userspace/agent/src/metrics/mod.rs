//! The agent's self-metrics, served in the Prometheus text format.

use std::{
    net::SocketAddr,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use anyhow::{Context, Result};
use prometheus_client::{
    encoding::text::encode,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
};

mod catalogue;
mod runtimes;

use self::catalogue::{Metric, Reading, COUNTERS, GAUGES};
use super::{push::PushStats, writer::WriterStats};
use allocbpf_collect::engine::{BudgetFigures, CollectorStats, ProcessCostFigures};
use allocbpf_profile::report::Counters;

/// Every metric, registered once.
pub struct Metrics {
    registry: Registry,
    /// [`COUNTERS`], in order.
    counters: Vec<Counter>,
    /// [`GAUGES`], in order.
    gauges: Vec<Gauge>,
    cpu_seconds: Gauge<f64, AtomicU64>,
    budget: BudgetGauges,
    per_store: StoreGauges,
    per_runtime: runtimes::RuntimeCounters,
}

/// What [`Metrics::update`] reads.
pub struct Sources<'a> {
    /// The engine's running counts.
    pub engine: &'a CollectorStats,
    /// The kernel's counters.
    pub kernel: &'a Counters,
    /// Each push lane's counts, by store.
    pub stores: &'a [(&'static str, Arc<PushStats>)],
    /// The profile writer's counts.
    pub writer: &'a WriterStats,
}

/// A counter per label set (a profile store).
type LabelledCounter = Family<Vec<(String, String)>, Counter>;

/// Each profile store's own delivery figures (the unlabelled totals sum them).
#[derive(Default)]
struct StoreGauges {
    delivered: LabelledCounter,
    errors: LabelledCounter,
    spooled: Labelled,
}

/// A gauge per label set (an image, a process).
type Labelled = Family<Vec<(String, String)>, Gauge<f64, AtomicU64>>;

/// The overhead budget's per-image and per-process gauges.
#[derive(Default)]
struct BudgetGauges {
    image_probed: Labelled,
    image_overhead: Labelled,
    process_observed: Labelled,
    process_overhead: Labelled,
    process_full_time: Labelled,
    process_pace: Labelled,
    process_agent: Labelled,
    process_coarsening: Labelled,
}

/// Processes with per-process budget gauges: the most expensive ones (labels per pid
/// would otherwise grow with the host's process count).
const PROCESS_GAUGES: usize = 20;

/// Longest label value kept (paths and command names come from other processes).
const MAX_LABEL: usize = 160;

/// A label value from untrusted text: printable ASCII without quotes or backslashes,
/// bounded in length.
fn label_value(text: &str) -> String {
    text.chars()
        .take(MAX_LABEL)
        .map(|c| match c {
            ' '..='~' if c != '"' && c != '\\' => c,
            _ => '_',
        })
        .collect()
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric under the `allocbpf_` prefix.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("allocbpf");
        let counters = COUNTERS
            .iter()
            .map(|metric| {
                let counter = Counter::default();
                registry.register(metric.name, metric.help, counter.clone());
                counter
            })
            .collect();
        let gauges = GAUGES
            .iter()
            .map(|metric| {
                let gauge = Gauge::default();
                registry.register(metric.name, metric.help, gauge.clone());
                gauge
            })
            .collect();
        let cpu_seconds = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "cpu_seconds",
            "Agent CPU time (user + system), seconds",
            cpu_seconds.clone(),
        );
        let budget = BudgetGauges::default();
        for (name, help, family) in [
            (
                "budget_image_probed_fraction",
                "Fraction of the last budget check an image's probes were in",
                &budget.image_probed,
            ),
            (
                "budget_image_overhead_cpu",
                "Estimated CPUs spent in probes by the processes mapping an image",
                &budget.image_overhead,
            ),
            (
                "budget_process_observed_fraction",
                "Expected fraction of the current interval a process is observed",
                &budget.process_observed,
            ),
            (
                "budget_process_overhead_cpu",
                "Estimated fraction of a CPU a process spends in probes",
                &budget.process_overhead,
            ),
            (
                "budget_process_full_time_cpu",
                "Estimated fraction of a CPU a process would spend in probes if probed full time",
                &budget.process_full_time,
            ),
            (
                "budget_process_agent_cpu",
                "Estimated fraction of a CPU the agent spends on a process's samples (steady per-sample cost)",
                &budget.process_agent,
            ),
            (
                "budget_process_sampling_coarsening",
                "Doublings of a process's sampling interval that keep the agent's CPU for it within its budget",
                &budget.process_coarsening,
            ),
            (
                "budget_process_pace",
                "A process's pace while probed relative to unprobed this interval, which its estimates are corrected for (absent: not measured or not slowed)",
                &budget.process_pace,
            ),
        ] {
            registry.register(name, help, family.clone());
        }
        let per_store = StoreGauges::default();
        for (name, help, family) in [
            (
                "push_store_delivered",
                "Profiles delivered to one profile store (label store: pyroscope, otlp)",
                &per_store.delivered,
            ),
            (
                "push_store_errors",
                "Failed push attempts to one profile store",
                &per_store.errors,
            ),
        ] {
            registry.register(name, help, family.clone());
        }
        registry.register(
            "push_store_spooled",
            "Profiles waiting in one profile store's spool",
            per_store.spooled.clone(),
        );
        let per_runtime = runtimes::RuntimeCounters::register(&mut registry);
        Self {
            registry,
            counters,
            gauges,
            cpu_seconds,
            budget,
            per_store,
            per_runtime,
        }
    }

    /// Adds one to counter `name` (a [`Reading::Counted`] one).
    pub fn count(&self, name: &str) {
        let known = COUNTERS.iter().position(|metric| metric.name == name);
        debug_assert!(known.is_some(), "no counter {name}");
        if let Some(index) = known {
            self.counters[index].inc();
        }
    }

    /// Updates everything from its source: the engine, the kernel, the exporters, the
    /// writer and this process.
    pub fn update(&self, sources: &Sources) {
        let stores = sources.stores;
        let value = |metric: &Metric| -> Option<u64> {
            Some(match metric.reading {
                Reading::Engine(read) => read(sources.engine),
                Reading::Kernel(read) => read(sources.kernel),
                // Every store's counts summed; per store under `store="..."` below.
                Reading::Push(read) => stores
                    .iter()
                    .map(|(_, stats)| read(stats).load(Ordering::Relaxed))
                    .sum(),
                Reading::Writer(read) => read(sources.writer).load(Ordering::Relaxed),
                Reading::Process(read) => read(),
                Reading::Counted => return None,
            })
        };
        for (metric, counter) in COUNTERS.iter().zip(&self.counters) {
            // Running totals: a counter never goes back.
            if let Some(total) = value(metric) {
                let current = counter.get();
                if total > current {
                    counter.inc_by(total - current);
                }
            }
        }
        for (metric, gauge) in GAUGES.iter().zip(&self.gauges) {
            if let Some(now) = value(metric) {
                gauge.set(now as i64);
            }
        }
        for (store, stats) in stores {
            let labels = vec![("store".to_string(), store.to_string())];
            let per_store = &self.per_store;
            for (family, value) in [
                (&per_store.delivered, &stats.delivered),
                (&per_store.errors, &stats.errors),
            ] {
                let counter = family.get_or_create(&labels);
                let (now, before) = (value.load(Ordering::Relaxed), counter.get());
                if now > before {
                    counter.inc_by(now - before);
                }
            }
            per_store
                .spooled
                .get_or_create(&labels)
                .set(stats.spool_files.load(Ordering::Relaxed) as f64);
        }
        self.per_runtime.update(sources.engine);
        self.cpu_seconds.set(own_cpu_and_rss().0);
    }

    /// Replaces the per-image and per-process budget gauges.
    pub fn update_budget(&self, figures: &BudgetFigures) {
        let b = &self.budget;
        for family in [
            &b.image_probed,
            &b.image_overhead,
            &b.process_observed,
            &b.process_overhead,
            &b.process_full_time,
            &b.process_pace,
        ] {
            family.clear();
        }
        for (key, path, image) in &figures.images {
            // Two containers' libcs share a path: the file identity tells them apart.
            let labels = vec![
                ("image".to_string(), label_value(path)),
                ("file".to_string(), label_value(key)),
            ];
            b.image_probed
                .get_or_create(&labels)
                .set(image.attached_fraction);
            b.image_overhead
                .get_or_create(&labels)
                .set(image.overhead_cpu);
        }
        let mut processes: Vec<_> = figures.processes.iter().collect();
        // The costliest first: in probes and in the agent's work for them.
        let cost = |figures: &ProcessCostFigures| figures.overhead_cpu + figures.agent_cpu;
        processes.sort_by(|a, b| cost(&b.3).total_cmp(&cost(&a.3)));
        for (pid, comm, observed, cost) in processes.into_iter().take(PROCESS_GAUGES) {
            let labels = vec![
                ("pid".to_string(), pid.to_string()),
                ("comm".to_string(), label_value(comm)),
            ];
            b.process_observed.get_or_create(&labels).set(*observed);
            b.process_overhead
                .get_or_create(&labels)
                .set(cost.overhead_cpu);
            b.process_full_time
                .get_or_create(&labels)
                .set(cost.full_time_cpu);
            b.process_agent.get_or_create(&labels).set(cost.agent_cpu);
            b.process_coarsening
                .get_or_create(&labels)
                .set(f64::from(cost.coarsening));
            if let Some(pace) = cost.pace {
                b.process_pace.get_or_create(&labels).set(pace);
            }
        }
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// Descriptors this process holds (entries of `/proc/self/fd`, less the one listing it).
pub fn open_descriptors() -> u64 {
    std::fs::read_dir("/proc/self/fd").map_or(0, |dir| dir.count().saturating_sub(1) as u64)
}

/// This process's CPU seconds and resident bytes, from `/proc/self`.
pub fn own_cpu_and_rss() -> (f64, u64) {
    // SAFETY: sysconf has no preconditions.
    let (ticks, page) = unsafe {
        (
            libc::sysconf(libc::_SC_CLK_TCK) as f64,
            libc::sysconf(libc::_SC_PAGESIZE) as u64,
        )
    };
    let cpu = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|stat| {
            // Fields after the command name (which may contain spaces).
            let rest = &stat[stat.rfind(')')? + 2..];
            let fields: Vec<&str> = rest.split(' ').collect();
            let user: f64 = fields.get(11)?.parse().ok()?;
            let system: f64 = fields.get(12)?.parse().ok()?;
            Some((user + system) / ticks)
        })
        .unwrap_or(0.0);
    let rss = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|statm| statm.split(' ').nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * page);
    (cpu, rss)
}

/// Connections served at once; more are closed at accept. Each costs a task and a
/// descriptor, and anybody on the network may open them.
const MAX_CONNECTIONS: usize = 16;

/// A connection is closed if it has not sent its request, or taken the answer, within
/// this long.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(2);

/// Pause after a failed accept (descriptors exhausted): a failing accept returns at
/// once, and retrying at once would spin a core.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Binds the metrics endpoint. Failing to bind is an error the agent reports at start:
/// a configured endpoint that silently does not exist would look like a dead agent.
pub async fn bind(address: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(address).await.with_context(|| {
        format!(
            "binding the metrics endpoint {address} (metrics_address in the config, \
             or --metrics-address; \"off\" disables it)"
        )
    })
}

/// Serves `metrics` on `listener` until the task is dropped: any GET gets the text.
/// At most [`MAX_CONNECTIONS`] at once, each closed after [`CONNECTION_TIMEOUT`].
pub async fn serve(listener: TcpListener, metrics: Arc<Mutex<Metrics>>) {
    if let Ok(address) = listener.local_addr() {
        tracing::info!("metrics on http://{address}/metrics");
    }
    let active = Arc::new(AtomicUsize::new(0));
    loop {
        let mut stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                metrics
                    .lock()
                    .expect("metrics lock")
                    .count("metrics_accept_errors");
                tracing::debug!("metrics endpoint: accept failed: {error}");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        if active.load(Ordering::Relaxed) >= MAX_CONNECTIONS {
            metrics
                .lock()
                .expect("metrics lock")
                .count("metrics_connections_refused");
            continue; // dropped: closed at once
        }
        active.fetch_add(1, Ordering::Relaxed);
        let body = metrics.lock().expect("metrics lock").render();
        let active = active.clone();
        tokio::spawn(async move {
            let _ = tokio::time::timeout(CONNECTION_TIMEOUT, async {
                let mut request = [0u8; 1024];
                let _ = stream.read(&mut request).await;
                let response = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
            })
            .await;
            active.fetch_sub(1, Ordering::Relaxed);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_render_with_totals() {
        let metrics = Metrics::new();
        let engine = |samples| CollectorStats {
            samples,
            ..Default::default()
        };
        let stores = [("otlp", Arc::new(PushStats::default()))];
        let writer = WriterStats::default();
        let update = |engine: &CollectorStats| {
            metrics.update(&Sources {
                engine,
                kernel: &Counters::default(),
                stores: &stores,
                writer: &writer,
            })
        };
        update(&engine(50));
        update(&engine(40)); // a counter never goes back
        metrics.count("metrics_accept_errors");
        let text = metrics.render();
        assert!(
            text.contains("allocbpf_push_store_delivered_total{store=\"otlp\"} 0"),
            "{text}"
        );
        assert!(text.contains("allocbpf_samples_total 50"), "{text}");
        assert!(
            text.contains("allocbpf_metrics_accept_errors_total 1"),
            "{text}"
        );
        assert!(text.contains("allocbpf_attached_images 0"), "{text}");
        assert!(text.contains("allocbpf_resident_memory_bytes"), "{text}");
        assert!(own_cpu_and_rss().1 > 0);
    }
}
