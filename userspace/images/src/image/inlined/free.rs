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

use super::{code_at, compared_default, exported_code, point, ProbedEntry, Site};

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

/// The probed site of the branch `jump` to an inlined `PyObject_Free`, if its path
/// shows which register holds the block.
pub(super) fn site(
    file: &object::File,
    data: &[u8],
    base: u64,
    jump: &Instruction,
) -> Option<ProbedEntry> {
    let path = match jump.mnemonic() {
        Mnemonic::Jne => jump.next_ip(),
        _ => jump.near_branch_target(),
    };
    let mut code = path_code(data, base, path)?;
    let mut path_ip = path;
    // A path moved out of line starts with a jump to it: followed once.
    let first = Decoder::with_ip(64, code, path, DecoderOptions::NONE).decode();
    if matches!(first.code(), Code::Jmp_rel32_64 | Code::Jmp_rel8_64) {
        path_ip = first.near_branch_target();
        code = path_code(data, base, path_ip)?;
    }
    let site = Site {
        symbol: "PyObject_Free",
        function: AllocFn::Free,
        shape: Shape::Free,
        register: freed_register(code, path_ip)?,
        size: 0,
    };
    site.at(file, data, base, jump)
}

/// The code of the text section `data` (at `base`) from `ip`, as much as a path reads.
fn path_code(data: &[u8], base: u64, ip: u64) -> Option<&[u8]> {
    let start = ip.checked_sub(base)? as usize;
    data.get(start..(start + MAX_FREE_PATH_BYTES).min(data.len()))
}

/// The register that holds the freed block at the start of the inlined path `code`
/// (at `ip`): the one masked to its pool or shifted to its arena-map key, itself or a
/// copy of it, before anything wrote it. Conditional branches are read through (the
/// null check leaves the path); anything else ends the search.
fn freed_register(code: &[u8], ip: u64) -> Option<Reg> {
    let mut decoder = Decoder::with_ip(64, code, ip, DecoderOptions::NONE);
    let mut info = InstructionInfoFactory::new();
    let mut written: Vec<Register> = Vec::new();
    // (copy, original) for `mov %original, %copy` of an untouched register.
    let mut copies: Vec<(Register, Register)> = Vec::new();
    for _ in 0..MAX_FREE_PATH_INSTRUCTIONS {
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
        if reads_block(&instruction) {
            let target = instruction.op0_register();
            if untouched(target) {
                return point::register_code(target);
            }
            if let Some(&(_, original)) = copies.iter().find(|(copy, _)| *copy == target) {
                return point::register_code(original);
            }
        }
        if !matches!(
            instruction.flow_control(),
            FlowControl::Next | FlowControl::ConditionalBranch
        ) {
            return None;
        }
        let now_written = point::written_registers(&mut info, &instruction);
        copies.retain(|(copy, _)| !now_written.contains(copy));
        if instruction.code() == Code::Mov_rm64_r64 || instruction.code() == Code::Mov_r64_rm64 {
            let (copy, original) = (instruction.op0_register(), instruction.op1_register());
            if instruction.op0_kind() == OpKind::Register
                && instruction.op1_kind() == OpKind::Register
                && untouched(original)
            {
                copies.push((copy, original));
            }
        }
        written.extend(now_written);
    }
    None
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
        assert_eq!(freed_register(&code, 0x1000), Some(Reg::Rdi));
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
        assert_eq!(freed_register(&code, 0x1000), Some(Reg::Rbx));
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
        assert_eq!(freed_register(&overwritten, 0x1000), None);
        let narrow = [
            0x25, 0x00, 0xc0, 0xff, 0xff, // and $0xffffc000,%eax
        ];
        assert_eq!(freed_register(&narrow, 0x1000), None);
        let call = [
            0xe8, 0x00, 0x00, 0x00, 0x00, // call
            0x48, 0x25, 0x00, 0xc0, 0xff, 0xff, // and $0xffffffffffffc000,%rax
        ];
        assert_eq!(freed_register(&call, 0x1000), None);
    }
}
