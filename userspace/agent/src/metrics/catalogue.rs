//! The agent's unlabelled metrics: name and help of each counter and gauge, registered
//! under the `allocbpf_` prefix (counters get `_total`). docs/operations.md lists them
//! for operators.

pub(super) const COUNTERS: &[(&str, &str)] = &[
    ("samples", "Samples aggregated"),
    (
        "ring_buffer_drops",
        "Samples lost because the ring buffer was full",
    ),
    (
        "filtered_samples",
        "Samples dropped because their process is filtered out",
    ),
    (
        "attach_failures",
        "Allocator images that could not be attached",
    ),
    ("exec_events", "Exec events received"),
    ("exit_events", "Process exits received"),
    ("profiles_written", "Profiles written to the local store"),
    (
        "store_errors",
        "Profiles that could not be written to the local store",
    ),
    (
        "store_deleted",
        "Profiles deleted by retention or to make room on a full disk",
    ),
    ("push_delivered", "Profiles delivered to the profile store"),
    ("export_errors", "Failed push attempts"),
    (
        "push_dropped",
        "Profiles dropped because the push spool was full",
    ),
    (
        "push_rejected",
        "Profiles dropped because they can never be delivered (corrupt spool record, 4xx)",
    ),
    (
        "push_labels_dropped",
        "Labels left out of a Pyroscope push: a name it refuses, a value too long, too many",
    ),
    (
        "push_series_dropped",
        "Profiles not pushed to Pyroscope: a new series beyond push.max_series within an hour",
    ),
    (
        "push_abandoned",
        "Profiles dropped after failing on their own (5xx) 5 times while others were delivered",
    ),
    (
        "profiles_dropped",
        "Profiles of cuts dropped because the writer thread already held 3 cuts (slow store disk)",
    ),
    (
        "window_attaches",
        "Probes of an image put back in as an observation window opened (overhead budget)",
    ),
    (
        "window_detaches",
        "Probes of an image taken out as an observation window closed (overhead budget)",
    ),
    (
        "window_blind_spots",
        "Observation windows that opened before their probes were in (their samples are dropped)",
    ),
    (
        "unplaced_samples",
        "Samples dropped outside their process's observation window",
    ),
    (
        "window_expired_blocks",
        "Live blocks that left the in-use set when their observation window closed",
    ),
    (
        "lost_frees",
        "Live blocks retired at a cut because the kernel no longer tracked them (Freed event lost)",
    ),
    (
        "module_files_closed",
        "Module files closed at a cut because no profile referred to them any more",
    ),
    (
        "released_images",
        "Allocator images detached because no process maps them any more",
    ),
    (
        "stack_errors",
        "Samples whose user stack could not be read in the kernel",
    ),
    (
        "thread_map_full",
        "Probe hits that found the thread maps full (counted per process, sampled per CPU)",
    ),
    (
        "process_map_full",
        "Probe hits lost to exact totals because the process map was full",
    ),
    (
        "live_map_full",
        "Sampled blocks not tracked as live because the live map was full",
    ),
    (
        "exec_queue_overflows",
        "Exec events left to the periodic rescan because the exec queue was full",
    ),
    (
        "refused_files",
        "Mapped files refused unread for a hostile ELF layout (too many sections or bytes)",
    ),
    (
        "skipped_images",
        "Allocator images not attached because the cap on attached images was reached",
    ),
    (
        "malformed_records",
        "Ring-buffer records that could not be decoded",
    ),
    (
        "descriptor_errors",
        "Mapped files that could not be opened for want of file descriptors",
    ),
    (
        "maps_truncated",
        "Process memory maps read only in part (over the 16 MiB cap)",
    ),
    (
        "metrics_accept_errors",
        "Failed accepts on the metrics endpoint (descriptors exhausted)",
    ),
    (
        "metrics_connections_refused",
        "Metrics connections closed at once: too many open",
    ),
];

pub(super) const GAUGES: &[(&str, &str)] = &[
    ("attached_images", "Allocator images with probes attached"),
    ("tracked_processes", "Processes followed"),
    (
        "budget_windowed_images",
        "Allocator images probed part time now (overhead budget)",
    ),
    ("spool_bytes", "Bytes of profiles waiting in the push spool"),
    ("spool_profiles", "Profiles waiting in the push spool"),
    ("store_bytes", "Bytes in the local store"),
    ("resident_memory_bytes", "Agent resident set size"),
    (
        "module_files_open",
        "Module files held open for symbolization",
    ),
    (
        "ring_buffer_peak_bytes",
        "Most sample ring-buffer bytes found waiting at one read since start",
    ),
    (
        "module_entries",
        "Modules (executables and libraries) current stacks refer to",
    ),
    (
        "kernel_process_entries",
        "Processes with entries in the kernel's per-process maps at the last cut",
    ),
    (
        "kernel_live_blocks",
        "Sampled blocks in the kernel's live map at the last cut",
    ),
    ("open_descriptors", "File descriptors the agent holds"),
    (
        "event_queue_peak_bytes",
        "Most record bytes read from the ring and waiting for the main thread at once",
    ),
];
