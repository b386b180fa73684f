//! allocbpf: a heap-allocation profiler built on eBPF uprobes and Poisson byte sampling.
//!
//! Modules follow the data flow:
//! [`target`] (which libc, which functions) → [`probe`] (load, attach, kernel maps) →
//! [`events`] (ring buffer) → [`normalize`] (module + offset, on receipt) →
//! [`aggregate`] (unbias each sample, then sum, see [`estimate`]) → [`symbolize`] →
//! [`report`] → [`export`]. [`session`] runs one profiling session end to end.
#![warn(missing_docs)]

pub mod agent;
pub mod aggregate;
pub mod allocators;
pub mod cli;
pub mod discover;
pub mod elf_ranges;
pub mod estimate;
pub mod events;
pub mod export;
pub mod image;
pub mod normalize;
pub mod preflight;
pub mod probe;
pub mod procfs;
pub mod report;
pub mod session;
pub mod stacks;
pub mod symbolize;
pub mod system;
pub mod target;
pub mod units;
pub mod unwind;
