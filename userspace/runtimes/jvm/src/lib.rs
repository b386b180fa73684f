//! HotSpot JVMs seen from outside, with no agent loaded and no flag: libjvm's
//! allocation tracer is probed (every TLAB a thread takes, every object allocated
//! outside one), and each sample's Java frames are walked from the stack the eBPF
//! program copied, with the offsets the JVM publishes about itself.
//!
//! - [`vmstructs`]: the JVM's own tables of its structures (`gHotSpotVMStructs`);
//! - [`layout`]: the offsets read from them, per version;
//! - [`process`]: is a process a JVM, and its layout;
//! - [`code`]: the interpreter, the code cache, compiled methods' inlined scopes;
//! - [`stream`]: HotSpot's compressed integers;
//! - [`walk`]: Java frames from a copied stack;
//! - [`names`]: classes, methods, files and lines;
//! - [`command`]: the main class or jar a command line names;
//! - [`runtime`]: the JVM as a [`Runtime`](allocbpf_runtime::Runtime).
//!
//! Everything read from a JVM is the target's to forge: every read is bounded, every
//! walk ends, and what does not read back sensibly yields fewer frames, never a hang.
#![deny(missing_docs)]

pub mod code;
pub mod command;
#[cfg(test)]
mod forged;
pub mod layout;
pub mod names;
pub mod process;
pub mod runtime;
pub mod stream;
pub mod vmstructs;
pub mod walk;

pub use runtime::{JvmRuntime, NAME};

/// Why a JVM gets no Java frames.
#[derive(Clone, Debug, thiserror::Error)]
pub enum JvmError {
    /// libjvm lacks a symbol the tables are found from.
    #[error("libjvm exports no {0}")]
    MissingSymbol(String),
    /// The tables lack a field or type this reading needs.
    #[error("its structure tables have no {0}")]
    MissingField(String),
    /// The process's memory did not hold what the tables say.
    #[error("{0} could not be read from its memory")]
    Unreadable(&'static str),
    /// A value that cannot be true of a JVM.
    #[error("{0} is not what a HotSpot JVM has (forged?)")]
    Forged(&'static str),
    /// A JDK older than allocbpf reads.
    #[error("JDK {0} is older than JDK 11, the oldest whose structures allocbpf reads")]
    TooOld(u32),
}
