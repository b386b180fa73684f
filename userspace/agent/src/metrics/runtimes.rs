//! Each language runtime's reads of its processes' own samplers (the Go runtime's heap
//! profile, say), labelled `runtime="..."` with the runtime's name as the engine
//! counts them: no runtime is named here, and a new one is counted with no edit.

use prometheus_client::registry::Registry;

use super::LabelledCounter;
use allocbpf_collect::engine::CollectorStats;

/// The per-runtime counters.
#[derive(Default)]
pub(super) struct RuntimeCounters {
    polls: LabelledCounter,
    records: LabelledCounter,
    bytes: LabelledCounter,
    milliseconds: LabelledCounter,
}

impl RuntimeCounters {
    /// Registers the counters in `registry`.
    pub(super) fn register(registry: &mut Registry) -> Self {
        let counters = Self::default();
        for (name, help, family) in [
            (
                "runtime_polls",
                "Reads of processes' own samplers by a language runtime (label runtime)",
                &counters.polls,
            ),
            (
                "runtime_records_read",
                "Sample records (heap-profile buckets) those reads walked",
                &counters.records,
            ),
            (
                "runtime_bytes_read",
                "Bytes of processes' memory those reads copied",
                &counters.bytes,
            ),
            (
                "runtime_poll_milliseconds",
                "Time spent in those reads",
                &counters.milliseconds,
            ),
        ] {
            registry.register(name, help, family.clone());
        }
        counters
    }

    /// Brings the counters up to the engine's figures (running totals: a counter
    /// never goes back).
    pub(super) fn update(&self, stats: &CollectorStats) {
        for (&runtime, figures) in &stats.runtime_reads {
            let labels = vec![("runtime".to_string(), runtime.to_string())];
            for (family, total) in [
                (&self.polls, figures.polls),
                (&self.records, figures.records),
                (&self.bytes, figures.bytes),
                (&self.milliseconds, figures.ns / 1_000_000),
            ] {
                let counter = family.get_or_create(&labels);
                let before = counter.get();
                if total > before {
                    counter.inc_by(total - before);
                }
            }
        }
    }
}
