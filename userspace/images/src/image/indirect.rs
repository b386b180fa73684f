//! Deallocation entries that only jump through a function pointer of their image.
//!
//! A shared libpython's `PyObject_Free` and `PyMem_Free` are three instructions:
//! `mov %rdi,%rsi; mov ctx(%rip),%rdi; jmp *free(%rip)`, the pointer being the domain's
//! allocator (`_PyObject.free`). None of them is one the kernel emulates, so a probe there
//! is single-stepped on every free, which live tracking cannot afford. The pointer's
//! initial value is the default allocator's free (`_PyObject_Free`), set by the image
//! itself (a relocation of the slot, or the slot's bytes in a fixed-address
//! executable); that function usually has an emulated instruction before it loses the
//! block. So such an entry is probed at the pointer's initial target instead, with the
//! block in the register the trampoline moved it to.
//!
//! What that misses: a program that replaces the allocator without chaining to the
//! previous one frees through its own function (a hook that chains, tracemalloc's,
//! still ends in the default one). CPython's debug hooks (`PYTHONMALLOC=debug`,
//! `-X dev`) chain too, but free the block less their header: under them, `--live`
//! sees blocks allocated through the exported functions never freed.

use allocbpf_common::{cookie::Reg, Shape};
use iced_x86::{
    Code, Decoder, DecoderOptions, FlowControl, InstructionInfoFactory, OpKind, Register,
};
use object::{
    elf, Object, ObjectSection, ObjectSymbol, ObjectSymbolTable, RelocationFlags, RelocationTarget,
};

use super::{
    addresses::{code_at, file_offset_of},
    point::{self, Input},
    ProbedEntry,
};

/// Instructions of a trampoline decoded at most.
const MAX_TRAMPOLINE_INSTRUCTIONS: usize = 4;

/// Replaces each single-stepped deallocation entry of `frees` that only jumps through a
/// pointer of its image by a probe at the pointer's initial target, when that has an
/// emulated point; one probe per address (two entries through one pointer share it).
pub fn follow_frees(file: &object::File, frees: Vec<ProbedEntry>) -> Vec<ProbedEntry> {
    let mut out: Vec<ProbedEntry> = Vec::with_capacity(frees.len());
    for entry in frees {
        let entry = match entry.point.emulated || entry.shape != Shape::Free {
            true => entry,
            false => through_pointer(file, &entry).unwrap_or(entry),
        };
        if !out.iter().any(|e| e.address == entry.address) {
            out.push(entry);
        }
    }
    out
}

/// `entry` probed at its pointer's initial target, if it is such a trampoline.
fn through_pointer(file: &object::File, entry: &ProbedEntry) -> Option<ProbedEntry> {
    let code = code_at(file, entry.address, point::MAX_PROLOGUE_BYTES)?;
    let (slot, argument) = trampoline(code, entry.address, |slot| slot_value(file, slot))?;
    let target = slot_value(file, slot)?;
    // The pointer's target must be code of this image.
    let target_code = code_at(file, target, point::MAX_PROLOGUE_BYTES)?;
    let point = point::choose(target_code, target, &[Input::Arg(argument)]);
    if !point.emulated {
        return None;
    }
    Some(ProbedEntry {
        symbol: format!("{} (through its pointer, {target:#x})", entry.symbol),
        file_offset: file_offset_of(file, target)?,
        address: target,
        size: 0,
        point,
        ..entry.clone()
    })
}

/// If `code` (at `ip`) is straight-line moves ending in a jump through a pointer at an
/// address the image knows (`jmp *slot(%rip)`, or `jmp *offset(%reg)` with `%reg`
/// loaded from a GOT slot or by a `lea` of the code's own position: pyenv's 3.12 reaches
/// `_PyRuntime`'s allocators that way): the pointer's address, and which argument
/// register holds the entry's first argument at the jump. `value_at` reads the value the
/// image gives a slot.
fn trampoline(code: &[u8], ip: u64, value_at: impl Fn(u64) -> Option<u64>) -> Option<(u64, u8)> {
    let mut decoder = Decoder::with_ip(64, code, ip, DecoderOptions::NONE);
    let mut info = InstructionInfoFactory::new();
    // Where the first argument is.
    let mut holder = Register::RDI;
    // Registers holding an address the image knows.
    let mut known: Vec<(Register, u64)> = Vec::new();
    for _ in 0..MAX_TRAMPOLINE_INSTRUCTIONS {
        let instruction = decoder.decode();
        if instruction.is_invalid() {
            return None;
        }
        if instruction.code() == Code::Jmp_rm64 && instruction.op0_kind() == OpKind::Memory {
            let slot = if instruction.is_ip_rel_memory_operand() {
                instruction.ip_rel_memory_address()
            } else if instruction.memory_index() == Register::None {
                let base = instruction.memory_base().full_register();
                let (_, address) = known.iter().find(|(r, _)| *r == base)?;
                address.wrapping_add(instruction.memory_displacement64())
            } else {
                return None;
            };
            let argument = Reg::ARGUMENTS
                .iter()
                .position(|&r| Some(r) == point::register_code(holder))?;
            return Some((slot, argument as u8));
        }
        if instruction.flow_control() != FlowControl::Next {
            return None;
        }
        let register_move = matches!(instruction.code(), Code::Mov_r64_rm64 | Code::Mov_rm64_r64)
            && instruction.op0_kind() == OpKind::Register
            && instruction.op1_kind() == OpKind::Register;
        if register_move && instruction.op1_register() == holder {
            holder = instruction.op0_register();
            continue;
        }
        let written = point::written_registers(&mut info, &instruction);
        if written.contains(&holder) {
            return None;
        }
        known.retain(|(r, _)| !written.contains(r));
        if instruction.is_ip_rel_memory_operand() {
            let address = instruction.ip_rel_memory_address();
            let loaded = match instruction.code() {
                Code::Lea_r64_m => Some(address),
                Code::Mov_r64_rm64 => value_at(address),
                _ => None,
            };
            if let Some(value) = loaded {
                known.push((instruction.op0_register().full_register(), value));
            }
        }
    }
    None
}

/// The value the image gives the pointer at `slot`: its dynamic relocation's (a
/// position-independent file), else its bytes in the file (a fixed-address one).
fn slot_value(file: &object::File, slot: u64) -> Option<u64> {
    if let Some(relocations) = file.dynamic_relocations() {
        for (offset, relocation) in relocations {
            if offset != slot {
                continue;
            }
            return match (relocation.flags(), relocation.target()) {
                (
                    RelocationFlags::Elf {
                        r_type: elf::R_X86_64_RELATIVE,
                    },
                    _,
                ) => u64::try_from(relocation.addend()).ok(),
                (
                    RelocationFlags::Elf {
                        r_type: elf::R_X86_64_64 | elf::R_X86_64_GLOB_DAT,
                    },
                    RelocationTarget::Symbol(index),
                ) => {
                    // A symbol the image defines itself (a GOT slot of its own data).
                    let symbol = file.dynamic_symbol_table()?.symbol_by_index(index).ok()?;
                    symbol
                        .is_definition()
                        .then(|| symbol.address().wrapping_add(relocation.addend() as u64))
                }
                _ => None,
            };
        }
    }
    let value = file.sections().find_map(|section| {
        let (start, size) = (section.address(), section.size());
        if !(start..start + size).contains(&slot) {
            return None;
        }
        let bytes = section.data().ok()?;
        let from = (slot - start) as usize;
        Some(u64::from_le_bytes(
            bytes.get(from..from + 8)?.try_into().ok()?,
        ))
    })?;
    (value != 0).then_some(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// libpython's `PyObject_Free`: the block moves to %rsi, then the jump.
    #[test]
    fn a_trampoline_gives_its_slot_and_where_the_block_went() {
        let code = [
            0x48, 0x89, 0xfe, // mov %rdi,%rsi
            0x48, 0x8b, 0x3d, 0x26, 0x0f, 0x47, 0x00, // mov 0x470f26(%rip),%rdi
            0xff, 0x25, 0x40, 0x0f, 0x47, 0x00, // jmp *0x470f40(%rip)
        ];
        let ip = 0x1cae70;
        assert_eq!(
            trampoline(&code, ip, |_| None),
            Some((0x1cae70 + 16 + 0x470f40, 1))
        );
    }

    /// The block lost (overwritten), a branch first, or no jump through memory: no.
    #[test]
    fn other_code_is_no_trampoline() {
        let lost = [
            0x48, 0x8b, 0x3d, 0x26, 0x0f, 0x47, 0x00, // mov 0x470f26(%rip),%rdi
            0xff, 0x25, 0x40, 0x0f, 0x47, 0x00, // jmp *0x470f40(%rip)
        ];
        assert_eq!(trampoline(&lost, 0x1000, |_| None), None);
        let branch = [0x74, 0x02, 0xff, 0x25, 0x40, 0x0f, 0x47, 0x00];
        assert_eq!(trampoline(&branch, 0x1000, |_| None), None);
        let register_jump = [0x48, 0x89, 0xfe, 0xff, 0xe0]; // mov %rdi,%rsi; jmp *%rax
        assert_eq!(trampoline(&register_jump, 0x1000, |_| None), None);
        // jmp *0xd0(%rax) with %rax unknown.
        let unknown_base = [0x48, 0x89, 0xfe, 0xff, 0xa0, 0xd0, 0x00, 0x00, 0x00];
        assert_eq!(trampoline(&unknown_base, 0x1000, |_| None), None);
    }

    /// pyenv's 3.12: `_PyRuntime`'s address from the GOT, then the jump through its
    /// allocator's field.
    #[test]
    fn a_trampoline_through_a_got_loaded_base() {
        let code = [
            0x48, 0x8b, 0x05, 0x19, 0x48, 0x37, 0x00, // mov 0x374819(%rip),%rax
            0x48, 0x89, 0xfe, // mov %rdi,%rsi
            0x48, 0x8b, 0xb8, 0xb0, 0x00, 0x00, 0x00, // mov 0xb0(%rax),%rdi
            0xff, 0xa0, 0xd0, 0x00, 0x00, 0x00, // jmp *0xd0(%rax)
        ];
        let ip = 0x1cf4e0;
        let got = ip + 7 + 0x374819;
        let runtime = 0x643340;
        let value_at = |slot| (slot == got).then_some(runtime);
        assert_eq!(trampoline(&code, ip, value_at), Some((runtime + 0xd0, 1)));
    }

    /// Debian's shared libpython3.11, when this machine has it: its frees are probed
    /// at `_PyObject_Free`'s emulated branch, once for both.
    #[test]
    fn shared_libpython_frees_are_probed_where_their_pointer_goes() {
        let path = "/usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0";
        let Ok(data) = std::fs::read(path) else {
            return;
        };
        let file = object::File::parse(&*data).unwrap();
        let resolved = super::super::resolve_entries(&file, &data, &Default::default()).unwrap();
        assert!(
            resolved.frees.iter().all(|e| e.point.emulated),
            "{:#?}",
            resolved.frees
        );
        let through: Vec<_> = resolved
            .frees
            .iter()
            .filter(|e| e.symbol.contains("through its pointer"))
            .collect();
        assert_eq!(through.len(), 1, "{through:#?}");
        assert_eq!(through[0].point.registers[0], Reg::Rsi);
    }
}
