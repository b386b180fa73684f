//! Walks a Java thread's frames from the last Java frame a sample captured, over the
//! copy of its stack: an interpreted frame keeps its `Method*` and bytecode pointer at
//! fixed slots below its frame pointer and links to its caller through it; a compiled
//! frame (or a runtime stub's) has its blob's fixed size, its caller's pc in its last
//! word and the caller's frame pointer below that. The walk stops at the first pc that
//! is neither (the call stub that entered Java from the VM, native code), at a word the
//! copy does not hold, after [`MAX_JAVA_FRAMES`], or after [`MAX_WALK_STEPS`] frames
//! of any kind (runtime stubs push no Java frame, and a forged stack can chain them).

use allocbpf_runtime::toolkit::{RemoteMemory, StackCopy};

use crate::{
    code::{CodeCache, Scope},
    layout::{Layout, INTERPRETER_BCP_SLOT, INTERPRETER_METHOD_SLOT, INTERPRETER_SENDER_SP_SLOT},
};

/// Most Java frames (inlined ones included) taken from one sample.
pub const MAX_JAVA_FRAMES: usize = 256;

/// Most frames of any kind (interpreted, compiled, stubs) stepped through for one
/// sample: the work a target's stack can ask of us is bounded by this, not by the Java
/// frames it yields (a real stack has a stub or two between Java frames).
pub const MAX_WALK_STEPS: usize = 4 * MAX_JAVA_FRAMES;

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
    memory: &dyn RemoteMemory,
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
    for _ in 0..MAX_WALK_STEPS {
        if frames.len() >= MAX_JAVA_FRAMES {
            break;
        }
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
            let Some(blob) = code.blob_at(memory, pc, layout) else {
                break;
            };
            let (compiled, frame_bytes) = (blob.method.is_some(), blob.frame_bytes);
            if compiled {
                let scopes = code.scopes_at(memory, pc, layout);
                frames.extend(scopes.into_iter().map(JavaFrame::Compiled));
            }
            if frame_bytes == 0 {
                break;
            }
            let caller_sp = unextended_sp.wrapping_add(frame_bytes);
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
    use allocbpf_runtime::toolkit::FakeMemory;

    use super::*;
    use crate::forged::{self, CALL_INLINED, CODE_OFFSET, INNER_SCOPE, INTERPRETER, OUTER_SCOPE};

    /// Where the forged stacks were copied from.
    const BASE: u64 = 0x7ff0_0000;
    /// Bytes of each forged copy.
    const COPIED: usize = 0x200;
    /// An interpreted method, its bytecode pointer and a pc of the interpreter's.
    const INTERPRETED: u64 = 0x71_0000;
    const BCP: u64 = 0x72_0010;
    const INTERPRETER_PC: u64 = INTERPRETER + 0x80;
    /// A pc no code heap holds (native code).
    const NATIVE_PC: u64 = 0x1234;

    /// A copied stack of [`COPIED`] bytes from [`BASE`], `words` written in it.
    fn stack(words: &[(u64, u64)]) -> Vec<u8> {
        let mut bytes = vec![0u8; COPIED];
        for &(address, word) in words {
            let at = (address - BASE) as usize;
            bytes[at..at + 8].copy_from_slice(&word.to_le_bytes());
        }
        bytes
    }

    /// An interpreted frame at `fp`, running [`INTERPRETED`] at [`BCP`], called from
    /// `caller_pc` whose frame pointer is `caller_fp` and stack pointer `caller_sp`.
    fn interpreted(fp: u64, caller_sp: u64, caller_pc: u64, caller_fp: u64) -> [(u64, u64); 5] {
        let slot = |slot: i64| fp.wrapping_add_signed(slot * 8);
        [
            (slot(INTERPRETER_METHOD_SLOT), INTERPRETED),
            (slot(INTERPRETER_BCP_SLOT), BCP),
            (slot(INTERPRETER_SENDER_SP_SLOT), caller_sp),
            (slot(1), caller_pc),
            (fp, caller_fp),
        ]
    }

    /// The forged nmethod's inlined call.
    const CALL: u64 = forged::NMETHOD + CODE_OFFSET + CALL_INLINED;

    /// Walks a stack copied from [`BASE`], with `words` written in it, from `anchor`,
    /// in a forged JDK 17 code cache holding the forged nmethod.
    fn walk_forged(words: &[(u64, u64)], anchor: Anchor) -> Vec<JavaFrame> {
        walk_forged_with(words, anchor, |_, _, _| {})
    }

    /// [`walk_forged`], the forged memory changed by `forge` (memory, layout, blob).
    fn walk_forged_with(
        words: &[(u64, u64)],
        anchor: Anchor,
        forge: impl Fn(&mut FakeMemory, &crate::layout::Layout, u64),
    ) -> Vec<JavaFrame> {
        let layout = forged::layout_17();
        let mut memory = FakeMemory::new();
        let blob = forged::with_nmethod_17(&mut memory, &layout);
        forge(&mut memory, &layout, blob);
        let mut code = CodeCache::read(&memory, &layout).expect("a forged code cache reads");
        let bytes = stack(words);
        let copy = StackCopy {
            base: BASE,
            bytes: &bytes,
        };
        walk(&mut code, &memory, &layout, anchor, &copy)
    }

    #[test]
    fn an_interpreted_frame_then_its_compiled_caller_with_an_inlined_scope() {
        let fp = BASE + 0x60;
        let compiled_sp = BASE + 0x80;
        let caller_sp = compiled_sp + forged::FRAME_WORDS as u64 * 8;
        let mut words = interpreted(fp, compiled_sp, CALL, BASE + 0x1f0).to_vec();
        words.extend([(BASE + 0x8, INTERPRETER_PC), (caller_sp - 8, NATIVE_PC)]);
        let expected = vec![
            JavaFrame::Interpreted {
                method: INTERPRETED,
                bcp: BCP,
            },
            JavaFrame::Compiled(INNER_SCOPE),
            JavaFrame::Compiled(OUTER_SCOPE),
        ];
        // The anchor's pc, or (left out) the word below its sp.
        for pc in [INTERPRETER_PC, 0] {
            let anchor = Anchor {
                sp: BASE + 0x10,
                pc,
                fp,
            };
            assert_eq!(walk_forged(&words, anchor), expected, "anchor pc {pc:#x}");
        }
    }

    #[test]
    fn a_frame_pointer_loop_ends_at_the_frame_bound() {
        let fp = BASE + 0x60;
        let words = interpreted(fp, BASE + 0x80, INTERPRETER_PC, fp);
        let anchor = Anchor {
            sp: BASE + 0x10,
            pc: INTERPRETER_PC,
            fp,
        };
        let frame = JavaFrame::Interpreted {
            method: INTERPRETED,
            bcp: BCP,
        };
        assert_eq!(walk_forged(&words, anchor), vec![frame; MAX_JAVA_FRAMES]);
    }

    /// An interpreted frame whose caller is a chain of runtime stubs (no Java frame of
    /// their own) leading back to it: each Java frame costs a dozen steps, and the
    /// walk ends at its step bound, not after 256 frames' worth of steps.
    #[test]
    fn a_chain_of_stubs_back_to_the_same_frame_ends_at_the_step_bound() {
        let fp = BASE + 0x1f0;
        let frame_bytes = forged::FRAME_WORDS as u64 * 8;
        let first = BASE + 0x20;
        // The interpreted frame's caller is the stub at `first`; each stub's caller the
        // next, up to the last one below the frame, whose caller is the frame again.
        let mut words = interpreted(fp, first, CALL, fp).to_vec();
        // Below the interpreted frame's slots (down to 8 words under its fp).
        let stubs = (fp - 0x48 - first) / frame_bytes;
        for k in 1..=stubs {
            let caller_sp = first + k * frame_bytes;
            let caller_pc = if k == stubs { INTERPRETER_PC } else { CALL };
            words.push((caller_sp - 8, caller_pc));
            words.push((caller_sp - 16, fp));
        }
        let anchor = Anchor {
            sp: first,
            pc: INTERPRETER_PC,
            fp,
        };
        // The nmethod is a stub now: no method, so no Java frame.
        let walked = walk_forged_with(&words, anchor, |memory, layout, blob| {
            memory.write_u64(blob + layout.nmethod_method, 0);
        });
        let steps_per_frame = 1 + stubs as usize;
        assert!(steps_per_frame > 8, "{steps_per_frame}");
        assert_eq!(walked.len(), MAX_WALK_STEPS.div_ceil(steps_per_frame));
        assert!(walked.len() < MAX_JAVA_FRAMES);
    }

    #[test]
    fn a_compiled_frame_calling_itself_ends_at_the_copy_end() {
        let frame_bytes = forged::FRAME_WORDS as u64 * 8;
        // Each frame's return address is the same inlined call, up to the copy's end:
        // 16 frames' callers are copied, the 17th's is not.
        let words: Vec<(u64, u64)> = (1..=COPIED as u64 / frame_bytes)
            .map(|k| (BASE + k * frame_bytes - 8, CALL))
            .collect();
        let walked = walk_forged(
            &words,
            Anchor {
                sp: BASE,
                pc: CALL,
                fp: 0,
            },
        );
        let inlined = [
            JavaFrame::Compiled(INNER_SCOPE),
            JavaFrame::Compiled(OUTER_SCOPE),
        ];
        assert_eq!(walked, inlined.repeat(17));
        let native = Anchor {
            sp: BASE,
            pc: NATIVE_PC,
            fp: 0,
        };
        assert_eq!(walk_forged(&words, native), vec![], "a pc no heap holds");
    }

    #[test]
    fn words_outside_the_copy_end_the_walk() {
        let anchor = |fp| Anchor {
            sp: BASE + 0x10,
            pc: INTERPRETER_PC,
            fp,
        };
        let frame = JavaFrame::Interpreted {
            method: INTERPRETED,
            bcp: BCP,
        };
        // Its method and bytecode pointer are copied, its caller's pc is not.
        let fp = BASE + COPIED as u64 - 8;
        let words = &interpreted(fp, 0, 0, 0)[..3];
        assert_eq!(walk_forged(words, anchor(fp)), vec![frame]);
        let past = BASE + COPIED as u64 + 0x100;
        assert_eq!(walk_forged(&[], anchor(past)), vec![]);
        let left_out = Anchor {
            sp: BASE,
            pc: 0,
            fp: 0,
        };
        assert_eq!(walk_forged(&[], left_out), vec![], "no word below sp");
    }

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
