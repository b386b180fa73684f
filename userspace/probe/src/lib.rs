//! The kernel-facing side of allocbpf: what to probe, the probes, and what they send.
//!
//! Data flow: a process's maps ([`procfs`], read as hostile input through
//! `/proc/PID/map_files`) → its allocator images ([`discover`], [`image`]: which
//! entries, at which instruction, [`allocators`]: the catalogue of families) → the
//! eBPF sampler ([`sampler`]: load, attach uprobes, per-thread countdowns, exact
//! totals, gates, the interval table) → the ring buffer ([`events`]: read on a thread of
//! its own, decoded into [`events::RawSample`]s and process events).
//!
//! [`target`] resolves one process's images, [`preflight`] says why the kernel or
//! privileges cannot run the probes. Errors are typed ([`sampler::ProbeError`],
//! [`target::TargetError`], ...). It speaks the profile model's vocabulary where it
//! hands data on (kernel counters, a sample's estimator inputs) but knows nothing of
//! stacks beyond raw addresses, nothing of aggregation or reports, and nothing of the
//! command line.
#![deny(missing_docs)]

pub mod allocators;
pub mod discover;
pub mod elf_ranges;
pub mod events;
pub mod image;
pub mod preflight;
pub mod procfs;
pub mod sampler;
pub mod sealed_copy;
pub mod target;
