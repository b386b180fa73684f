//! Where to probe `free`: the first instruction of it that the kernel emulates.
//!
//! A uprobe on an instruction the kernel cannot emulate is executed out of line with a
//! single step: on glibc's `free+0` (`test %rdi,%rdi`) that costs ~16 us per call
//! (shared/docs/bpf-toolchain.md). x86-64 kernels emulate relative branches (jcc, jmp,
//! call), and recent ones also `push reg` and `nop`. We decode the first instructions
//! with iced-x86 and take the first relative branch (emulated on every kernel), else the
//! first push/nop, provided every instruction before it runs unconditionally (no
//! control flow: each call to `free` reaches the probe) and leaves `rdi` alone (the probe
//! still reads the pointer from it). `free(NULL)` reaches the probe like any call and is
//! ignored by the program.

use iced_x86::{
    Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, Mnemonic, OpAccess,
    OpKind, Register,
};
use object::{Object, ObjectSection, ObjectSymbol};

/// Instructions examined at most.
const MAX_INSTRUCTIONS: usize = 16;

/// The chosen probe point in `free`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FreeProbe {
    /// File offset of `free`'s first byte.
    pub function_file_offset: u64,
    /// Bytes from `free`'s start to the probed instruction.
    pub offset: u64,
    /// The probed instruction, for logs (e.g. `je 0x...`).
    pub instruction: String,
}

impl FreeProbe {
    /// The file offset to attach the uprobe at.
    pub fn file_offset(&self) -> u64 {
        self.function_file_offset + self.offset
    }
}

/// Decodes `{prefix}free` in a parsed allocator image and picks the probe point.
pub fn find_free_probe(file: &object::File, prefix: &str) -> Result<FreeProbe, String> {
    let name = format!("{prefix}free");
    let symbol = file
        .dynamic_symbols()
        .chain(file.symbols())
        .find(|s| s.is_definition() && s.name() == Ok(name.as_str()))
        .ok_or_else(|| format!("the file does not define {name}"))?;
    let section = symbol
        .section_index()
        .and_then(|i| file.section_by_index(i).ok())
        .ok_or("free is in no section")?;
    let (section_file_offset, _) = section.file_range().ok_or("free's section has no data")?;
    let bytes = section.data().map_err(|e| e.to_string())?;
    let start = (symbol.address() - section.address()) as usize;
    let end = bytes.len().min(start + 16 * MAX_INSTRUCTIONS);
    let code = bytes
        .get(start..end)
        .ok_or("free lies outside its section")?;
    let (offset, instruction) = choose(code, symbol.address())?;
    Ok(FreeProbe {
        function_file_offset: section_file_offset + start as u64,
        offset,
        instruction,
    })
}

/// True for the instructions every x86-64 kernel emulates (relative branches).
fn is_emulated_branch(instruction: &Instruction) -> bool {
    instruction.is_jcc_short_or_near()
        || instruction.is_jmp_short_or_near()
        || instruction.is_call_near()
}

/// True for instructions recent kernels emulate too (`push reg`, `nop`).
fn is_emulated_other(instruction: &Instruction) -> bool {
    match instruction.mnemonic() {
        Mnemonic::Push => {
            instruction.op0_kind() == OpKind::Register && instruction.op0_register().is_gpr64()
        }
        Mnemonic::Nop => true,
        _ => false,
    }
}

/// The offset and text of the instruction to probe in `code` (which starts at `ip`).
pub fn choose(code: &[u8], ip: u64) -> Result<(u64, String), String> {
    let mut decoder = Decoder::with_ip(64, code, ip, DecoderOptions::NONE);
    let mut info = InstructionInfoFactory::new();
    let mut fallback: Option<(u64, String)> = None;
    for _ in 0..MAX_INSTRUCTIONS {
        if !decoder.can_decode() {
            break;
        }
        let instruction = decoder.decode();
        if instruction.is_invalid() {
            break;
        }
        let offset = instruction.ip() - ip;
        if is_emulated_branch(&instruction) {
            return Ok((offset, instruction.to_string()));
        }
        if fallback.is_none() && is_emulated_other(&instruction) {
            fallback = Some((offset, instruction.to_string()));
        }
        let writes_rdi = info.info(&instruction).used_registers().iter().any(|used| {
            used.register().full_register() == Register::RDI
                && !matches!(used.access(), OpAccess::Read | OpAccess::CondRead)
        });
        if writes_rdi || instruction.flow_control() != FlowControl::Next {
            break;
        }
    }
    fallback.ok_or_else(|| {
        "no instruction the kernel emulates before free changes rdi or branches".to_string()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glibc_free_prologue_probes_the_je() {
        // test %rdi,%rdi ; je +0x40 ; push %rbp
        let code = [0x48, 0x85, 0xff, 0x74, 0x40, 0x55];
        let (offset, text) = choose(&code, 0x1000).unwrap();
        assert_eq!(offset, 3);
        assert!(text.starts_with("je"), "{text}");
    }

    #[test]
    fn a_push_is_taken_when_no_branch_comes_first() {
        // push %rbp ; mov %rsp,%rbp ; mov %rsi,%rdi (writes rdi) ; jmp
        let code = [0x55, 0x48, 0x89, 0xe5, 0x48, 0x89, 0xf7, 0xeb, 0x00];
        let (offset, text) = choose(&code, 0).unwrap();
        assert_eq!(offset, 0);
        assert!(text.starts_with("push"), "{text}");
    }

    #[test]
    fn nothing_after_rdi_is_overwritten() {
        // mov %rsi,%rdi ; je
        let code = [0x48, 0x89, 0xf7, 0x74, 0x00];
        assert!(choose(&code, 0).is_err());
    }

    #[test]
    fn this_machines_libc_has_a_probe_point() {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let libc = crate::image::find_libc_in_maps(&maps).expect("tests link glibc");
        let data = std::fs::read(&libc).unwrap();
        let probe = find_free_probe(&object::File::parse(&*data).unwrap(), "").unwrap();
        assert!(probe.offset < 64, "{probe:?}");
    }
}
