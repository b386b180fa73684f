//! What an inlined allocation site allocates: read from the first instructions of its
//! inlined path (a register holding the size, or a constant size class), and for a
//! constant class, the exact request from the path a hooked allocator takes.

use allocbpf_common::cookie::Reg;
use iced_x86::{
    Code, Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, Mnemonic,
    OpKind, Register,
};

use super::{load_offset, point, Usedpools, SIZE_CLASS_BYTES, USEDPOOLS_BYTES};

/// Instructions of an inlined path read at most for its size (3.13 loads its
/// allocator state first, and may set up constants for a shared tail).
const MAX_PATH_INSTRUCTIONS: usize = 12;

/// Bytes of an inlined path decoded at most from one place.
pub(super) const MAX_PATH_BYTES: usize = MAX_PATH_INSTRUCTIONS * 15;

/// Unconditional jumps followed at most on a path (a path moved out of line, a tail
/// shared by several sites).
const MAX_PATH_JUMPS: usize = 2;

/// Where the inlined path at `ip` (in the text section `data` at `base`) has its size
/// at its start: a register (times 1), or a constant size class (`Reg::One` times its
/// bytes). Read from its first instructions, through unconditional jumps, up to any
/// other branch: the size-class computation `lea -1(%R)` or the small-request check
/// `cmp $0x200, %R` (`R` untouched until then, so it held the size at the branch; a
/// check against 0x1ff is of the size less one, computed earlier, and tells nothing
/// here), or a load of one `usedpools` entry: at a constant place, or indexed by a
/// register the path set to a constant (a constant size).
pub(super) fn size_of_path(
    data: &[u8],
    base: u64,
    ip: u64,
    usedpools: Usedpools,
) -> Option<(Reg, u64)> {
    let code_at = |ip: u64| {
        let start = ip.checked_sub(base)? as usize;
        data.get(start..(start + MAX_PATH_BYTES).min(data.len()))
    };
    let mut decoder = Decoder::with_ip(64, code_at(ip)?, ip, DecoderOptions::NONE);
    let mut info = InstructionInfoFactory::new();
    let mut registers = PathRegisters::default();
    let mut jumps = 0;
    for _ in 0..MAX_PATH_INSTRUCTIONS {
        let instruction = crate::image::next_instruction(&mut decoder)?;
        let untouched = |register: Register| registers.untouched(register);
        let constant = |register: Register| registers.constant(register);
        match instruction.mnemonic() {
            // lea -1(%R), ...: the size class computation, of the size in R, or of a
            // constant the path put in R (the request itself).
            Mnemonic::Lea
                if instruction.memory_index() == Register::None
                    && instruction.memory_displacement64() as i64 == -1 =>
            {
                let register = instruction.memory_base();
                if let Some(size) = constant(register) {
                    return Some((Reg::One, size));
                }
                if untouched(register) {
                    return Some((point::register_code(register)?, 1));
                }
            }
            // sub $1, %R of a constant the path put in R: the same computation.
            Mnemonic::Sub
                if instruction.op0_kind() == OpKind::Register
                    && matches!(
                        instruction.op1_kind(),
                        OpKind::Immediate8to32 | OpKind::Immediate8to64 | OpKind::Immediate32
                    )
                    && instruction.immediate(1) == 1 =>
            {
                if let Some(size) = constant(instruction.op0_register()) {
                    return Some((Reg::One, size));
                }
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
                let (states, constants) = (&registers.states, &registers.constants);
                if let Some(bytes) = constant_class(&instruction, usedpools, states, constants) {
                    return Some((Reg::One, bytes));
                }
            }
            _ => {}
        }
        let loaded_state = loaded_state(&instruction, usedpools);
        match instruction.flow_control() {
            FlowControl::Next => {}
            FlowControl::UnconditionalBranch
                if instruction.is_jmp_short_or_near() && jumps < MAX_PATH_JUMPS =>
            {
                jumps += 1;
                let target = instruction.near_branch_target();
                decoder = Decoder::with_ip(64, code_at(target)?, target, DecoderOptions::NONE);
                continue;
            }
            _ => return None,
        }
        registers.record(&mut info, &instruction, loaded_state);
    }
    None
}

/// What the instructions of an inlined path read so far did to the registers: what
/// they tell of its size depends on whether a register still holds what it held at the
/// path's start, or a value the path put there.
#[derive(Default)]
struct PathRegisters {
    /// Registers written.
    written: Vec<Register>,
    /// Registers holding the allocator state's address (3.13).
    states: Vec<Register>,
    /// Registers the path set to a constant.
    constants: Vec<(Register, u64)>,
}

impl PathRegisters {
    /// Whether `register` still holds what it held at the path's start.
    fn untouched(&self, register: Register) -> bool {
        super::untouched(register, &self.written)
    }

    /// The constant the path put in `register`, if a small request can be of it.
    fn constant(&self, register: Register) -> Option<u64> {
        self.constants
            .iter()
            .find(|(r, _)| *r == register.full_register())
            .map(|(_, v)| *v)
            .filter(|v| (1..=allocbpf_common::PYMALLOC_SMALL_MAX).contains(v))
    }

    /// Records what `instruction` wrote: registers it wrote hold neither the state nor
    /// a constant any more, unless it loaded the state into one (`loaded_state`) or
    /// moved a constant into one.
    fn record(
        &mut self,
        info: &mut InstructionInfoFactory,
        instruction: &Instruction,
        loaded_state: Option<Register>,
    ) {
        let now_written = point::written_registers(info, instruction);
        self.states.retain(|r| !now_written.contains(r));
        self.constants.retain(|(r, _)| !now_written.contains(r));
        self.written.extend(now_written);
        self.states.extend(loaded_state);
        if let Some(value) = immediate_move(instruction) {
            self.constants
                .push((instruction.op0_register().full_register(), value));
        }
    }
}

/// The register `instruction` loads the allocator state's address into, if it does
/// (3.13, whose `usedpools` are in that state).
fn loaded_state(instruction: &Instruction, usedpools: Usedpools) -> Option<Register> {
    match (usedpools, load_offset(instruction)) {
        (Usedpools::InState { state, .. }, Some(offset)) if offset == state => {
            Some(instruction.op0_register())
        }
        _ => None,
    }
}

/// For `mov $imm, %reg` (32 or 64 bits, zero- or sign-extended into the full
/// register): the value the full register holds.
fn immediate_move(instruction: &Instruction) -> Option<u64> {
    match instruction.code() {
        Code::Mov_r32_imm32 => Some(u64::from(instruction.immediate32())),
        Code::Mov_r64_imm64 => Some(instruction.immediate64()),
        Code::Mov_rm64_imm32 if instruction.op0_kind() == OpKind::Register => {
            Some(instruction.immediate32to64() as u64)
        }
        _ => None,
    }
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
/// a constant place: a fixed address, or an offset of a register holding the state,
/// plus an index register the path set to a constant (`constants`), times 8.
fn constant_class(
    load: &Instruction,
    usedpools: Usedpools,
    states: &[Register],
    constants: &[(Register, u64)],
) -> Option<u64> {
    let index = match load.memory_index() {
        Register::None => 0,
        index if load.memory_index_scale() == 8 => constants
            .iter()
            .find(|(r, _)| *r == index.full_register())?
            .1
            .checked_mul(8)?,
        _ => return None,
    };
    let offset = match usedpools {
        Usedpools::At(address) => {
            let at = if load.is_ip_rel_memory_operand() {
                load.ip_rel_memory_address()
            } else if load.memory_base() == Register::None {
                load.memory_displacement64()
            } else {
                return None;
            };
            at.checked_sub(address)?
        }
        Usedpools::InState { usedpools, .. } => {
            if !states.contains(&load.memory_base().full_register()) {
                return None;
            }
            load.memory_displacement64().checked_sub(usedpools)?
        }
    }
    .checked_add(index)?;
    let bytes = SIZE_CLASS_BYTES * (offset / SIZE_CLASS_BYTES + 1);
    (offset < USEDPOOLS_BYTES
        && offset % SIZE_CLASS_BYTES == 0
        && bytes <= allocbpf_common::PYMALLOC_SMALL_MAX)
        .then_some(bytes)
}
