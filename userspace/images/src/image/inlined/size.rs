//! What an inlined allocation site allocates: read from the first instructions of its
//! inlined path (a register holding the size, or a constant size class), and for a
//! constant class, the exact request from the path a hooked allocator takes.

use allocbpf_common::cookie::Reg;
use iced_x86::{
    Code, Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, Mnemonic,
    OpKind, Register,
};

use super::{load_offset, point, Usedpools, SIZE_CLASS_BYTES, USEDPOOLS_BYTES};

/// Instructions of an inlined path read at most for its size.
const MAX_PATH_INSTRUCTIONS: usize = 8;

/// Bytes of an inlined path decoded at most.
pub(super) const MAX_PATH_BYTES: usize = MAX_PATH_INSTRUCTIONS * 15;

/// Where the inlined path `code` (at `ip`) has its size at its start: a register
/// (times 1), or a constant size class (`Reg::One` times its bytes). Read from its
/// first instructions up to a branch: the size-class computation `lea -1(%R)` or the
/// small-request check `cmp $0x200, %R` (`R` untouched until then, so it held the size
/// at the branch; a check against 0x1ff is of the size less one, computed earlier, and
/// tells nothing here
/// ), or a load of one `usedpools` entry (a constant size).
pub(super) fn size_of_path(code: &[u8], ip: u64, usedpools: Usedpools) -> Option<(Reg, u64)> {
    let mut decoder = Decoder::with_ip(64, code, ip, DecoderOptions::NONE);
    let mut info = InstructionInfoFactory::new();
    let mut written: Vec<Register> = Vec::new();
    // Registers holding the allocator state's address (3.13).
    let mut states: Vec<Register> = Vec::new();
    for _ in 0..MAX_PATH_INSTRUCTIONS {
        if !decoder.can_decode() {
            return None;
        }
        let instruction = decoder.decode();
        if instruction.is_invalid() {
            return None;
        }
        let untouched = |register: Register| {
            register.is_gpr64() && register != Register::RSP && !written.contains(&register)
        };
        match instruction.mnemonic() {
            // lea -1(%R), ...: the size class computation.
            Mnemonic::Lea
                if instruction.memory_index() == Register::None
                    && untouched(instruction.memory_base())
                    && instruction.memory_displacement64() as i64 == -1 =>
            {
                return Some((point::register_code(instruction.memory_base())?, 1));
            }
            // cmp $0x200, %R: the small-request check.
            Mnemonic::Cmp
                if instruction.op0_kind() == OpKind::Register
                    && untouched(instruction.op0_register())
                    && matches!(
                        instruction.op1_kind(),
                        OpKind::Immediate32to64 | OpKind::Immediate8to64
                    )
                    && instruction.immediate(1) == 0x200 =>
            {
                return Some((point::register_code(instruction.op0_register())?, 1));
            }
            Mnemonic::Mov if instruction.code() == Code::Mov_r64_rm64 => {
                if let Some(bytes) = constant_class(&instruction, usedpools, &states) {
                    return Some((Reg::One, bytes));
                }
            }
            _ => {}
        }
        let loaded_state = match (usedpools, load_offset(&instruction)) {
            (Usedpools::InState { state, .. }, Some(offset)) if offset == state => {
                Some(instruction.op0_register())
            }
            _ => None,
        };
        if instruction.flow_control() != FlowControl::Next {
            return None;
        }
        let now_written = point::written_registers(&mut info, &instruction);
        states.retain(|r| !now_written.contains(r));
        written.extend(now_written);
        states.extend(loaded_state);
    }
    None
}

/// True if a request of `bytes` is served from the size class of `class_bytes`.
pub(super) fn in_class(bytes: u64, class_bytes: u64) -> bool {
    bytes > class_bytes.saturating_sub(SIZE_CLASS_BYTES) && bytes <= class_bytes
}

/// Instructions of a hooked path read at most for its constant request.
const MAX_HOOKED_INSTRUCTIONS: usize = 8;

/// The constant size the hooked path `code` (at `ip`, in the section `data` at
/// `base`) passes to the domain's allocator: the value `%rsi` holds at its first
/// indirect call, set by `mov $imm` (directly or through another register) on its
/// straight-line path; one unconditional jump is followed.
pub(super) fn constant_request(code: &[u8], ip: u64, data: &[u8], base: u64) -> Option<u64> {
    let mut decoder = Decoder::with_ip(64, code, ip, DecoderOptions::NONE);
    let mut info = InstructionInfoFactory::new();
    let mut constants: Vec<(Register, u64)> = Vec::new();
    let mut jumped = false;
    for _ in 0..MAX_HOOKED_INSTRUCTIONS {
        let instruction = decoder.decode();
        if instruction.is_invalid() {
            return None;
        }
        match instruction.flow_control() {
            FlowControl::IndirectCall => {
                return constants
                    .iter()
                    .find(|(r, _)| *r == Register::RSI)
                    .map(|(_, v)| *v);
            }
            FlowControl::UnconditionalBranch if !jumped && instruction.is_jmp_short_or_near() => {
                jumped = true;
                let target = instruction.near_branch_target();
                let start = target.checked_sub(base)? as usize;
                decoder = Decoder::with_ip(64, data.get(start..)?, target, DecoderOptions::NONE);
                continue;
            }
            FlowControl::Next => {}
            _ => return None,
        }
        let value = match (instruction.mnemonic(), instruction.op1_kind()) {
            (
                Mnemonic::Mov,
                OpKind::Immediate32 | OpKind::Immediate32to64 | OpKind::Immediate64,
            ) => Some(instruction.immediate(1)),
            (Mnemonic::Mov, OpKind::Register) => constants
                .iter()
                .find(|(r, _)| *r == instruction.op1_register().full_register())
                .map(|(_, v)| *v),
            _ => None,
        };
        let written = point::written_registers(&mut info, &instruction);
        constants.retain(|(r, _)| !written.contains(r));
        if let (Some(value), OpKind::Register) = (value, instruction.op0_kind()) {
            constants.push((instruction.op0_register().full_register(), value));
        }
    }
    None
}

/// The bytes of the size class whose `usedpools` entry `load` reads, if it reads one at
/// a constant place: a fixed address, or an offset of a register holding the state.
fn constant_class(load: &Instruction, usedpools: Usedpools, states: &[Register]) -> Option<u64> {
    let offset = match usedpools {
        Usedpools::At(address) => {
            let at = if load.is_ip_rel_memory_operand() {
                load.ip_rel_memory_address()
            } else if load.memory_base() == Register::None && load.memory_index() == Register::None
            {
                load.memory_displacement64()
            } else {
                return None;
            };
            at.checked_sub(address)?
        }
        Usedpools::InState { usedpools, .. } => {
            if load.memory_index() != Register::None
                || !states.contains(&load.memory_base().full_register())
            {
                return None;
            }
            load.memory_displacement64().checked_sub(usedpools)?
        }
    };
    let bytes = SIZE_CLASS_BYTES * (offset / SIZE_CLASS_BYTES + 1);
    (offset < USEDPOOLS_BYTES
        && offset % SIZE_CLASS_BYTES == 0
        && bytes <= allocbpf_common::PYMALLOC_SMALL_MAX)
        .then_some(bytes)
}
