//! The kernel-facing side of allocbpf: the eBPF sampler and what it sends.
//!
//! Data flow: allocator images (`allocbpf-images`: which entries, at which
//! instruction) → the eBPF sampler ([`sampler`]: load an object the binary embeds,
//! attach uprobes, per-thread countdowns, exact totals, gates, the interval table) →
//! the ring buffer ([`events`]: read on a thread of its own, decoded into
//! [`events::RawSample`]s and process events).
//!
//! [`preflight`] says why the kernel or privileges cannot run the probes. Errors are
//! typed ([`sampler::ProbeError`], ...). It shares the sampling scheme with the profile
//! model through `allocbpf-sampling` (the interval table, the certain threshold, the
//! kernel's counters), not the model itself, and knows nothing of stacks beyond raw
//! addresses, nothing of aggregation or reports, and nothing of the
//! command line. It does not build the eBPF program: the binary does (its `build.rs`)
//! and passes the object's bytes to [`sampler::Sampler::load`], so this crate builds,
//! and its tests run, without the BPF toolchain.
#![deny(missing_docs)]

pub mod events;
pub mod preflight;
pub mod sampler;
