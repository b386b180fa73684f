//! Walks a Java thread's frames from the last Java frame a sample captured, over the
//! copy of its stack: an interpreted frame keeps its `Method*` and bytecode pointer at
//! fixed slots below its frame pointer and links to its caller through it; a compiled
//! frame (or a runtime stub's) has its blob's fixed size, its caller's pc in its last
//! word and the caller's frame pointer below that. The walk stops at the first pc that
//! is neither (the call stub that entered Java from the VM, native code), at a word the
//! copy does not hold, or after [`MAX_JAVA_FRAMES`].

use allocbpf_images::memory::ProcessMemory;

use crate::{
    code::{CodeCache, Scope},
    layout::{Layout, INTERPRETER_BCP_SLOT, INTERPRETER_METHOD_SLOT, INTERPRETER_SENDER_SP_SLOT},
};

/// Most Java frames (inlined ones included) taken from one sample.
pub const MAX_JAVA_FRAMES: usize = 256;

/// A copy of a stack, read from `base` up.
pub struct StackCopy<'a> {
    /// The address of `bytes[0]`.
    pub base: u64,
    /// The bytes.
    pub bytes: &'a [u8],
}

impl StackCopy<'_> {
    /// The word at `address`, if the copy holds it.
    pub fn word(&self, address: u64) -> Option<u64> {
        let at = usize::try_from(address.checked_sub(self.base)?).ok()?;
        let bytes = self.bytes.get(at..at.checked_add(8)?)?;
        Some(u64::from_le_bytes(bytes.try_into().ok()?))
    }
}

/// A frame the walk found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JavaFrame {
    /// An interpreted method at a bytecode pointer (`bcp`).
    Interpreted {
        /// `Method*`.
        method: u64,
        /// The bytecode pointer.
        bcp: u64,
    },
    /// A compiled method's scope (inlined ones included).
    Compiled(Scope),
}

/// The last Java frame: `sp`, `pc` (0 when the anchor left it out: it is then the
/// word below `sp`) and `fp`.
#[derive(Clone, Copy, Debug)]
pub struct Anchor {
    /// `_last_Java_sp`.
    pub sp: u64,
    /// `_last_Java_pc`.
    pub pc: u64,
    /// `_last_Java_fp`.
    pub fp: u64,
}

/// The thread's Java frames, innermost first.
pub fn walk(
    code: &mut CodeCache,
    memory: &ProcessMemory,
    layout: &Layout,
    anchor: Anchor,
    stack: &StackCopy<'_>,
) -> Vec<JavaFrame> {
    let mut frames = Vec::new();
    let mut fp = anchor.fp;
    let pc = match anchor.pc {
        0 => stack.word(anchor.sp.wrapping_sub(8)),
        pc => Some(pc),
    };
    let Some(mut pc) = pc else {
        return frames;
    };
    // The stack pointer a compiled frame's size counts from: an interpreted callee
    // records its caller's as it was before an adapter extended it.
    let mut unextended_sp = anchor.sp;
    let slot = |fp: u64, slot: i64| stack.word(fp.wrapping_add_signed(slot * 8));
    while frames.len() < MAX_JAVA_FRAMES {
        if code.is_interpreted(pc) {
            let (Some(method), Some(bcp)) = (
                slot(fp, INTERPRETER_METHOD_SLOT),
                slot(fp, INTERPRETER_BCP_SLOT),
            ) else {
                break;
            };
            frames.push(JavaFrame::Interpreted { method, bcp });
            let (Some(caller_sp), Some(caller_pc), Some(caller_fp)) = (
                slot(fp, INTERPRETER_SENDER_SP_SLOT),
                slot(fp, 1),
                stack.word(fp),
            ) else {
                break;
            };
            unextended_sp = caller_sp;
            pc = caller_pc;
            fp = caller_fp;
        } else {
            let Some(blob) = code.blob_at(pc, layout) else {
                break;
            };
            if blob.method.is_some() {
                let scopes = blob.scopes_at(memory, pc, layout);
                frames.extend(scopes.into_iter().map(JavaFrame::Compiled));
            }
            if blob.frame_bytes == 0 {
                break;
            }
            let caller_sp = unextended_sp.wrapping_add(blob.frame_bytes);
            let (Some(caller_pc), Some(caller_fp)) = (
                stack.word(caller_sp.wrapping_sub(8)),
                stack.word(caller_sp.wrapping_sub(16)),
            ) else {
                break;
            };
            unextended_sp = caller_sp;
            pc = caller_pc;
            fp = caller_fp;
        }
    }
    frames.truncate(MAX_JAVA_FRAMES);
    frames
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_copy_answers_only_for_words_it_holds() {
        let bytes: Vec<u8> = (0u64..4).flat_map(|w| w.to_le_bytes()).collect();
        let copy = StackCopy {
            base: 0x1000,
            bytes: &bytes,
        };
        assert_eq!(copy.word(0x1008), Some(1));
        assert_eq!(copy.word(0x1018), Some(3));
        assert_eq!(copy.word(0x1019), None);
        assert_eq!(copy.word(0xff8), None);
        assert_eq!(copy.word(u64::MAX - 3), None);
    }
}
