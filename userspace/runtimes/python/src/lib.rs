//! CPython seen from outside the process.
//!
//! The eBPF program walks a sampled thread's interpreter frames and sends back, per
//! frame, the address of its code object and of its current instruction. This crate
//! knows what those words mean for each CPython version:
//! - [`discover`]: whether a process runs CPython, which version, and what the eBPF
//!   walk must follow in it;
//! - [`layout`]: the offsets of the fields the walk and the resolution read, per minor
//!   version;
//! - [`code`]: frame records to function, file and line, the target's memory read as
//!   hostile input;
//! - [`linetable`]: the line of an instruction, from the code object's line table in
//!   each version's format;
//! - [`memory`]: bounded reads of another process's memory (`allocbpf-images`' own,
//!   shared with the Go reader); every reader here takes it as the toolkit's
//!   [`allocbpf_runtime::toolkit::RemoteMemory`], so that tests hand them forged memory;
//! - [`pools`]: where pymalloc's used pools are, for `--live` at inlined sites;
//! - [`runtime`]: all of it behind the engine's [`allocbpf_runtime::Runtime`]
//!   interface.

pub mod code;
pub mod discover;
pub mod layout;
pub mod linetable;
pub use allocbpf_images::memory;
pub mod pools;
pub mod runtime;
