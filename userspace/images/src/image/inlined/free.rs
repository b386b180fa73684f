//! CPython's small-object deallocator where the compiler inlined it into its callers.
//!
//! An inlined `PyObject_Free` starts as an inlined `PyObject_Malloc` does: the domain's
//! deallocator pointer is compared with the default one (`_PyObject_Free`), and a
//! `jne`/`je` takes the inlined pymalloc path when they match. Whichever way it goes,
//! the block dies there, so the site retires a tracked block without looking at the
//! flags; the block is in the register the inlined path computes its pool from
//! (`and $-POOL_SIZE`) or its arena-map key from (`shr $49`), directly or through a
//! copy made before anything wrote it.

use allocbpf_common::{cookie::Reg, AllocFn, Shape};
use iced_x86::{
    Code, Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, Mnemonic,
    OpKind, Register,
};
use object::{Object, ObjectSymbol};

use super::{code_at, compared_default, exported_code, point, point::Input, ProbedEntry, Site};

/// Instructions of an inlined deallocation path read at most for its block's register
/// (3.13 loads its allocator state before it computes the pool).
const MAX_FREE_PATH_INSTRUCTIONS: usize = 16;

/// Bytes of an inlined deallocation path decoded at most.
const MAX_FREE_PATH_BYTES: usize = MAX_FREE_PATH_INSTRUCTIONS * 15;

/// Bytes of `PyObject_Free` decoded at most for its comparison.
const MAX_ENTRY_BYTES: usize = 256;

/// pymalloc's pool sizes (`POOL_ADDR` masks the block's address with the negated size):
/// 4 KiB up to 3.9, 16 KiB from 3.10 on 64-bit builds.
const POOL_MASKS: [i64; 2] = [-4096, -16384];

/// `ARENA_BITS`-based shift of the arena map's top level (3.10+, 48-bit addresses).
const ARENA_MAP_TOP_SHIFT: u64 = 49;

/// `_PyObject_Free`'s address: what the exported `PyObject_Free` compares its domain's
/// pointer with, when it has the inlined deallocator (and that is code of this image,
/// `_PyObject_Free` itself where the symbol table names it).
pub(super) fn default_free(file: &object::File) -> Option<u64> {
    let (address, code) = exported_code(file, "PyObject_Free", MAX_ENTRY_BYTES)?;
    let default = compared_default(code, address)?;
    code_at(file, default, 1)?;
    let named = file
        .symbols()
        .find(|s| s.name() == Ok("_PyObject_Free"))
        .map(|s| s.address());
    named.is_none_or(|a| a == default).then_some(default)
}

/// What the inlined path after a comparison with the default deallocator frees.
pub(super) enum Freed {
    /// The block in a register at a probe point.
    Site(ProbedEntry),
    /// Nothing: the compiler knew the pointer is null there (the path returns first).
    Nothing,
    /// A path this module does not read.
    Unknown,
}

/// What the branch `jump` to an inlined `PyObject_Free` frees: a site probed at the
/// branch when its path shows the register holding the block (or at the path's first
/// conditional branch where the block was loaded into a register on the path).
pub(super) fn site(file: &object::File, data: &[u8], base: u64, jump: &Instruction) -> Freed {
    let path = match jump.mnemonic() {
        Mnemonic::Jne => jump.next_ip(),
        _ => jump.near_branch_target(),
    };
    let (register, at) = match freed_register(data, base, path) {
        Path::Block(register, at) => (register, at),
        Path::Returns => return Freed::Nothing,
        Path::Unknown => return Freed::Unknown,
    };
    let site = Site {
        symbol: "PyObject_Free",
        function: AllocFn::Free,
        shape: Shape::Free,
        register,
        size: 0,
    };
    match site.at(file, data, base, at.as_ref().unwrap_or(jump)) {
        Some(entry) => Freed::Site(entry),
        None => Freed::Unknown,
    }
}

/// `_PyObject_Free` itself, probed as a deallocation entry (block in its second
/// argument) at an emulated instruction: blocks freed by a direct call (an inlined
/// `PyObject_Realloc` that moved its block) or through a hook that chains to it pass no
/// inlined site. `None` where it is probed already (`frees`) or has no emulated point.
pub(super) fn default_free_entry(
    file: &object::File,
    default: u64,
    frees: &[ProbedEntry],
) -> Option<ProbedEntry> {
    if frees.iter().any(|e| e.address == default) {
        return None;
    }
    let code = code_at(file, default, point::MAX_PROLOGUE_BYTES)?;
    let point = point::choose(code, default, &[Input::Arg(1)]);
    if !point.emulated {
        return None;
    }
    let site = Site {
        symbol: "_PyObject_Free",
        function: AllocFn::Free,
        shape: Shape::Free,
        register: Reg::One,
        size: 0,
    };
    site.entry(
        file,
        format!("_PyObject_Free ({default:#x})"),
        default,
        point,
    )
}

/// Jumps followed at most in one path (a path moved out of line, a null check that
/// branches to the non-null side).
const MAX_FOLLOWED_JUMPS: usize = 3;

/// What [`freed_register`] read of a path.
#[derive(Debug, PartialEq, Eq)]
enum Path {
    /// The block is in this register at the branch (`None`), or at this later
    /// conditional branch of the path.
    Block(Reg, Option<Instruction>),
    /// The path returns before it touches a block.
    Returns,
    /// Not read.
    Unknown,
}

/// Where the freed block is on the inlined path at `ip` (in the text section `data` at
/// `base`): the register masked to its pool or shifted to its arena-map key, itself or
/// a copy of it. If it held its value since the path's start, the block is in it at
/// the branch; if the path loaded it (from a spill slot), at the path's next
/// conditional branch that it reaches unchanged. Unconditional jumps are followed, and
/// a `jne` after a null check of an untouched register (`test %R,%R`) to its target,
/// the non-null side; other conditional branches are read through; a return is a path
/// that frees nothing; any other control flow ends the search.
fn freed_register(data: &[u8], base: u64, ip: u64) -> Path {
    freed_register_in(data, base, ip).unwrap_or(Path::Unknown)
}

fn freed_register_in(data: &[u8], base: u64, ip: u64) -> Option<Path> {
    let mut decoder = Decoder::with_ip(64, path_code(data, base, ip)?, ip, DecoderOptions::NONE);
    let mut info = InstructionInfoFactory::new();
    // Registers written on the path so far.
    let mut written: Vec<Register> = Vec::new();
    // (copy, original, original written before the copy) for `mov %original, %copy`.
    let mut copies: Vec<(Register, Register, bool)> = Vec::new();
    // A block loaded on the path: its register, waiting for a conditional branch.
    let mut loaded: Option<Register> = None;
    let mut jumps = 0;
    let mut previous = Instruction::default();
    for _ in 0..MAX_FREE_PATH_INSTRUCTIONS {
        let instruction = crate::image::next_instruction(&mut decoder)?;
        let untouched = |register: Register| super::untouched(register, &written);
        if let Some(register) = loaded {
            if instruction.flow_control() == FlowControl::ConditionalBranch {
                return Some(Path::Block(
                    point::register_code(register)?,
                    Some(instruction),
                ));
            }
        } else if reads_block(&instruction) {
            let target = instruction.op0_register();
            let (origin, loaded_first) = match copies.iter().find(|(copy, ..)| *copy == target) {
                Some(&(_, original, written_first)) => (original, written_first),
                None => (target, !untouched(target)),
            };
            if !loaded_first {
                return Some(Path::Block(point::register_code(origin)?, None));
            }
            if origin == Register::RSP || !origin.is_gpr64() {
                return None;
            }
            loaded = Some(origin);
        }
        let null_checked = previous.mnemonic() == Mnemonic::Test
            && previous.op0_kind() == OpKind::Register
            && previous.op1_kind() == OpKind::Register
            && previous.op0_register() == previous.op1_register()
            && untouched(previous.op0_register());
        let follow = match instruction.flow_control() {
            FlowControl::UnconditionalBranch if instruction.is_jmp_short_or_near() => true,
            FlowControl::ConditionalBranch => {
                loaded.is_none() && null_checked && instruction.mnemonic() == Mnemonic::Jne
            }
            FlowControl::Next => false,
            FlowControl::Return if loaded.is_none() => return Some(Path::Returns),
            _ => return None,
        };
        if follow {
            jumps += 1;
            if jumps > MAX_FOLLOWED_JUMPS {
                return None;
            }
            let target = instruction.near_branch_target();
            decoder = Decoder::with_ip(
                64,
                path_code(data, base, target)?,
                target,
                DecoderOptions::NONE,
            );
            previous = instruction;
            continue;
        }
        let now_written = point::written_registers(&mut info, &instruction);
        if loaded.is_some_and(|r| now_written.contains(&r)) {
            // The loaded block was overwritten before a branch: not read here.
            return None;
        }
        copies.retain(|(copy, ..)| !now_written.contains(copy));
        if instruction.code() == Code::Mov_rm64_r64 || instruction.code() == Code::Mov_r64_rm64 {
            let (copy, original) = (instruction.op0_register(), instruction.op1_register());
            if instruction.op0_kind() == OpKind::Register
                && instruction.op1_kind() == OpKind::Register
                && original.is_gpr64()
            {
                copies.push((copy, original, !untouched(original)));
            }
        }
        written.extend(now_written);
        previous = instruction;
    }
    None
}

/// The code of the text section `data` (at `base`) from `ip`, as much as a path reads.
fn path_code(data: &[u8], base: u64, ip: u64) -> Option<&[u8]> {
    let start = ip.checked_sub(base)? as usize;
    data.get(start..(start + MAX_FREE_PATH_BYTES).min(data.len()))
}

/// True for `and $-POOL_SIZE, %r64` and `shr $49, %r64`: what the inlined path does
/// first with (a copy of) the block's address.
fn reads_block(instruction: &Instruction) -> bool {
    if instruction.op0_kind() != OpKind::Register
        || !instruction.op0_register().is_gpr64()
        || instruction.op_count() != 2
    {
        return false;
    }
    let immediate = match instruction.op1_kind() {
        OpKind::Immediate32to64 | OpKind::Immediate8to64 | OpKind::Immediate8 => {
            instruction.immediate(1)
        }
        _ => return false,
    };
    match instruction.mnemonic() {
        Mnemonic::And => POOL_MASKS.contains(&(immediate as i64)),
        Mnemonic::Shr => immediate == ARENA_MAP_TOP_SHIFT,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Debian 3.11's `PyObject_GC_Del` path: copies, then the arena-map key and the
    /// pool, of %rdi.
    #[test]
    fn block_through_copies() {
        let code = [
            0x48, 0x89, 0xf8, // mov %rdi,%rax
            0x48, 0x89, 0xfe, // mov %rdi,%rsi
            0x53, // push %rbx
            0x48, 0xc1, 0xe8, 0x31, // shr $0x31,%rax
            0x48, 0x81, 0xe6, 0x00, 0xc0, 0xff, 0xff, // and $0xffffffffffffc000,%rsi
        ];
        assert_eq!(
            freed_register(&code, 0x1000, 0x1000),
            Path::Block(Reg::Rdi, None)
        );
    }

    /// A null check first (`test %rbx,%rbx; je`) is read through.
    #[test]
    fn block_after_a_null_check() {
        let code = [
            0x48, 0x85, 0xdb, // test %rbx,%rbx
            0x74, 0x10, // je
            0x48, 0x89, 0xda, // mov %rbx,%rdx
            0x48, 0xc1, 0xea, 0x31, // shr $0x31,%rdx
        ];
        assert_eq!(
            freed_register(&code, 0x1000, 0x1000),
            Path::Block(Reg::Rbx, None)
        );
    }

    /// `test %rbx,%rbx; jne +2; (null side: ud2); shr $0x31,%rbx`: the non-null side.
    #[test]
    fn block_on_the_non_null_side_of_a_jump() {
        let code = [
            0x48, 0x85, 0xdb, // test %rbx,%rbx
            0x75, 0x02, // jne +2
            0x0f, 0x0b, // ud2
            0x48, 0xc1, 0xeb, 0x31, // shr $0x31,%rbx
        ];
        assert_eq!(
            freed_register(&code, 0x1000, 0x1000),
            Path::Block(Reg::Rbx, None)
        );
    }

    /// A block reloaded from a spill slot on the path: probed at the path's next
    /// conditional branch, in the register it was loaded into (Debian 3.11's
    /// `PyLong_AsLongAndOverflow`).
    #[test]
    fn block_loaded_on_the_path() {
        let code = [
            0x48, 0x8b, 0x5c, 0x24, 0x08, // mov 0x8(%rsp),%rbx
            0x48, 0x89, 0xd8, // mov %rbx,%rax
            0x48, 0xc1, 0xe8, 0x31, // shr $0x31,%rax
            0x48, 0x85, 0xc9, // test %rcx,%rcx
            0x74, 0x00, // je +0
        ];
        match freed_register(&code, 0x1000, 0x1000) {
            Path::Block(Reg::Rbx, Some(at)) => assert_eq!(at.ip(), 0x100f),
            other => panic!("{other:?}"),
        }
        // Overwritten before the branch: not read.
        let overwritten = [
            0x48, 0x8b, 0x5c, 0x24, 0x08, // mov 0x8(%rsp),%rbx
            0x48, 0xc1, 0xeb, 0x31, // shr $0x31,%rbx
            0x31, 0xdb, // xor %ebx,%ebx
            0x74, 0x00, // je +0
        ];
        assert_eq!(freed_register(&overwritten, 0x1000, 0x1000), Path::Unknown);
    }

    /// A path that returns first frees nothing (the pointer was known null).
    #[test]
    fn a_path_that_returns_frees_nothing() {
        let code = [0x31, 0xdb, 0xc3]; // xor %ebx,%ebx; ret
        assert_eq!(freed_register(&code, 0x1000, 0x1000), Path::Returns);
    }

    /// A copy of a register written first is no block; nor is a 32-bit mask, nor a
    /// path that calls before it masks.
    #[test]
    fn no_block_where_the_path_does_not_show_it() {
        let overwritten = [
            0x48, 0x8b, 0x3f, // mov (%rdi),%rdi
            0x48, 0x89, 0xf8, // mov %rdi,%rax
            0x48, 0x25, 0x00, 0xc0, 0xff, 0xff, // and $0xffffffffffffc000,%rax
        ];
        assert_eq!(freed_register(&overwritten, 0x1000, 0x1000), Path::Unknown);
        let narrow = [
            0x25, 0x00, 0xc0, 0xff, 0xff, // and $0xffffc000,%eax
        ];
        assert_eq!(freed_register(&narrow, 0x1000, 0x1000), Path::Unknown);
        let call = [
            0xe8, 0x00, 0x00, 0x00, 0x00, // call
            0x48, 0x25, 0x00, 0xc0, 0xff, 0xff, // and $0xffffffffffffc000,%rax
        ];
        assert_eq!(freed_register(&call, 0x1000, 0x1000), Path::Unknown);
    }
}
