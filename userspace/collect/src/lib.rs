//! The collection engine: attach the probes, read and resolve samples, aggregate them
//! per process, and cut reports. One engine ([`engine::Collector`]) for one process,
//! every process and the agent; whom it profiles is its [`options::Scope`].
//!
//! - [`options`]: what to collect and from whom (plain values, defaults defined once);
//! - [`engine`]: the collector and its parts (process table, image set, exec queue,
//!   interval cutter), and what it produces ([`engine::ProcessProfile`]);
//! - [`budget`]: the per-process overhead budget the engine applies (host scope);
//! - [`run`]: one run until a stop condition, one report (the command line's modes);
//! - [`filter`], [`identity`]: which processes, and the labels of their profiles;
//! - [`raw_samples`]: every raw sample as a JSON line, for offline analysis;
//! - [`runtimes`]: the language runtimes the engine hands processes to (the one
//!   place that names them).
//!
//! Above [`allocbpf_probe`] (the sampler and ring buffer), [`allocbpf_stacks`] and
//! [`allocbpf_profile`]; below the agent and the binary. It holds no command-line
//! types and names no flag; errors are [`error::CollectError`].
#![deny(missing_docs)]

pub mod budget;
/// Checks before loading anything (privileges, kernel features, limits): the probe
/// layer's, for the agent and the binary.
pub use allocbpf_probe::preflight;
/// CLOCK_MONOTONIC now, in nanoseconds: the clock the kernel stamps samples with.
pub use allocbpf_probe::sampler::monotonic_now_ns;
pub mod engine;
pub mod error;
pub mod filter;
pub mod identity;
pub mod kernel;
pub mod options;
pub mod raw_samples;
/// Reads of other processes' memory, held to a deadline: what they went through.
pub mod remote_reads {
    pub use allocbpf_images::memory::deadline::{figures, ReadFigures, READ_DEADLINE};
}
pub mod run;
pub mod runtimes;
