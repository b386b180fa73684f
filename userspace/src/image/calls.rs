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

use iced_x86::{
    Decoder, DecoderOptions, Instruction, InstructionInfoFactory, Mnemonic, OpAccess, OpKind,
    Register,
};
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
    /// It only ever tail-jumps to them: no call to them, no call or jump to anything
    /// else (but `__errno_location`), no memory write but to its stack or to TLS
    /// (errno). Such an entry cannot allocate by itself (allocating updates allocator
    /// state), so every allocation it makes is counted where its jump lands (glibc's
    /// `reallocarray` is `mul; jo; jmp realloc`).
    pub pure_tail: bool,
}

/// Resolves branch targets of one parsed file.
pub struct CallResolver<'data, 'file> {
    file: &'file object::File<'data>,
    /// GOT slot address -> the symbol its relocation binds.
    got: HashMap<u64, String>,
    /// `[start, end)` of the PLT sections.
    plt: Vec<(u64, u64)>,
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
        CallResolver { file, got, plt }
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
        let own_code = address..address + code.len() as u64;
        let mut decoder = Decoder::with_ip(64, code, address, DecoderOptions::NONE);
        let mut info = InstructionInfoFactory::new();
        let mut out = Forwards::default();
        let mut first = true;
        // Anything that may allocate by itself, or a forward reached by a call.
        let mut not_pure = false;
        while decoder.can_decode() {
            let instruction = decoder.decode();
            if instruction.is_invalid() {
                not_pure = true;
                break;
            }
            not_pure |= info.info(&instruction).used_memory().iter().any(|memory| {
                matches!(
                    memory.access(),
                    OpAccess::Write
                        | OpAccess::CondWrite
                        | OpAccess::ReadWrite
                        | OpAccess::ReadCondWrite
                ) && memory.segment() != Register::FS
                    && memory.base() != Register::RSP
            });
            let branch = instruction.is_call_near()
                || instruction.is_jmp_short_or_near()
                || instruction.is_jcc_short_or_near();
            let target = if branch {
                let to = instruction.near_branch_target();
                if to != address && entries.contains(&to) {
                    Some(format!("{to:#x}"))
                } else if self.plt.iter().any(|(lo, hi)| (*lo..*hi).contains(&to)) {
                    self.plt_symbol(to)
                        .filter(|name| is_allocation(name))
                        .map(str::to_string)
                } else {
                    None
                }
            } else if instruction.is_call_near_indirect() || instruction.is_jmp_near_indirect() {
                self.got_symbol(&instruction)
                    .filter(|name| is_allocation(name))
                    .map(str::to_string)
            } else {
                None
            };
            let is_call = instruction.is_call_near() || instruction.is_call_near_indirect();
            if let Some(target) = target {
                let unconditional =
                    instruction.is_jmp_short_or_near() || instruction.is_jmp_near_indirect();
                out.tail_stub |= first && unconditional;
                out.tail |= !is_call;
                not_pure |= is_call;
                if !out.targets.contains(&target) {
                    out.targets.push(target);
                }
            } else if is_call {
                not_pure |= !self.calls_errno_location(&instruction);
            } else if branch {
                not_pure |= !own_code.contains(&instruction.near_branch_target());
            } else if instruction.is_jmp_near_indirect() {
                not_pure = true;
            }
            first = false;
        }
        out.pure_tail = !out.targets.is_empty() && !not_pure;
        out
    }

    /// True for a call to `__errno_location` (through the PLT or the GOT), which
    /// allocates nothing.
    fn calls_errno_location(&self, instruction: &Instruction) -> bool {
        let symbol = if instruction.is_call_near() {
            let to = instruction.near_branch_target();
            self.plt
                .iter()
                .any(|(lo, hi)| (*lo..*hi).contains(&to))
                .then(|| self.plt_symbol(to))
                .flatten()
        } else {
            self.got_symbol(instruction)
        };
        symbol == Some("__errno_location")
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
    fn a_store_or_another_call_means_it_may_allocate_itself() {
        let data = libc();
        let file = object::File::parse(&*data).unwrap();
        let resolver = CallResolver::new(&file);
        // mov %rdi,(%rax) ; jmp 0x2000 (an entry)
        let store = [0x48, 0x89, 0x38, 0xe9, 0xf8, 0x0f, 0x00, 0x00];
        let forwards = resolver.forwards(&store, 0x1000, &[0x1000, 0x2000], |_| true);
        assert_eq!(forwards.targets, ["0x2000"]);
        assert!(forwards.tail && !forwards.pure_tail);
        // call 0x3000 (not an entry) ; jmp 0x2000
        let call = [0xe8, 0xfb, 0x1f, 0x00, 0x00, 0xe9, 0xf6, 0x0f, 0x00, 0x00];
        let forwards = resolver.forwards(&call, 0x1000, &[0x1000, 0x2000], |_| true);
        assert!(forwards.tail && !forwards.pure_tail, "{forwards:?}");
        // push %rax ; jmp 0x2000: a stack write only
        let push = [0x50, 0xe9, 0xfa, 0x0f, 0x00, 0x00];
        let forwards = resolver.forwards(&push, 0x1000, &[0x1000, 0x2000], |_| true);
        assert!(forwards.pure_tail, "{forwards:?}");
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
        // mov; mul; mov; jo; jmp realloc@plt; errno = ENOMEM (a TLS write); ret.
        assert!(forwards.pure_tail, "{forwards:?}");
    }
}
