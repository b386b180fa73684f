//! The locations stacks are made of, as every stage after the ring buffer sees them.
//!
//! A [`Frame`] is a return address normalized to (module, file offset) while its process
//! lived; a [`Module`] names the file; [`Functions`] are what symbolization found at a
//! frame. [`Symbolize`] is the step a report asks of whoever owns the modules' files
//! (`allocbpf-stacks`), so the model itself reads no file.

use std::{path::PathBuf, sync::Arc};

/// An executable or shared object that frames point into.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Module {
    /// Path to the file (as named in the process's maps).
    pub path: PathBuf,
    /// GNU build id, if the file has one.
    pub build_id: Option<Vec<u8>>,
}

impl Module {
    /// The build id as lowercase hex, or an empty string.
    pub fn build_id_hex(&self) -> String {
        self.build_id
            .as_deref()
            .unwrap_or_default()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// The file name, for display.
    pub fn file_name(&self) -> String {
        self.path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| self.path.display().to_string())
    }
}

/// A normalized frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Frame {
    /// A return address inside a module, as a file offset.
    Module {
        /// Index into the report's module list ([`Symbolize::modules`]).
        module: u32,
        /// File offset of the return address.
        offset: u64,
    },
    /// An address no module covered (JIT code, unmapped, or a garbage frame pointer).
    Unknown(u64),
    /// The only frame of samples the kernel's sample ring had no room for: they kept
    /// their weight but not their stack ([`LOST_SAMPLES_NAME`]).
    Lost,
}

/// How a [`Frame::Lost`] reads in reports.
pub const LOST_SAMPLES_NAME: &str = "[stack lost: sample ring buffer full]";

/// One function in a symbolized location.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FunctionFrame {
    /// Demangled function name.
    pub name: String,
    /// Source file, where debug info exists.
    pub file: Option<String>,
    /// Source line, where debug info exists.
    pub line: Option<u32>,
}

/// The functions at one address: innermost (inlined callee) first, the function that
/// physically contains the code last. This is pprof's `Location.line` order.
/// Shared (`Arc`): reports cross to the agent's writer thread.
pub type Functions = Arc<[FunctionFrame]>;

/// Names frames for a report.
pub trait Symbolize {
    /// Resolves every frame of `frames` not resolved yet (one batch per module).
    fn prepare(&mut self, frames: &mut dyn Iterator<Item = &Frame>);
    /// The functions at `frame`; a frame not prepared comes back unresolved.
    fn functions(&self, frame: &Frame) -> Functions;
    /// False when frames keep module + offset only (no debug info read).
    fn symbolizes(&self) -> bool;
    /// The modules frames point into, indexed by [`Frame::Module::module`].
    fn modules(&self) -> Vec<Module>;
}
