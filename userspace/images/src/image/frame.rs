//! The stack frame of an entry at each of its instructions, derived from its code.
//!
//! A forward-only entry that *calls* its forward (musl's `calloc` calls `malloc`) is
//! left unprobed only if a stack sampled in the callee can be unwound through the
//! entry's frame. musl has no unwind tables and omits frame pointers, so the rule for
//! that one frame is derived here from the code instead: the bytes the entry pushed or
//! reserved before the call, and where it saved the caller's `rbp`. The unwinder
//! ([`allocbpf_stacks::unwind`]) applies such a [`CallFrame`] at exactly that return address.

use iced_x86::{
    Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, Mnemonic, OpAccess,
    OpKind, Register, UsedRegister,
};

/// Where the caller's `rbp` is while the entry runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SavedRbp {
    /// Still in `rbp`: the entry has not written it.
    InRegister,
    /// Pushed; the value is the frame depth right after that push (the slot is at the
    /// entry's stack pointer minus this).
    Pushed(u32),
}

/// The frame at one instruction, on every path reaching it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameState {
    /// Bytes below the entry's stack pointer (its return address is at `sp + depth`).
    Known {
        /// Bytes pushed or reserved so far.
        depth: u32,
        /// The caller's `rbp`.
        rbp: SavedRbp,
    },
    /// Something moved the stack pointer or lost `rbp` in a way not followed here.
    Unknown,
}

impl FrameState {
    /// At the entry's first instruction.
    pub const ENTRY: FrameState = FrameState::Known {
        depth: 0,
        rbp: SavedRbp::InRegister,
    };

    /// Where two paths join: known only if both agree.
    pub fn meet(self, other: FrameState) -> FrameState {
        if self == other {
            self
        } else {
            FrameState::Unknown
        }
    }

    /// The frame after `instruction`. `writes` tells whether it writes a register
    /// (calls and returns, whose stack effect is not a frame change, are left alone).
    pub fn step(self, instruction: &Instruction, writes: impl Fn(Register) -> bool) -> Self {
        let FrameState::Known { depth, rbp } = self else {
            return self;
        };
        if matches!(
            instruction.flow_control(),
            FlowControl::Call | FlowControl::IndirectCall | FlowControl::Return
        ) {
            return self;
        }
        // A negative immediate does not fit: left unknown.
        let immediate = || match instruction.op1_kind() {
            OpKind::Immediate8to64 | OpKind::Immediate32to64 | OpKind::Immediate32 => {
                u32::try_from(instruction.immediate(1)).ok()
            }
            _ => None,
        };
        let on_rsp = instruction.op_count() == 2
            && instruction.op0_kind() == OpKind::Register
            && instruction.op0_register() == Register::RSP;
        let next = match instruction.mnemonic() {
            Mnemonic::Push => {
                let depth = depth + 8;
                let pushes_rbp = instruction.op0_kind() == OpKind::Register
                    && instruction.op0_register() == Register::RBP;
                let rbp = match rbp {
                    SavedRbp::InRegister if pushes_rbp => SavedRbp::Pushed(depth),
                    other => other,
                };
                Some((depth, rbp))
            }
            Mnemonic::Pop => {
                let pops_rbp = instruction.op0_kind() == OpKind::Register
                    && instruction.op0_register() == Register::RBP;
                let rbp = match rbp {
                    // The caller's rbp comes back from its slot.
                    SavedRbp::Pushed(at) if pops_rbp && at == depth => Some(SavedRbp::InRegister),
                    SavedRbp::InRegister if pops_rbp => None,
                    other => Some(other),
                };
                depth.checked_sub(8).zip(rbp)
            }
            Mnemonic::Sub if on_rsp => immediate().map(|n| (depth + n, rbp)),
            Mnemonic::Add if on_rsp => {
                immediate().and_then(|n| depth.checked_sub(n).map(|d| (d, rbp)))
            }
            _ if writes(Register::RSP) => None,
            _ => Some((depth, rbp)),
        };
        let Some((depth, rbp)) = next else {
            return FrameState::Unknown;
        };
        // Any other write to rbp loses the caller's value unless it was pushed.
        let pop_or_push = matches!(instruction.mnemonic(), Mnemonic::Push | Mnemonic::Pop);
        if !pop_or_push && rbp == SavedRbp::InRegister && writes(Register::RBP) {
            return FrameState::Unknown;
        }
        FrameState::Known { depth, rbp }
    }
}

/// How to unwind an entry's frame from one of its call sites: what a stack sampled in
/// the callee needs to step from that return address to the entry's caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallFrame {
    /// The call's return address (file virtual address).
    pub return_address: u64,
    /// Bytes the entry pushed or reserved before the call: with `sp` the stack pointer
    /// after the call returns, the entry's own return address is at `sp + depth`.
    pub depth: u32,
    /// The caller's `rbp`, if the entry pushed it: at `sp + depth - pushed_at`.
    pub rbp_pushed_at: Option<u32>,
}

impl CallFrame {
    /// The rule for a call at `state`, if the frame is known there.
    pub fn at(return_address: u64, state: FrameState) -> Option<CallFrame> {
        match state {
            FrameState::Known { depth, rbp } => Some(CallFrame {
                return_address,
                depth,
                rbp_pushed_at: match rbp {
                    SavedRbp::InRegister => None,
                    SavedRbp::Pushed(at) => Some(at),
                },
            }),
            FrameState::Unknown => None,
        }
    }

    /// Steps from this call site to the entry's caller: (return address, stack
    /// pointer, rbp) of the caller's frame, given the stack pointer and rbp at the
    /// call site and a reader of the copied stack.
    pub fn unwind(
        &self,
        sp: u64,
        rbp: u64,
        read: &mut impl FnMut(u64) -> Result<u64, ()>,
    ) -> Option<(u64, u64, u64)> {
        let slot = sp.checked_add(u64::from(self.depth))?;
        let return_address = read(slot).ok()?;
        let rbp = match self.rbp_pushed_at {
            None => rbp,
            Some(at) => read(slot.checked_sub(u64::from(at))?).ok()?,
        };
        Some((return_address, slot + 8, rbp))
    }
}

/// Instructions followed at most from an entry's first byte to its first call.
const MAX_STRAIGHT_LINE: usize = 32;

/// How far below a wrapper's stack pointer at entry its forward's stack pointer is at
/// the forward's entry, when the wrapper's code runs straight from its first byte to a
/// call that `is_forward` accepts: no branch, return or system call before it, and every
/// stack-pointer change followed. That is the bytes pushed or reserved before the call,
/// plus the return address the call pushes.
///
/// On every run of such a wrapper the forward is the first code it calls, so the first
/// probed entry the thread hits at exactly that stack pointer is the forward (a signal
/// handler runs below a signal frame, a deeper call below the forward's own frame): the
/// probe recognises the nested call by its stack pointer alone, without reading the
/// return address from user memory (a read per call).
pub fn straight_call_depth(
    code: &[u8],
    address: u64,
    is_forward: impl Fn(&Instruction) -> bool,
) -> Option<u32> {
    let mut decoder = Decoder::with_ip(64, code, address, DecoderOptions::NONE);
    let mut info = InstructionInfoFactory::new();
    let mut state = FrameState::ENTRY;
    for _ in 0..MAX_STRAIGHT_LINE {
        let instruction = super::next_instruction(&mut decoder)?;
        match instruction.flow_control() {
            FlowControl::Call => {
                let FrameState::Known { depth, .. } = state else {
                    return None;
                };
                return is_forward(&instruction).then_some(depth + 8);
            }
            FlowControl::Next => {}
            _ => return None,
        }
        let used = info.info(&instruction).used_registers();
        state = state.step(&instruction, |register| writes(used, register));
        if state == FrameState::Unknown {
            return None;
        }
    }
    None
}

/// Whether `used` (an instruction's register uses) writes `register` or part of it.
pub fn writes(used: &[UsedRegister], register: Register) -> bool {
    used.iter().any(|u| {
        u.register().full_register() == register
            && !matches!(u.access(), OpAccess::Read | OpAccess::CondRead)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The frame after running `code` straight through from the entry.
    fn after(code: &[u8]) -> FrameState {
        let mut decoder = Decoder::with_ip(64, code, 0x1000, DecoderOptions::NONE);
        let mut info = InstructionInfoFactory::new();
        let mut state = FrameState::ENTRY;
        for instruction in decoder.iter() {
            let used = info.info(&instruction).used_registers();
            state = state.step(&instruction, |r| writes(used, r));
        }
        state
    }

    #[test]
    fn musl_calloc_prologue() {
        // push %r12 ; mov %rsi,%r12 ; push %rbp ; push %rbx
        let state = after(&[0x41, 0x54, 0x49, 0x89, 0xf4, 0x55, 0x53]);
        assert_eq!(
            state,
            FrameState::Known {
                depth: 24,
                rbp: SavedRbp::Pushed(16)
            }
        );
        let frame = CallFrame::at(0x2000, state).unwrap();
        // Stack at the call site: rbx, rbp, r12, then the return address.
        let stack = [0xb0u64, 0xbbbb, 0x12, 0x4242];
        let base = 0x7000u64;
        let mut read = |a: u64| stack.get(((a - base) / 8) as usize).copied().ok_or(());
        assert_eq!(
            frame.unwind(base, 0x1, &mut read),
            Some((0x4242, base + 32, 0xbbbb))
        );
    }

    #[test]
    fn sub_add_and_pop_restore() {
        // push %rbp ; sub $0x18,%rsp ; add $0x18,%rsp ; pop %rbp
        assert_eq!(
            after(&[0x55, 0x48, 0x83, 0xec, 0x18, 0x48, 0x83, 0xc4, 0x18, 0x5d]),
            FrameState::ENTRY
        );
    }

    #[test]
    fn unfollowed_stack_or_rbp_changes_are_unknown() {
        // mov %rdi,%rsp
        assert_eq!(after(&[0x48, 0x89, 0xfc]), FrameState::Unknown);
        // mov %rdi,%rbp (caller's rbp not saved)
        assert_eq!(after(&[0x48, 0x89, 0xfd]), FrameState::Unknown);
        // push %rbp ; mov %rdi,%rbp: saved first, so still known.
        assert_eq!(
            after(&[0x55, 0x48, 0x89, 0xfd]),
            FrameState::Known {
                depth: 8,
                rbp: SavedRbp::Pushed(8)
            }
        );
        // and $-16,%rsp (realignment)
        assert_eq!(after(&[0x48, 0x83, 0xe4, 0xf0]), FrameState::Unknown);
    }

    #[test]
    fn a_straight_prologue_to_its_forward_gives_the_forward_depth() {
        // mimalloc's operator new(size, align_val_t): push %r12 ; mov %rdi,%r12 ;
        // push %rbp ; mov %rsi,%rbp ; push %rbx ; mov %rbp,%rsi ; mov %r12,%rdi ;
        // call <forward>
        let code = [
            0x41, 0x54, 0x49, 0x89, 0xfc, 0x55, 0x48, 0x89, 0xf5, 0x53, 0x48, 0x89, 0xee, 0x4c,
            0x89, 0xe7, 0xe8, 0x00, 0x00, 0x00, 0x00,
        ];
        assert_eq!(straight_call_depth(&code, 0x1000, |_| true), Some(32));
        // The same call, not to a forward.
        assert_eq!(straight_call_depth(&code, 0x1000, |_| false), None);
        // A branch before the call: the forward may not be the first code called.
        // test %rdi,%rdi ; je +0 ; call
        let branchy = [0x48, 0x85, 0xff, 0x74, 0x00, 0xe8, 0x00, 0x00, 0x00, 0x00];
        assert_eq!(straight_call_depth(&branchy, 0x1000, |_| true), None);
        // A stack realignment before the call: the depth is not known.
        // and $-16,%rsp ; call
        let aligned = [0x48, 0x83, 0xe4, 0xf0, 0xe8, 0x00, 0x00, 0x00, 0x00];
        assert_eq!(straight_call_depth(&aligned, 0x1000, |_| true), None);
    }
}
