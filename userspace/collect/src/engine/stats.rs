//! The engine's running counts, for logs and the agent's metrics.

use std::collections::BTreeMap;

use allocbpf_runtime::PollFigures;

/// Running counts, for logs and the agent's metrics.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct CollectorStats {
    /// Samples aggregated.
    pub samples: u64,
    /// Samples dropped because their process is filtered out (before its gate closed).
    pub filtered_samples: u64,
    /// Images with probes attached now.
    pub images_attached: u64,
    /// Images that could not be attached.
    pub attach_failures: u64,
    /// Allocator images found but not attached because `super::images::MAX_IMAGES`
    /// were attached already (total; counted at each look at a process mapping one).
    pub images_skipped: u64,
    /// Mapped files refused unread for a hostile ELF layout (too many section headers,
    /// too many bytes to read), each counted once (total).
    pub files_refused: u64,
    /// CPU this thread spent resolving and adding samples, nanoseconds (total).
    pub agent_sample_ns: u64,
    /// CPU this thread spent looking at processes' runtimes, nanoseconds (total).
    pub agent_look_ns: u64,
    /// Samples added under a process's one "stack table full" row (total).
    pub stacks_merged: u64,
    /// Runtime source locations released at cuts, no stack referring to them (total).
    pub locations_released: u64,
    /// Runtime source locations held after the last cut.
    pub locations: u64,
    /// Runtime map entries refused to a user over its share (`engine/map_shares.rs`).
    pub runtime_entries_refused: u64,
    /// Processes seen so far.
    pub processes_seen: u64,
    /// Processes followed now.
    pub processes_tracked: u64,
    /// Exec events received.
    pub exec_events: u64,
    /// Exit events received.
    pub exit_events: u64,
    /// Images probed part time now (overhead budget).
    pub budget_windowed_images: u64,
    /// The percentage of periods given windows now (overhead budget; 100 unless
    /// moving probes costs the agent more than its share).
    pub budget_periods_with_windows_percent: u64,
    /// Probes put back in as observation windows opened (total).
    pub window_attaches: u64,
    /// Probes taken out as observation windows closed (total).
    pub window_detaches: u64,
    /// Windows that opened before their probes were in (the engine was late): their
    /// samples are dropped (total).
    pub window_blind_spots: u64,
    /// Light processes given their own full-time links beside a heavier one (total).
    pub own_link_attaches: u64,
    /// Processes whose own links were taken away, over their budget (total).
    pub own_link_removals: u64,
    /// Own links that could not be attached or switched to (total).
    pub own_link_failures: u64,
    /// Samples dropped outside their process's window, or unplaceable (total).
    pub unplaced_samples: u64,
    /// Live blocks that left the in-use set when their window closed (total).
    pub window_expired_blocks: u64,
    /// Live blocks retired because the kernel no longer tracked them: their `Freed`
    /// event was lost (total).
    pub lost_frees: u64,
    /// Module files closed because no profile referred to them any more (total).
    pub module_files_closed: u64,
    /// Module files held open now (for symbolization).
    pub module_files_open: u64,
    /// Modules in the normalizer's table now (those current stacks refer to).
    pub module_entries: u64,
    /// Images detached because no process maps them any more (total).
    pub images_released: u64,
    /// Exec events not followed up because the queue of processes to examine was full
    /// (the periodic rescan finds them later).
    pub exec_queue_overflows: u64,
    /// Samples the kernel's sample ring had no room for, aggregated with their weight
    /// under a stack that says so (total).
    pub lost_samples: u64,
    /// The ring-pressure level at the last look: sampling intervals are `rate << level`
    /// while the reader falls behind (0 when it keeps up).
    pub pressure_level: u64,
    /// The highest ring-pressure level seen.
    pub pressure_peak_level: u64,
    /// Ring-buffer records that could not be decoded.
    pub malformed_records: u64,
    /// The most ring-buffer bytes found waiting at one read.
    pub ring_peak_bytes: u64,
    /// The most record bytes read from the ring and waiting for this thread at once
    /// (while it examined an image or cut a profile).
    pub queue_peak_bytes: u64,
    /// Processes with kernel entries (totals or gate) after the last cut: bounded by
    /// the processes running, whatever the churn.
    pub kernel_processes: u64,
    /// Blocks in the kernel's live map at the last cut (live tracking).
    pub kernel_live_blocks: u64,
    /// Memory maps the engine read that were cut at their size cap (total).
    pub maps_truncated: u64,
    /// Opens of mapped files that failed for want of descriptors (total; module files,
    /// images, executables' build ids).
    pub descriptor_errors: u64,
    /// What reading each runtime's own samplers cost, by runtime name (totals).
    pub runtime_reads: BTreeMap<&'static str, PollFigures>,
}

impl CollectorStats {
    /// What reading runtime `name`'s own samplers cost so far (zero if none was read).
    pub fn runtime_reads(&self, name: &str) -> PollFigures {
        self.runtime_reads.get(name).copied().unwrap_or_default()
    }
}
