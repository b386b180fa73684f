//! Stacks: from the raw return addresses and stack bytes of a sample to named frames.
//!
//! Data flow: [`events::RawSample`](allocbpf_probe::events::RawSample) →
//! [`resolve::StackResolver`] → [`unwind`] (DWARF unwinding of the copied user stack,
//! with framehop, where frame pointers are missing) → [`normalize`] (address →
//! module + file offset, on receipt, while the process still lives) → each language
//! runtime's frames merged in (`allocbpf_runtime::Runtime`, interned in the resolver's
//! one location table) → at report time [`symbolize`] (blazesym, through files held open since the process mapped them).
//!
//! It produces [`Frame`](allocbpf_profile::frame::Frame)s of the profile model and
//! implements its [`Symbolize`](allocbpf_profile::frame::Symbolize) step; it knows
//! nothing of aggregation, reports or the command line.
#![deny(missing_docs)]

mod copies;
pub mod normalize;
pub mod resolve;
pub mod symbolize;
pub mod unwind;
