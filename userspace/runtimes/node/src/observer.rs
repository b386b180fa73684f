//! The offsets V8's allocation-observer step reads, from the step's own code.
//!
//! `AdvanceAllocationObservers` (of a `SpaceWithLinearArea` in V8 11, of a
//! `MainAllocator` in V8 12) loads its linear allocation area through a pointer in
//! `this`, returns at once when the area's top is null or equals its start, and passes
//! `top - start` to the observers unless its heap has them paused; V8 12 first returns
//! when the allocator does not report to observers at all (a flag byte in `this`). The
//! offsets of that pointer, of the heap pointer, of the pause depth and of the flag are
//! not published: they are read from the instructions that load them, which every
//! build has near the function's start:
//!
//! ```text
//! cmpb $0, GATE(%rdi)        (V8 12)
//! mov LAB(%rdi), %rax
//! mov 0x8(%rax), %rsi        (top; start is at 0)
//! mov HEAP(%rdi), %rcx
//! mov PAUSE(%rcx), %ecx
//! test %ecx, %ecx
//! ```
//!
//! A function that does not read this way is refused: the probe then counts nothing
//! in that process (it has no `NODE` entry).

use std::collections::HashMap;

use allocbpf_common::node::V8Heap;
use iced_x86::{Code, Decoder, DecoderOptions, Instruction, Mnemonic, OpKind, Register};

use crate::NodeError;

/// Instructions read at most.
const MAX_INSTRUCTIONS: usize = 40;

/// Largest offset believed in `this` or in the heap.
const MAX_OFFSET: u64 = 1 << 16;

/// The memory operand `[base + displacement]` of operand `index`, when it has no
/// index register.
fn based(instruction: &Instruction, index: u32) -> Option<(Register, u64)> {
    if instruction.op_kind(index) != OpKind::Memory || instruction.memory_index() != Register::None
    {
        return None;
    }
    let displacement = instruction.memory_displacement64();
    (displacement < MAX_OFFSET).then_some((instruction.memory_base(), displacement))
}

/// Reads the offsets from the step's `code` (at `address`).
pub fn offsets(code: &[u8], address: u64) -> Result<V8Heap, NodeError> {
    const WHAT: &str = "AdvanceAllocationObservers";
    let mut decoder = Decoder::with_ip(64, code, address, DecoderOptions::NONE);
    // Registers loaded from `this` (rdi), by the offset they were loaded from.
    let mut from_this: HashMap<Register, u64> = HashMap::new();
    let mut gate = 0u64;
    let mut lab = None;
    // (register holding the pause depth, heap offset, pause offset), until its test.
    let mut pause_load: Option<(Register, u64, u64)> = None;
    let mut heap = None;
    let mut instructions = Vec::new();
    while decoder.can_decode() && instructions.len() < MAX_INSTRUCTIONS {
        let instruction = decoder.decode();
        if instruction.is_invalid() {
            break;
        }
        instructions.push(instruction);
    }
    for (i, instruction) in instructions.iter().enumerate() {
        let written = match instruction.op0_kind() {
            OpKind::Register => Some(instruction.op0_register().full_register()),
            _ => None,
        };
        match instruction.code() {
            Code::Cmp_rm8_imm8 if i == 0 && instruction.immediate8() == 0 => {
                if let Some((Register::RDI, offset)) = based(instruction, 0) {
                    gate = offset;
                }
                continue;
            }
            Code::Mov_r64_rm64 => {
                let target = instruction.op0_register();
                if target == Register::RDI {
                    // `this` itself replaced: nothing after reads from it.
                    break;
                }
                match based(instruction, 1) {
                    Some((Register::RDI, offset)) => {
                        from_this.insert(target, offset);
                        continue;
                    }
                    Some((base, 8)) if lab.is_none() && from_this.contains_key(&base) => {
                        lab = from_this.get(&base).copied();
                    }
                    _ => {}
                }
                // Loaded from elsewhere: it no longer holds what `this` pointed to.
                from_this.remove(&target);
                continue;
            }
            Code::Mov_r32_rm32 => {
                if let Some((base, offset)) = based(instruction, 1) {
                    if let Some(&heap_offset) = from_this.get(&base) {
                        let target = instruction.op0_register().full_register();
                        pause_load = Some((target, heap_offset, offset));
                    }
                }
            }
            Code::Test_rm32_r32 if instruction.mnemonic() == Mnemonic::Test => {
                let tested = instruction.op0_register().full_register();
                if let Some((register, heap_offset, pause)) = pause_load {
                    if register == tested && instruction.op1_register().full_register() == tested {
                        heap = Some((heap_offset, pause));
                    }
                }
                continue;
            }
            _ => {}
        }
        if written == Some(Register::RDI) {
            break;
        }
        if let Some(register) = written {
            if !matches!(instruction.code(), Code::Mov_r64_rm64) {
                from_this.remove(&register);
            }
        }
        if lab.is_some() && heap.is_some() {
            break;
        }
    }
    match (lab, heap) {
        (Some(lab), Some((heap, pause))) => Ok(V8Heap {
            lab: lab as u32,
            heap: heap as u32,
            pause: pause as u32,
            gate: gate as u32,
        }),
        _ => Err(NodeError::UnknownStep(WHAT)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Debian's Node.js 20 (V8 11.3): `SpaceWithLinearArea::AdvanceAllocationObservers`.
    const V8_11: &[u8] = &[
        0x48, 0x8b, 0x47, 0x50, // mov 0x50(%rdi),%rax
        0x48, 0x8b, 0x70, 0x08, // mov 0x8(%rax),%rsi
        0x48, 0x85, 0xf6, // test %rsi,%rsi
        0x74, 0x33, // je
        0x48, 0x8b, 0x10, // mov (%rax),%rdx
        0x48, 0x39, 0xd6, // cmp %rdx,%rsi
        0x74, 0x2b, // je
        0x55, // push %rbp
        0x48, 0x89, 0xe5, // mov %rsp,%rbp
        0x41, 0x54, // push %r12
        0x53, // push %rbx
        0x48, 0x8b, 0x4f, 0x08, // mov 0x8(%rdi),%rcx
        0x48, 0x89, 0xfb, // mov %rdi,%rbx
        0x8b, 0x89, 0xb4, 0x0c, 0x00, 0x00, // mov 0xcb4(%rcx),%ecx
        0x85, 0xc9, // test %ecx,%ecx
        0x74, 0x1b, // je
    ];

    /// Node.js 22 (V8 12.4): `MainAllocator::AdvanceAllocationObservers`.
    const V8_12: &[u8] = &[
        0x80, 0xbf, 0x98, 0x00, 0x00, 0x00, 0x00, // cmpb $0x0,0x98(%rdi)
        0x74, 0x3f, // je
        0x55, // push %rbp
        0x48, 0x89, 0xe5, // mov %rsp,%rbp
        0x53, // push %rbx
        0x48, 0x89, 0xfb, // mov %rdi,%rbx
        0x48, 0x83, 0xec, 0x08, // sub $0x8,%rsp
        0x48, 0x8b, 0x87, 0xa0, 0x00, 0x00, 0x00, // mov 0xa0(%rdi),%rax
        0x48, 0x8b, 0x70, 0x08, // mov 0x8(%rax),%rsi
        0x48, 0x85, 0xf6, // test %rsi,%rsi
        0x74, 0x19, // je
        0x48, 0x8b, 0x10, // mov (%rax),%rdx
        0x48, 0x39, 0xd6, // cmp %rdx,%rsi
        0x74, 0x11, // je
        0x48, 0x8b, 0x4f, 0x08, // mov 0x8(%rdi),%rcx
        0x8b, 0x89, 0xf4, 0x0a, 0x00, 0x00, // mov 0xaf4(%rcx),%ecx
        0x85, 0xc9, // test %ecx,%ecx
    ];

    #[test]
    fn both_builds_read_their_offsets() {
        assert_eq!(
            offsets(V8_11, 0x11a0cb0).unwrap(),
            V8Heap {
                lab: 0x50,
                heap: 0x8,
                pause: 0xcb4,
                gate: 0
            }
        );
        assert_eq!(
            offsets(V8_12, 0x149c100).unwrap(),
            V8Heap {
                lab: 0xa0,
                heap: 0x8,
                pause: 0xaf4,
                gate: 0x98
            }
        );
    }

    #[test]
    fn other_code_is_refused() {
        let err = Err(NodeError::UnknownStep("AdvanceAllocationObservers"));
        assert_eq!(offsets(&[0xc3], 0), err);
        assert_eq!(offsets(&[0x90; 64], 0), err);
        assert_eq!(offsets(&V8_11[..20], 0), err, "no pause check: refused");
        // The loads from another register than `this`.
        let mut other = V8_11.to_vec();
        other[2] = 0x46; // mov 0x50(%rsi),%rax
        assert_eq!(offsets(&other, 0), err);
    }
}
