//! Where to probe an entry: the first instruction the kernel emulates, and where the
//! entry's inputs are when it runs.
//!
//! A uprobe replaces an instruction with `int3`. On the hit the kernel either emulates
//! the original instruction or single-steps a copy of it out of line, which costs
//! far more (docs/benchmarks.md has the figures, from `../shared/docs/uprobe-costs.md`).
//! x86-64 Linux emulates (arch/x86/kernel/uprobes.c, `branch_setup_xol_ops` and
//! `push_setup_xol_ops`; costs measured on this kernel, docs/benchmarks.md):
//! - relative branches: `jmp rel8/rel32`, `jcc rel8/rel32`, `call rel32`, without an
//!   operand-size prefix;
//! - the one-byte `nop` (0x90) without prefixes;
//! - `push reg` (0x50-0x57, with REX.B for r8-r15 and no other prefix).
//!
//! Everything else (`test`, `cmp`, `mov`, rip-relative loads, multi-byte nops, `endbr64`)
//! is single-stepped. So the probe goes on the first emulated instruction of the entry,
//! provided every call reaches it (only straight-line code before it) and the inputs
//! can still be found there. The instructions before it are interpreted abstractly:
//! each register holds an entry argument, the product of two (a `mul`), or something
//! unknown. The search ends at the first write to the stack pointer: `[sp]` must still
//! hold the return address at the probe, for the program and for a return probe, which
//! the kernel arms by swapping `[sp]` (anywhere else it would clobber a local). The
//! probe is told, through its cookie, which register holds which input.
//! With no such instruction the probe goes on the entry's first byte, and that is said
//! at start with its cost.

use allocbpf_common::cookie::{Reg, MAX_INPUTS};
use iced_x86::{
    Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, Mnemonic, OpAccess,
    OpKind, Register, RflagsBits,
};

/// Instructions interpreted at most before giving up on finding an emulated one.
const MAX_INSTRUCTIONS: usize = 32;

/// Bytes of an entry decoded at most (32 instructions of at most 15 bytes).
pub const MAX_PROLOGUE_BYTES: usize = MAX_INSTRUCTIONS * 15;

/// What a probe reads: an entry argument, or the product of two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Input {
    /// Integer argument number `n` (0 = `rdi`).
    Arg(u8),
    /// Arguments `a * b` (`calloc`'s `nmemb * size`): two cookie inputs.
    Product(u8, u8),
}

impl Input {
    /// Cookie input slots this input takes.
    pub fn slots(self) -> usize {
        match self {
            Input::Arg(_) => 1,
            Input::Product(..) => 2,
        }
    }
}

/// The chosen probe point of one entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbePoint {
    /// Bytes from the entry's first byte to the probed instruction.
    pub offset: u64,
    /// Register codes of the cookie's input slots.
    pub registers: [Reg; MAX_INPUTS],
    /// A product was computed by the entry; its overflow is in the overflow flag.
    pub overflow_check: bool,
    /// The probed instruction, for logs (`ja 0x239b0`).
    pub instruction: String,
    /// True when the kernel emulates it; false: the entry's first byte, single-stepped.
    pub emulated: bool,
}

/// What a register holds, as far as the interpretation can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Value {
    Unknown,
    Arg(u8),
    Product(u8, u8),
}

/// The registers the cookie can name, with their iced-x86 names.
const REGISTERS: [(Register, Reg); 15] = [
    (Register::RDI, Reg::Rdi),
    (Register::RSI, Reg::Rsi),
    (Register::RDX, Reg::Rdx),
    (Register::RCX, Reg::Rcx),
    (Register::R8, Reg::R8),
    (Register::R9, Reg::R9),
    (Register::RAX, Reg::Rax),
    (Register::RBX, Reg::Rbx),
    (Register::RBP, Reg::Rbp),
    (Register::R10, Reg::R10),
    (Register::R11, Reg::R11),
    (Register::R12, Reg::R12),
    (Register::R13, Reg::R13),
    (Register::R14, Reg::R14),
    (Register::R15, Reg::R15),
];

/// The full registers `instruction` writes (or may write), as iced-x86 describes it.
pub(crate) fn written_registers(
    info: &mut InstructionInfoFactory,
    instruction: &Instruction,
) -> Vec<Register> {
    info.info(instruction)
        .used_registers()
        .iter()
        .filter(|used| {
            matches!(
                used.access(),
                OpAccess::Write
                    | OpAccess::CondWrite
                    | OpAccess::ReadWrite
                    | OpAccess::ReadCondWrite
            )
        })
        .map(|used| used.register().full_register())
        .collect()
}

/// The cookie's code of a general-purpose register (its full 64-bit register), if the
/// cookie can name it.
pub(crate) fn register_code(register: Register) -> Option<Reg> {
    let full = register.full_register();
    REGISTERS
        .iter()
        .find(|(r, _)| *r == full)
        .map(|(_, code)| *code)
}

/// The abstract machine state before an instruction.
#[derive(Clone, Debug)]
struct State {
    values: [Value; REGISTERS.len()],
    /// The product whose overflow the overflow flag holds, if any.
    overflow_of: Option<(u8, u8)>,
}

impl State {
    fn at_entry() -> State {
        let mut values = [Value::Unknown; REGISTERS.len()];
        for (n, value) in values.iter_mut().take(Reg::ARGUMENTS.len()).enumerate() {
            *value = Value::Arg(n as u8);
        }
        State {
            values,
            overflow_of: None,
        }
    }

    fn index(register: Register) -> Option<usize> {
        let full = register.full_register();
        REGISTERS.iter().position(|(r, _)| *r == full)
    }

    fn get(&self, register: Register) -> Value {
        Self::index(register).map_or(Value::Unknown, |i| self.values[i])
    }

    fn set(&mut self, register: Register, value: Value) {
        if let Some(i) = Self::index(register) {
            self.values[i] = value;
        }
    }

    /// The register holding `value`, preferring the entry's own argument registers.
    fn find(&self, value: Value) -> Option<Reg> {
        self.values
            .iter()
            .position(|v| *v == value)
            .map(|i| REGISTERS[i].1)
    }

    /// Where `inputs` are, in cookie slots, or `None` if one is lost.
    fn locate(&self, inputs: &[Input]) -> Option<([Reg; MAX_INPUTS], bool)> {
        let mut registers = [Reg::One; MAX_INPUTS];
        let mut slot = 0;
        let mut overflow_check = false;
        for input in inputs {
            match *input {
                Input::Arg(n) => {
                    registers[slot] = self.find(Value::Arg(n))?;
                }
                Input::Product(a, b) => {
                    if let (Some(x), Some(y)) = (self.find(Value::Arg(a)), self.find(Value::Arg(b)))
                    {
                        registers[slot] = x;
                        registers[slot + 1] = y;
                    } else {
                        // Multiplied already: usable only while the flag still says
                        // whether the product overflowed.
                        let product = self.find(Value::Product(a, b))?;
                        if self.overflow_of != Some((a, b)) {
                            return None;
                        }
                        registers[slot] = product;
                        registers[slot + 1] = Reg::One;
                        overflow_check = true;
                    }
                }
            }
            slot += input.slots();
        }
        Some((registers, overflow_check))
    }

    /// Applies a straight-line instruction; `None` if its effect cannot be followed.
    fn step(&mut self, instruction: &Instruction, info: &mut InstructionInfoFactory) -> Option<()> {
        let writes_of = instruction.rflags_modified() & RflagsBits::OF != 0;
        match instruction.mnemonic() {
            Mnemonic::Mov
                if instruction.op0_kind() == OpKind::Register
                    && instruction.op1_kind() == OpKind::Register
                    && instruction.op0_register().is_gpr64()
                    && instruction.op1_register().is_gpr64() =>
            {
                if instruction.op0_register() == Register::RSP {
                    return None;
                }
                let value = self.get(instruction.op1_register());
                self.set(instruction.op0_register(), value);
                return Some(());
            }
            // Unsigned rdx:rax = rax * r64.
            Mnemonic::Mul
                if instruction.op0_kind() == OpKind::Register
                    && instruction.op0_register().is_gpr64() =>
            {
                let product = match (
                    self.get(Register::RAX),
                    self.get(instruction.op0_register()),
                ) {
                    (Value::Arg(a), Value::Arg(b)) => Value::Product(a.min(b), a.max(b)),
                    _ => Value::Unknown,
                };
                self.set(Register::RAX, product);
                self.set(Register::RDX, Value::Unknown);
                self.overflow_of = match product {
                    Value::Product(a, b) => Some((a, b)),
                    _ => None,
                };
                return Some(());
            }
            _ => {}
        }
        if writes_of {
            self.overflow_of = None;
        }
        let written: Vec<Register> = info
            .info(instruction)
            .used_registers()
            .iter()
            .filter(|used| {
                !matches!(
                    used.access(),
                    OpAccess::Read | OpAccess::CondRead | OpAccess::NoMemAccess
                )
            })
            .map(|used| used.register())
            .collect();
        for register in written {
            if register.full_register() == Register::RSP {
                return None;
            }
            self.set(register, Value::Unknown);
        }
        Some(())
    }
}

/// True for an instruction x86-64 Linux emulates on a uprobe hit (see the module doc).
pub fn is_emulated(instruction: &Instruction, bytes: &[u8]) -> bool {
    let Some(&first) = bytes.first() else {
        return false;
    };
    let relative_branch = instruction.is_jcc_short_or_near()
        || instruction.is_jmp_short_or_near()
        || instruction.is_call_near();
    // The kernel refuses operand-size overrides on branches; take no prefix at all.
    let opcode_first = matches!(first, 0xe8 | 0xe9 | 0xeb | 0x70..=0x7f | 0x0f);
    if relative_branch && opcode_first {
        return true;
    }
    matches!(bytes, [0x90] | [0x50..=0x57] | [0x41, 0x50..=0x57])
}

/// Chooses the probe point in an entry's `code` (starting at address `ip`) for a
/// function whose probe reads `inputs`. Always returns a point: the entry's first
/// byte when no emulated instruction can be used (`emulated` is then false unless
/// that first instruction is itself emulated).
pub fn choose(code: &[u8], ip: u64, inputs: &[Input]) -> ProbePoint {
    debug_assert!(inputs.iter().map(|i| i.slots()).sum::<usize>() <= MAX_INPUTS);
    let mut decoder = Decoder::with_ip(64, code, ip, DecoderOptions::NONE);
    let mut info = InstructionInfoFactory::new();
    let mut state = State::at_entry();
    let mut first: Option<(String, bool)> = None;
    for _ in 0..MAX_INSTRUCTIONS {
        let Some(instruction) = super::next_instruction(&mut decoder) else {
            break;
        };
        let offset = instruction.ip() - ip;
        let start = offset as usize;
        let bytes = &code[start..start + instruction.len()];
        let emulated = is_emulated(&instruction, bytes);
        if first.is_none() {
            first = Some((instruction.to_string(), emulated));
        }
        if emulated && offset <= u8::MAX as u64 {
            if let Some((registers, overflow_check)) = state.locate(inputs) {
                return ProbePoint {
                    offset,
                    registers,
                    overflow_check,
                    instruction: instruction.to_string(),
                    emulated: true,
                };
            }
        }
        if instruction.flow_control() != FlowControl::Next
            || state.step(&instruction, &mut info).is_none()
        {
            break;
        }
    }
    let (instruction, emulated) = first.unwrap_or_else(|| ("(undecodable)".to_string(), false));
    at_entry(instruction, emulated, inputs)
}

/// The probe point on the entry's first byte, where every input is in its argument
/// register.
fn at_entry(instruction: String, emulated: bool, inputs: &[Input]) -> ProbePoint {
    let (registers, _) = State::at_entry()
        .locate(inputs)
        .expect("every input is in its argument register at entry");
    ProbePoint {
        offset: 0,
        registers,
        overflow_check: false,
        instruction,
        emulated,
    }
}

/// Environment variable that makes every probe sit on its entry's first byte, as
/// before probe points were chosen: `cargo xtask bench` measures that cost with it.
/// Not for production use.
pub const AT_ENTRY_VARIABLE: &str = "ALLOCBPF_BENCH_PROBE_AT_ENTRY";

/// [`choose`], or the entry's first byte when [`AT_ENTRY_VARIABLE`] is set.
pub fn choose_for_run(code: &[u8], ip: u64, inputs: &[Input]) -> ProbePoint {
    if std::env::var_os(AT_ENTRY_VARIABLE).is_none() {
        return choose(code, ip, inputs);
    }
    let mut decoder = Decoder::with_ip(64, code, ip, DecoderOptions::NONE);
    let instruction = decoder.decode();
    let emulated = !instruction.is_invalid()
        && is_emulated(&instruction, &code[..instruction.len().min(code.len())]);
    at_entry(instruction.to_string(), emulated, inputs)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIZE: &[Input] = &[Input::Arg(0)];

    #[test]
    fn glibc_malloc_is_probed_at_its_push() {
        // push %r12 ; push %rbp
        let point = choose(&[0x41, 0x54, 0x55], 0x1000, SIZE);
        assert_eq!((point.offset, point.emulated), (0, true));
        assert_eq!(point.registers[0], Reg::Rdi);
    }

    #[test]
    fn jemalloc_malloc_is_probed_at_the_ja_after_its_cmp() {
        // cmp $0x1000,%rdi ; ja +0x93
        let code = [
            0x48, 0x81, 0xff, 0x00, 0x10, 0x00, 0x00, 0x0f, 0x87, 0x93, 0, 0, 0,
        ];
        let point = choose(&code, 0x23910, SIZE);
        assert_eq!((point.offset, point.emulated), (7, true));
        assert!(point.instruction.starts_with("ja"), "{point:?}");
        assert_eq!(point.registers[0], Reg::Rdi);
    }

    #[test]
    fn glibc_free_is_probed_at_its_je() {
        // test %rdi,%rdi ; je +0x40 ; push %rbp
        let point = choose(&[0x48, 0x85, 0xff, 0x74, 0x40, 0x55], 0x1000, SIZE);
        assert_eq!(point.offset, 3);
        assert!(point.instruction.starts_with("je"), "{point:?}");
    }

    #[test]
    fn a_moved_argument_is_followed_to_its_new_register() {
        // mov %rdi,%rbx ; mov %rsi,%rdi ; push %rbp
        let code = [0x48, 0x89, 0xfb, 0x48, 0x89, 0xf7, 0x55];
        let point = choose(&code, 0, SIZE);
        assert_eq!((point.offset, point.emulated), (6, true));
        assert_eq!(point.registers[0], Reg::Rbx);
    }

    #[test]
    fn a_lost_argument_falls_back_to_the_entry() {
        // xor %edi,%edi ; push %rbp
        let point = choose(&[0x31, 0xff, 0x55], 0, SIZE);
        assert_eq!((point.offset, point.emulated), (0, false));
        assert_eq!(point.registers[0], Reg::Rdi);
        assert!(point.instruction.starts_with("xor"), "{point:?}");
    }

    #[test]
    fn glibc_reallocarray_is_probed_after_its_mul_with_the_overflow_flag() {
        // mov %rsi,%rax ; mul %rdx ; mov %rax,%rsi ; jo +5 ; jmp realloc
        let code = [
            0x48, 0x89, 0xf0, 0x48, 0xf7, 0xe2, 0x48, 0x89, 0xc6, 0x70, 0x05, 0xe9, 0, 0, 0, 0,
        ];
        let point = choose(&code, 0x9a7e0, &[Input::Arg(0), Input::Product(1, 2)]);
        assert_eq!((point.offset, point.emulated), (9, true));
        assert!(point.overflow_check);
        assert_eq!(point.registers[0], Reg::Rdi);
        // The product is in rsi (copied from rax); the second factor is the constant 1.
        assert!(
            matches!(point.registers[1], Reg::Rsi | Reg::Rax),
            "{point:?}"
        );
        assert_eq!(point.registers[2], Reg::One);
    }

    #[test]
    fn a_flag_clobbered_after_the_mul_makes_the_product_unusable() {
        // mov %rdi,%rax ; mul %rsi ; test %rsi,%rsi ; je
        let code = [
            0x48, 0x89, 0xf8, 0x48, 0xf7, 0xe6, 0x48, 0x85, 0xf6, 0x74, 0x00,
        ];
        let point = choose(&code, 0, &[Input::Product(0, 1)]);
        // rdi and rsi themselves are intact: the probe multiplies them itself.
        assert_eq!(
            (point.offset, point.emulated, point.overflow_check),
            (9, true, false)
        );
        assert_eq!(&point.registers[..2], &[Reg::Rdi, Reg::Rsi]);
    }

    #[test]
    fn a_stack_pointer_move_ends_the_search() {
        // sub $0x18,%rsp ; mov %rdi,(%rsp) ; call rel32: [sp] is no longer the return
        // address at the call, so the entry itself is probed.
        let code = [
            0x48, 0x83, 0xec, 0x18, 0x48, 0x89, 0x3c, 0x24, 0xe8, 0, 0, 0, 0,
        ];
        let point = choose(&code, 0, SIZE);
        assert_eq!((point.offset, point.emulated), (0, false));
    }

    #[test]
    fn branches_before_the_point_stop_the_search() {
        // cmp ; jne is the point itself, never skipped over
        let code = [0x48, 0x83, 0xff, 0x00, 0x75, 0x02, 0x55];
        assert_eq!(choose(&code, 0, SIZE).offset, 4);
        // ret first: nothing emulated reachable
        let point = choose(&[0xc3, 0x55], 0, SIZE);
        assert_eq!((point.offset, point.emulated), (0, false));
    }

    #[test]
    fn prefixed_branches_and_long_nops_are_not_emulated() {
        // 66 90 (xchg %ax,%ax), 0f 1f 00 (nopl): single-stepped, so pass over them
        let code = [0x66, 0x90, 0x0f, 0x1f, 0x00, 0x90];
        let point = choose(&code, 0, SIZE);
        assert_eq!((point.offset, point.emulated), (5, true));
    }
}
