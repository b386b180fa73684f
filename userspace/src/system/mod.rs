//! System-wide profiling: every process of the host, through every allocator image in
//! use, attached once per image.
//!
//! Data flow, as in single-process mode but keyed by process: probe (one set of uprobes
//! per image, [`crate::discover`]) → ring buffer (samples, and exec/exit events) →
//! per-process gate and filter ([`filter`]) → normalize ([`crate::stacks`]) → one
//! aggregate per process → per-process reports ([`ProcessProfile`]), cut on demand (the
//! agent cuts one per interval). [`budget`] keeps each process's probe overhead within
//! its budget.
//!
//! New images are found from exec events (a BTF raw tracepoint on
//! `sched_process_exec`) a moment after the exec, when the dynamic loader has mapped the
//! libraries, plus a full `/proc` scan at start and every [`RESCAN_INTERVAL`] as a safety
//! net for libraries loaded later (dlopen) and for events lost to a full ring buffer.
//! Scanning only is simpler but either misses short-lived processes in new images or
//! costs a full `/proc` walk every few hundred milliseconds; exec events cost nothing
//! between execs.

pub mod budget;
pub mod filter;
pub mod oneshot;
pub mod process;
mod profiler;

use std::time::Duration;

pub use profiler::{ProcessProfile, SystemOptions, SystemProfiler, SystemStats};

/// How often all of `/proc` is rescanned for new images.
pub const RESCAN_INTERVAL: Duration = Duration::from_secs(30);
