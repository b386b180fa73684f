//! What every runtime needs to read other processes from outside, written once:
//!
//! - [`memory`]: another process's memory behind a trait ([`RemoteMemory`]), with a
//!   fake ([`FakeMemory`]) that serves forged bytes, so that every reader can be tested
//!   on memory a hostile process could make;
//! - [`cache`]: a cache bounded in bytes that evicts its oldest entries when full and
//!   says what it holds ([`ByteCache`]);
//! - [`processes`]: each process's state, a runtime's own or a retry after a look that
//!   came too early, with one forget ([`ProcessStates`]);
//! - [`stack`]: reads of a stack the eBPF program copied ([`StackCopy`]).

pub mod cache;
pub mod memory;
pub mod processes;
pub mod stack;

pub use cache::{ByteCache, CacheFigures};
pub use memory::{FakeMemory, RemoteMemory};
pub use processes::{Known, ProcessStates, RetryPolicy};
pub use stack::StackCopy;
