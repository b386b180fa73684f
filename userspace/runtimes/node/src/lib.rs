//! Node.js processes seen from outside, with no inspector, no flag and no code run in
//! them: V8's allocation-observer step and large-object spaces are probed (every chunk
//! of bytes a space's linear allocation buffer handed out, every large object), and
//! each sample's JavaScript frames are found on the native stack the eBPF program
//! copied and named from the V8 heap, with the constants every node binary publishes
//! about its own layout (`v8dbg_` symbols).
//!
//! - [`v8dbg`]: the debug constants, read from the binary's file and checked;
//! - [`observer`]: the offsets the allocation-observer step reads, from its own code;
//! - [`process`]: is a process Node.js, and what its binary says;
//! - [`code`]: which code object a return address is in;
//! - [`heap`]: tagged values, objects, strings and arrays of a V8 heap, read bounded;
//! - [`positions`]: V8's source position tables and line ends;
//! - [`names`]: functions, scripts and lines of JavaScript frames;
//! - [`walk`]: JavaScript frames on a copied native stack;
//! - [`runtime`]: Node.js as a [`Runtime`](allocbpf_runtime::Runtime).
//!
//! Everything read from a process is the target's to forge: every read is bounded,
//! every walk ends, and what does not read back sensibly yields a plainer frame, never
//! a hang.
#![deny(missing_docs)]

pub mod code;
#[cfg(test)]
mod forged;
pub mod heap;
pub mod names;
pub mod observer;
pub mod positions;
pub mod process;
pub mod runtime;
pub mod v8dbg;
pub mod walk;

pub use runtime::{NodeRuntime, NAME};

/// Why a Node.js process gets no JavaScript frames or no JS heap samples.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NodeError {
    /// The binary lacks a constant this reading needs.
    #[error("its binary defines no {0}")]
    MissingConstant(&'static str),
    /// A constant no V8 build has.
    #[error("{0} = {1} is not what a V8 build has (forged?)")]
    Forged(&'static str, i64),
    /// A V8 older than allocbpf reads.
    #[error("V8 {0}.{1} is older than V8 11, the oldest allocbpf reads")]
    TooOld(u32, u32),
    /// The allocation-observer step's code is not the shape allocbpf reads.
    #[error("its allocation-observer step ({0}) has code allocbpf does not read")]
    UnknownStep(&'static str),
}
