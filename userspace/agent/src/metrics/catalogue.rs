//! The agent's unlabelled metrics, each defined once: its name (registered under the
//! `allocbpf_` prefix, counters with `_total`), its help, and where its value is read
//! ([`Reading`]). docs/operations.md lists them for operators.

use std::sync::atomic::AtomicU64;

use allocbpf_collect::engine::CollectorStats;
use allocbpf_profile::report::Counters;

use crate::{push::PushStats, writer::WriterStats};

/// Where a metric's value comes from.
pub(super) enum Reading {
    /// The engine's running counts.
    Engine(fn(&CollectorStats) -> u64),
    /// The kernel's counters.
    Kernel(fn(&Counters) -> u64),
    /// Every push lane's count, summed.
    Push(fn(&PushStats) -> &AtomicU64),
    /// The profile writer's counts.
    Writer(fn(&WriterStats) -> &AtomicU64),
    /// The agent process itself, read at each refresh.
    Process(fn() -> u64),
    /// Events counted where they happen ([`super::Metrics::count`]).
    Counted,
}

/// One metric.
pub(super) struct Metric {
    /// Its name, without the prefix.
    pub name: &'static str,
    /// Its help text.
    pub help: &'static str,
    /// Where its value is read.
    pub reading: Reading,
}

/// Counters: running totals.
pub(super) const COUNTERS: &[Metric] = &[
    Metric {
        name: "samples",
        help: "Samples aggregated",
        reading: Reading::Engine(|s| s.samples),
    },
    Metric {
        name: "ring_buffer_drops",
        help: "Samples lost because the ring buffer was full",
        reading: Reading::Kernel(|k| k.ring_buffer_drops),
    },
    Metric {
        name: "filtered_samples",
        help: "Samples dropped because their process is filtered out",
        reading: Reading::Engine(|s| s.filtered_samples),
    },
    Metric {
        name: "attach_failures",
        help: "Allocator images that could not be attached",
        reading: Reading::Engine(|s| s.attach_failures),
    },
    Metric {
        name: "exec_events",
        help: "Exec events received",
        reading: Reading::Engine(|s| s.exec_events),
    },
    Metric {
        name: "exit_events",
        help: "Process exits received",
        reading: Reading::Engine(|s| s.exit_events),
    },
    Metric {
        name: "profiles_written",
        help: "Profiles written to the local store",
        reading: Reading::Writer(|w| &w.profiles_written),
    },
    Metric {
        name: "store_errors",
        help: "Profiles that could not be written to the local store",
        reading: Reading::Writer(|w| &w.store_errors),
    },
    Metric {
        name: "store_deleted",
        help: "Profiles deleted by retention or to make room on a full disk",
        reading: Reading::Writer(|w| &w.store_deleted),
    },
    Metric {
        name: "push_delivered",
        help: "Profiles delivered to the profile store",
        reading: Reading::Push(|p| &p.delivered),
    },
    Metric {
        name: "export_errors",
        help: "Failed push attempts",
        reading: Reading::Push(|p| &p.errors),
    },
    Metric {
        name: "push_dropped",
        help: "Profiles dropped because the push spool was full",
        reading: Reading::Push(|p| &p.dropped),
    },
    Metric {
        name: "push_rejected",
        help: "Profiles dropped because they can never be delivered (corrupt spool record, 4xx)",
        reading: Reading::Push(|p| &p.rejected),
    },
    Metric {
        name: "push_labels_dropped",
        help: "Labels left out of a Pyroscope push: a name it refuses, a value too long, too many",
        reading: Reading::Push(|p| &p.labels_dropped),
    },
    Metric {
        name: "push_series_dropped",
        help: "Profiles not pushed to Pyroscope: a new series beyond push.max_series within an hour",
        reading: Reading::Push(|p| &p.series_dropped),
    },
    Metric {
        name: "push_abandoned",
        help: "Profiles dropped after failing on their own (5xx) 5 times while others were delivered",
        reading: Reading::Push(|p| &p.abandoned),
    },
    Metric {
        name: "profiles_dropped",
        help: "Profiles of cuts dropped because the writer thread already held 3 cuts (slow store disk)",
        reading: Reading::Writer(|w| &w.profiles_dropped),
    },
    Metric {
        name: "window_attaches",
        help: "Probes of an image put back in as an observation window opened (overhead budget)",
        reading: Reading::Engine(|s| s.window_attaches),
    },
    Metric {
        name: "window_detaches",
        help: "Probes of an image taken out as an observation window closed (overhead budget)",
        reading: Reading::Engine(|s| s.window_detaches),
    },
    Metric {
        name: "window_blind_spots",
        help: "Observation windows that opened before their probes were in (their samples are dropped)",
        reading: Reading::Engine(|s| s.window_blind_spots),
    },
    Metric {
        name: "own_link_attaches",
        help: "Light processes given their own full-time probes beside a heavier one on a shared image (overhead budget)",
        reading: Reading::Engine(|s| s.own_link_attaches),
    },
    Metric {
        name: "own_link_removals",
        help: "Processes whose own probes were taken away when they went over their budget",
        reading: Reading::Engine(|s| s.own_link_removals),
    },
    Metric {
        name: "own_link_failures",
        help: "Own probes of a light process that could not be attached (it stays in the shared windows)",
        reading: Reading::Engine(|s| s.own_link_failures),
    },
    Metric {
        name: "unplaced_samples",
        help: "Samples dropped outside their process's observation window",
        reading: Reading::Engine(|s| s.unplaced_samples),
    },
    Metric {
        name: "window_expired_blocks",
        help: "Live blocks that left the in-use set when their observation window closed",
        reading: Reading::Engine(|s| s.window_expired_blocks),
    },
    Metric {
        name: "lost_frees",
        help: "Live blocks retired at a cut because the kernel no longer tracked them (Freed event lost)",
        reading: Reading::Engine(|s| s.lost_frees),
    },
    Metric {
        name: "module_files_closed",
        help: "Module files closed at a cut because no profile referred to them any more",
        reading: Reading::Engine(|s| s.module_files_closed),
    },
    Metric {
        name: "released_images",
        help: "Allocator images detached because no process maps them any more",
        reading: Reading::Engine(|s| s.images_released),
    },
    Metric {
        name: "stack_errors",
        help: "Samples whose user stack could not be read in the kernel",
        reading: Reading::Kernel(|k| k.stack_errors),
    },
    Metric {
        name: "thread_map_full",
        help: "Probe hits that found the thread maps full (counted per process, sampled per CPU)",
        reading: Reading::Kernel(|k| k.thread_map_full),
    },
    Metric {
        name: "process_map_full",
        help: "Probe hits lost to exact totals because the process map was full",
        reading: Reading::Kernel(|k| k.process_map_full),
    },
    Metric {
        name: "live_map_full",
        help: "Sampled blocks not tracked as live because the live map was full",
        reading: Reading::Kernel(|k| k.live_map_full),
    },
    Metric {
        name: "exec_queue_overflows",
        help: "Exec events left to the periodic rescan because the exec queue was full",
        reading: Reading::Engine(|s| s.exec_queue_overflows),
    },
    Metric {
        name: "refused_files",
        help: "Mapped files refused unread for a hostile ELF layout (too many sections or bytes)",
        reading: Reading::Engine(|s| s.files_refused),
    },
    Metric {
        name: "skipped_images",
        help: "Allocator images not attached because the cap on attached images was reached",
        reading: Reading::Engine(|s| s.images_skipped),
    },
    Metric {
        name: "malformed_records",
        help: "Ring-buffer records that could not be decoded",
        reading: Reading::Engine(|s| s.malformed_records),
    },
    Metric {
        name: "descriptor_errors",
        help: "Mapped files that could not be opened for want of file descriptors",
        reading: Reading::Engine(|s| s.descriptor_errors),
    },
    Metric {
        name: "maps_truncated",
        help: "Process memory maps read only in part (over the 16 MiB cap)",
        reading: Reading::Engine(|s| s.maps_truncated),
    },
    Metric {
        name: "agent_sample_milliseconds",
        help: "CPU the agent spent resolving and adding samples",
        reading: Reading::Engine(|s| s.agent_sample_ns / 1_000_000),
    },
    Metric {
        name: "agent_look_milliseconds",
        help: "CPU the agent spent looking at processes' language runtimes",
        reading: Reading::Engine(|s| s.agent_look_ns / 1_000_000),
    },
    Metric {
        name: "stacks_merged",
        help: "Samples added under their process's one [stack table of this process full] row (past 32,768 distinct stacks in an interval)",
        reading: Reading::Engine(|s| s.stacks_merged),
    },
    Metric {
        name: "source_locations_released",
        help: "Runtime source locations released at cuts (no remaining stack or runtime cache referred to them)",
        reading: Reading::Engine(|s| s.locations_released),
    },
    Metric {
        name: "runtime_entries_refused",
        help: "Processes not walked by their runtime because their user holds its share of that runtime's kernel map",
        reading: Reading::Engine(|s| s.runtime_entries_refused),
    },
    Metric {
        name: "remote_reads_stalled",
        help: "Reads of a process's memory that outlived their deadline (the process set aside until the read returns)",
        reading: Reading::Process(|| allocbpf_collect::remote_reads::figures().stalled),
    },
    Metric {
        name: "remote_reads_refused",
        help: "Reads of a process's memory refused because a read of it, or of its user's processes, is stuck",
        reading: Reading::Process(|| allocbpf_collect::remote_reads::figures().refused),
    },
    Metric {
        name: "metrics_accept_errors",
        help: "Failed accepts on the metrics endpoint (descriptors exhausted)",
        reading: Reading::Counted,
    },
    Metric {
        name: "metrics_connections_refused",
        help: "Metrics connections closed at once: too many open",
        reading: Reading::Counted,
    },
];

/// Gauges: values now.
pub(super) const GAUGES: &[Metric] = &[
    Metric {
        name: "attached_images",
        help: "Allocator images with probes attached",
        reading: Reading::Engine(|s| s.images_attached),
    },
    Metric {
        name: "tracked_processes",
        help: "Processes followed",
        reading: Reading::Engine(|s| s.processes_tracked),
    },
    Metric {
        name: "budget_windowed_images",
        help: "Allocator images probed part time now (overhead budget)",
        reading: Reading::Engine(|s| s.budget_windowed_images),
    },
    Metric {
        name: "budget_periods_with_windows_percent",
        help: "Percentage of periods given observation windows (below 100: moving probes cost the agent more than budget.window_moves_cpu_percent)",
        reading: Reading::Engine(|s| s.budget_periods_with_windows_percent),
    },
    Metric {
        name: "spool_bytes",
        help: "Bytes of profiles waiting in the push spool",
        reading: Reading::Push(|p| &p.spool_bytes),
    },
    Metric {
        name: "spool_profiles",
        help: "Profiles waiting in the push spool",
        reading: Reading::Push(|p| &p.spool_files),
    },
    Metric {
        name: "store_bytes",
        help: "Bytes in the local store",
        reading: Reading::Writer(|w| &w.store_bytes),
    },
    Metric {
        name: "resident_memory_bytes",
        help: "Agent resident set size",
        reading: Reading::Process(|| super::own_cpu_and_rss().1),
    },
    Metric {
        name: "module_files_open",
        help: "Module files held open for symbolization",
        reading: Reading::Engine(|s| s.module_files_open),
    },
    Metric {
        name: "ring_buffer_peak_bytes",
        help: "Most sample ring-buffer bytes found waiting at one read since start",
        reading: Reading::Engine(|s| s.ring_peak_bytes),
    },
    Metric {
        name: "module_entries",
        help: "Modules (executables and libraries) current stacks refer to",
        reading: Reading::Engine(|s| s.module_entries),
    },
    Metric {
        name: "kernel_process_entries",
        help: "Processes with entries in the kernel's per-process maps at the last cut",
        reading: Reading::Engine(|s| s.kernel_processes),
    },
    Metric {
        name: "kernel_live_blocks",
        help: "Sampled blocks in the kernel's live map at the last cut",
        reading: Reading::Engine(|s| s.kernel_live_blocks),
    },
    Metric {
        name: "source_locations",
        help: "Runtime source locations held after the last cut (each process may hold an eighth of the table)",
        reading: Reading::Engine(|s| s.locations),
    },
    Metric {
        name: "remote_reads_stuck",
        help: "Reads of other processes' memory stuck now (each on a reader thread set aside)",
        reading: Reading::Process(|| allocbpf_collect::remote_reads::figures().stuck_now as u64),
    },
    Metric {
        name: "open_descriptors",
        help: "File descriptors the agent holds",
        reading: Reading::Process(super::open_descriptors),
    },
    Metric {
        name: "event_queue_peak_bytes",
        help: "Most record bytes read from the ring and waiting for the main thread at once",
        reading: Reading::Engine(|s| s.queue_peak_bytes),
    },
];
