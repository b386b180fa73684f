//! Which allocation entries call other allocation entries.
//!
//! An entry that forwards (libstdc++'s `operator new` calls `malloc`, musl's `calloc`
//! calls `malloc`, jemalloc's `operator new[]` jumps to `operator new`) must not count
//! an allocation twice. Its code is decoded and every direct branch target and every
//! rip-relative indirect call or jump is resolved: to another entry of the same image
//! by address, or through a PLT stub or GOT slot to the symbol its dynamic relocation
//! names. A target that is an allocation symbol (the catalogue's, under any prefix)
//! makes the entry a forwarder.

use std::collections::HashMap;

use iced_x86::{Decoder, DecoderOptions, Instruction, Mnemonic, OpKind};
use object::{
    elf, Object, ObjectSection, ObjectSymbol, ObjectSymbolTable, RelocationFlags, RelocationTarget,
};

/// Bytes of an entry's code decoded at most when looking for its calls.
const MAX_BODY_BYTES: usize = 64 * 1024;

/// The calls an entry makes to allocation entries.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Forwards {
    /// Allocation symbols (or same-image entry addresses, as `0x...`) it may call.
    pub targets: Vec<String>,
    /// Its first instruction is an unconditional jump to one of them: every call is
    /// counted where it lands.
    pub tail_stub: bool,
    /// It reaches one of them by a jump (a tail call), not only by calls.
    pub tail: bool,
    /// The targets it reaches by a jump.
    pub tail_targets: Vec<String>,
    /// It reaches one of them by a call (its own frame is then on the stack).
    pub calls: bool,
}

/// Where a call or jump goes, as far as the file says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Branch {
    /// One of the image's allocation entries, by address.
    Entry(u64),
    /// Another object's symbol, through a PLT stub or a GOT slot.
    Bound(String),
    /// Code of this file.
    Local {
        /// Its address.
        to: u64,
        /// The symbol that starts there, if any.
        name: Option<String>,
    },
    /// Through a register or memory that is not a GOT slot.
    Unknown,
}

/// Resolves branch targets of one parsed file.
pub struct CallResolver<'data, 'file> {
    file: &'file object::File<'data>,
    /// GOT slot address -> the symbol its relocation binds.
    got: HashMap<u64, String>,
    /// `[start, end)` of the PLT sections.
    plt: Vec<(u64, u64)>,
    /// Function symbols by address.
    names: HashMap<u64, String>,
}

impl<'data, 'file> CallResolver<'data, 'file> {
    /// Indexes the file's GOT relocations and PLT sections.
    pub fn new(file: &'file object::File<'data>) -> Self {
        let mut got = HashMap::new();
        if let (Some(relocations), Some(symbols)) =
            (file.dynamic_relocations(), file.dynamic_symbol_table())
        {
            for (offset, relocation) in relocations {
                let bound = matches!(
                    relocation.flags(),
                    RelocationFlags::Elf {
                        r_type: elf::R_X86_64_JUMP_SLOT | elf::R_X86_64_GLOB_DAT
                    }
                );
                if let (true, RelocationTarget::Symbol(index)) = (bound, relocation.target()) {
                    if let Some(name) = symbols
                        .symbol_by_index(index)
                        .ok()
                        .and_then(|s| s.name().ok())
                    {
                        got.insert(offset, name.to_string());
                    }
                }
            }
        }
        let plt = file
            .sections()
            .filter(|s| s.name().is_ok_and(|n| n.starts_with(".plt")))
            .map(|s| (s.address(), s.address() + s.size()))
            .collect();
        let names = file
            .dynamic_symbols()
            .chain(file.symbols())
            .filter(|s| s.is_definition() && s.kind() == object::SymbolKind::Text)
            .filter_map(|s| Some((s.address(), s.name().ok()?.to_string())))
            .collect();
        CallResolver {
            file,
            got,
            plt,
            names,
        }
    }

    /// Where `instruction` (a call or jump) goes. `entries`: the image's allocation
    /// entry addresses.
    pub fn classify(&self, instruction: &Instruction, entries: &[u64]) -> Branch {
        let direct = instruction.is_call_near()
            || instruction.is_jmp_short_or_near()
            || instruction.is_jcc_short_or_near();
        if !direct {
            return match self.got_symbol(instruction) {
                Some(name) => Branch::Bound(name.to_string()),
                None => Branch::Unknown,
            };
        }
        let to = instruction.near_branch_target();
        if entries.contains(&to) {
            Branch::Entry(to)
        } else if self.in_plt(to) {
            match self.plt_symbol(to) {
                Some(name) => Branch::Bound(name.to_string()),
                None => Branch::Unknown,
            }
        } else {
            Branch::Local {
                to,
                name: self.names.get(&to).cloned(),
            }
        }
    }

    /// The allocation entry `instruction` (a call or jump in the entry at `from`) goes
    /// to, if any: another of the image's entries (as `0x...`), or a bound symbol that
    /// `is_allocation` accepts.
    pub fn forward_target(
        &self,
        instruction: &Instruction,
        from: u64,
        entries: &[u64],
        is_allocation: impl Fn(&str) -> bool,
    ) -> Option<String> {
        match self.classify(instruction, entries) {
            Branch::Entry(to) if to != from => Some(format!("{to:#x}")),
            Branch::Bound(name) if is_allocation(&name) => Some(name),
            _ => None,
        }
    }

    /// Up to 16 bytes of the file's code at virtual address `address`.
    pub fn code_at(&self, address: u64) -> Option<&'data [u8]> {
        let section = self.file.sections().find(|s| {
            s.kind() == object::SectionKind::Text
                && (s.address()..s.address() + s.size()).contains(&address)
        })?;
        let data = section.data().ok()?;
        let start = (address - section.address()) as usize;
        data.get(start..data.len().min(start + 16))
    }

    fn in_plt(&self, address: u64) -> bool {
        self.plt
            .iter()
            .any(|(lo, hi)| (*lo..*hi).contains(&address))
    }

    /// The symbol a PLT stub at `address` jumps to through its GOT slot.
    fn plt_symbol(&self, address: u64) -> Option<&str> {
        let section = self
            .file
            .sections()
            .find(|s| (s.address()..s.address() + s.size()).contains(&address))?;
        let data = section.data().ok()?;
        let start = (address - section.address()) as usize;
        let code = data.get(start..data.len().min(start + 32))?;
        let mut decoder = Decoder::with_ip(64, code, address, DecoderOptions::NONE);
        // .plt.sec: endbr64; bnd jmp *GOT(%rip). Classic .plt: jmp *GOT(%rip).
        for _ in 0..3 {
            let instruction = decoder.decode();
            if instruction.mnemonic() == Mnemonic::Jmp {
                return self.got_symbol(&instruction);
            }
        }
        None
    }

    /// The symbol bound to the GOT slot a `call/jmp *x(%rip)` reads.
    fn got_symbol(&self, instruction: &Instruction) -> Option<&str> {
        (instruction.op0_kind() == OpKind::Memory && instruction.is_ip_rel_memory_operand())
            .then(|| self.got.get(&instruction.ip_rel_memory_address()))
            .flatten()
            .map(String::as_str)
    }

    /// The allocation calls of the entry whose code is `code` at `address`. `entries`
    /// holds the addresses of the image's allocation entries; `is_allocation` says
    /// whether a bound symbol is one.
    pub fn forwards(
        &self,
        code: &[u8],
        address: u64,
        entries: &[u64],
        is_allocation: impl Fn(&str) -> bool,
    ) -> Forwards {
        let code = &code[..code.len().min(MAX_BODY_BYTES)];
        let mut decoder = Decoder::with_ip(64, code, address, DecoderOptions::NONE);
        let mut out = Forwards::default();
        let mut first = true;
        while decoder.can_decode() {
            let instruction = decoder.decode();
            if instruction.is_invalid() {
                break;
            }
            let branch = instruction.is_call_near()
                || instruction.is_jmp_short_or_near()
                || instruction.is_jcc_short_or_near()
                || instruction.is_call_near_indirect()
                || instruction.is_jmp_near_indirect();
            let target = branch
                .then(|| self.forward_target(&instruction, address, entries, &is_allocation))
                .flatten();
            if let Some(target) = target {
                let is_call = instruction.is_call_near() || instruction.is_call_near_indirect();
                let unconditional =
                    instruction.is_jmp_short_or_near() || instruction.is_jmp_near_indirect();
                out.tail_stub |= first && unconditional;
                out.calls |= is_call;
                if !is_call {
                    out.tail = true;
                    if !out.tail_targets.contains(&target) {
                        out.tail_targets.push(target.clone());
                    }
                }
                if !out.targets.contains(&target) {
                    out.targets.push(target);
                }
            }
            first = false;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn libc() -> Vec<u8> {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let path = crate::procfs::parse_maps(&maps)
            .iter()
            .filter_map(|e| e.file_path().map(|p| p.to_path_buf()))
            .find(|p| p.file_name().is_some_and(|n| n == "libc.so.6"))
            .expect("tests run on glibc");
        std::fs::read(path).unwrap()
    }

    #[test]
    fn a_direct_jump_to_another_entry_is_a_tail_stub() {
        let data = libc();
        let file = object::File::parse(&*data).unwrap();
        let resolver = CallResolver::new(&file);
        // jmp to 0x2000 (an entry), from 0x1000
        let code = [0xe9, 0xfb, 0x0f, 0x00, 0x00];
        let forwards = resolver.forwards(&code, 0x1000, &[0x1000, 0x2000], |_| true);
        assert!(forwards.tail_stub && forwards.tail);
        assert_eq!(forwards.targets, ["0x2000"]);
        // The same jump to a non-entry forwards nothing.
        let none = resolver.forwards(&code, 0x1000, &[0x1000], |_| true);
        assert_eq!(none, Forwards::default());
    }

    #[test]
    fn glibc_reallocarray_forwards_to_realloc_through_the_plt() {
        let data = libc();
        let file = object::File::parse(&*data).unwrap();
        let resolver = CallResolver::new(&file);
        let symbol = file
            .dynamic_symbols()
            .find(|s| s.name() == Ok("reallocarray"))
            .expect("glibc 2.26+ has reallocarray");
        let section = file
            .section_by_index(symbol.section_index().unwrap())
            .unwrap();
        let start = (symbol.address() - section.address()) as usize;
        let code = &section.data().unwrap()[start..start + symbol.size() as usize];
        let forwards = resolver.forwards(code, symbol.address(), &[], |n| {
            crate::allocators::is_allocation_symbol(n, &[])
        });
        assert!(
            forwards.targets.iter().any(|t| t == "realloc"),
            "{forwards:?}"
        );
        assert!(!forwards.tail_stub, "its first instruction is a mov");
        assert!(forwards.tail, "jmp realloc@plt");
        assert_eq!(forwards.tail_targets, ["realloc"]);
    }
}
