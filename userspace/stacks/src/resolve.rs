//! From a sample's raw stack to normalized frames: unwind the copied stack (auto and
//! dwarf modes) or take the kernel's frame-pointer walk, then normalize each address to
//! module + offset while the process's maps are still readable.

use crate::normalize::AddressNormalizer;
use crate::python::PythonStacks;
use crate::unwind::{Fallback, StackUnwinder};
use allocbpf_probe::events::RawSample;
use allocbpf_profile::frame::Frame;

/// Unwinds and normalizes samples of any number of processes.
pub struct StackResolver {
    /// Normalizes addresses; its module table is what frames refer to.
    pub normalizer: AddressNormalizer,
    /// Unwinds copied stacks (auto/dwarf); `None` with frame pointers.
    pub unwinder: Option<StackUnwinder>,
    /// Python processes: their frames, merged into the native ones.
    pub python: PythonStacks,
}

impl StackResolver {
    /// A resolver for `mode`, in a session that discovers entries with `prefixes`
    /// (renamed allocators' prefixes).
    pub fn new(mode: UnwindMode, prefixes: &[String]) -> Self {
        let prefixes = prefixes.to_vec();
        Self {
            normalizer: AddressNormalizer::new(),
            unwinder: match mode {
                UnwindMode::Fp => None,
                UnwindMode::Auto => Some(StackUnwinder::new(Fallback::FramePointers, prefixes)),
                UnwindMode::Dwarf => Some(StackUnwinder::new(Fallback::Stop, prefixes)),
            },
            python: PythonStacks::default(),
        }
    }

    /// Reads and caches `pid`'s maps now, while it surely lives.
    pub fn prime(&mut self, pid: u32) {
        self.normalizer.prime(pid);
        if let Some(unwinder) = self.unwinder.as_mut() {
            unwinder.prime(pid);
        }
    }

    /// Drops what is cached about `pid` (it exited, or it exec'd a new program).
    pub fn forget(&mut self, pid: u32) {
        self.normalizer.forget(pid);
        self.python.forget(pid);
        if let Some(unwinder) = self.unwinder.as_mut() {
            unwinder.forget(pid);
        }
    }

    /// The sample's frames, innermost first.
    pub fn resolve(&mut self, sample: &RawSample) -> Vec<Frame> {
        let unwound;
        let stack = match self.unwinder.as_mut() {
            Some(unwinder) if !sample.user_stack.is_empty() => {
                let mut from_tables = unwinder.unwind(sample.pid, sample.regs, &sample.user_stack);
                // At an inlined site the sampled function is a frame of its own (the
                // unwinder starts with its caller).
                if sample.inlined && !from_tables.is_empty() {
                    from_tables.splice(0..0, sample.stack.first().copied());
                }
                unwound = from_tables;
                if unwound.is_empty() {
                    // Nothing unwound: keep the immediate caller read at [sp].
                    &sample.stack
                } else {
                    &unwound
                }
            }
            _ => &sample.stack,
        };
        let native = self.normalizer.normalize(sample.pid, stack);
        self.python.merge(sample, stack, native)
    }
}

/// How user stacks are unwound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnwindMode {
    /// Unwind tables where a module has them, frame pointers elsewhere.
    Auto,
    /// Unwind tables only.
    Dwarf,
    /// Frame pointers, in the kernel.
    Fp,
}

impl UnwindMode {
    /// Bytes of user stack each sample copies in this mode, of `stack_bytes` wanted (0
    /// when frame pointers are walked in the kernel).
    pub fn stack_copy_bytes(self, stack_bytes: u32) -> u32 {
        match self {
            UnwindMode::Fp => 0,
            UnwindMode::Auto | UnwindMode::Dwarf => stack_bytes,
        }
    }
}
