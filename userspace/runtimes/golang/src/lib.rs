//! Go processes seen from outside.
//!
//! A Go program allocates from its own heap and never calls malloc (but through cgo),
//! so no probe sees its allocations. Its runtime samples them itself, by bytes with a
//! Poisson process (`runtime.MemProfileRate`), and keeps per (stack, size) bucket the
//! counts and bytes allocated and freed (`runtime.mbuckets`). This crate reads those
//! buckets from the process's memory, at no cost to it:
//! - [`buildinfo`]: the Go version a binary was built with (`.go.buildinfo`);
//! - [`pclntab`]: the function table every Go binary keeps, stripped or not
//!   (`.gopclntab`): functions by name and address, their files, lines and inlined
//!   calls;
//! - [`runtime`]: where the profiling variables are, read from the code of runtime
//!   functions that use them (no symbol table needed);
//! - [`buckets`]: the bucket list walked in the process's memory, every read bounded
//!   and every pointer checked, since the target can forge it;
//! - [`process`]: one process polled: new sampled allocations since the previous
//!   poll, and objects in use;
//! - [`heap_profile`]: all of it behind the engine's [`allocbpf_runtime::Runtime`]
//!   interface.
#![deny(missing_docs)]

pub mod buckets;
pub mod buildinfo;
pub mod heap_profile;
pub mod pclntab;
pub mod process;
pub mod runtime;
