//! The profile model: what a sampled allocation is worth, how samples add up, and the
//! finished report every exporter reads.
//!
//! - [`estimate`]: the unbiased weight of a sample, `S / (1 - exp(-S/R))`, and its
//!   confidence intervals (the table of exponential intervals the kernel draws from
//!   and the certain threshold are `allocbpf-sampling`'s, re-exported there).
//! - [`aggregate`]: samples unbiased one by one, then summed per stack (and, for live
//!   tracking, per block until freed).
//! - [`report`]: an aggregate with symbolized locations, exact kernel totals and health
//!   counters: the input of every exporter.
//! - [`timeline`]: one process's allocation and heap in use over time, and the stacks
//!   at its peak, recorded at a bounded cost.
//! - [`frame`]: the vocabulary stages share: a normalized frame (module, file offset,
//!   or a runtime's source location), the functions at it, the table of source
//!   locations (owned by whoever makes the frames), and the [`frame::Symbolize`] step
//!   the report asks for.
//! - [`units`]: byte sizes and durations as people write them.
//!
//! Pure computation: this crate must not depend on aya, tokio, blazesym or any I/O
//! crate, so the accuracy harness and exporters can use it alone.
#![deny(missing_docs)]

pub mod aggregate;
pub mod estimate;
pub mod frame;
pub mod report;
pub(crate) mod stats;
pub mod timeline;
pub mod units;
