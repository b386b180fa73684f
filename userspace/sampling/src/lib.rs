//! The sampling scheme the kernel side and userspace agree on, below both: the table
//! of exponential intervals the eBPF program draws its countdowns from
//! ([`interval_table`]), the size from which an allocation is always recorded
//! ([`certain_threshold`]), and the kernel's counters of a window ([`Counters`]).
//!
//! The probe fills the kernel's maps from it and reads the counters back; the profile
//! model's estimator weighs samples by the same threshold. Neither borrows the
//! other's model for it.
#![deny(missing_docs)]

pub mod interval_table;

/// The smallest size that is sampled with probability at least 99%: `ceil(R ln 100)`.
/// Allocations this large are always recorded (heapprofd's large-allocation shortcut).
pub fn certain_threshold(rate: u64) -> u64 {
    (rate as f64 * 100f64.ln()).ceil() as u64
}

/// The kernel side's counters for a window, summed over CPUs: sampling health.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Counters {
    /// Samples taken.
    pub samples: u64,
    /// Samples lost because the ring buffer was full.
    pub ring_buffer_drops: u64,
    /// Samples whose user stack could not be read.
    pub stack_errors: u64,
    /// Calls by threads that found the thread map full.
    pub thread_map_full: u64,
    /// Thread exits whose totals were lost because the process map was full.
    pub process_map_full: u64,
    /// Calls a probed wrapper forwarded to another probed function (counted once).
    pub forwarded_calls: u64,
    /// Sampled blocks not tracked because the live map was full.
    pub live_map_full: u64,
    /// Tracked sampled blocks freed.
    pub live_frees: u64,
    /// Returns of awaited calls handled.
    pub live_returns: u64,
    /// Of `ring_buffer_drops`, samples the ring of lost samples could not take either:
    /// their weight is missing from the estimates.
    pub lost_unrecorded: u64,
    /// Times the sampling interval was doubled because the reader fell behind (each
    /// sample carries the interval it was drawn at, so estimates stay unbiased).
    pub pressure_raises: u64,
}
