//! Which allocation entries call other allocation entries.
//!
//! An entry that forwards (libstdc++'s `operator new` calls `malloc`, musl's `calloc`
//! calls `malloc`, jemalloc's `operator new[]` jumps to `operator new`) must not count
//! an allocation twice. Its code is decoded and every direct branch target and every
//! rip-relative indirect call or jump is resolved: to another entry of the same image
//! by address, or through a PLT stub or GOT slot to the symbol its dynamic relocation
//! names. A target that is an allocation symbol (the catalogue's, under any prefix)
//! makes the entry a forwarder.

use std::{
    cmp::Reverse,
    collections::{BinaryHeap, HashMap},
};

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

/// Sections by virtual address, looked up by binary search.
///
/// Code is looked up once per decoded instruction (every branch target, every
/// instruction a purity walk reaches): a scan of the section table for each made a file
/// with thousands of sections cost sections x instructions. The map is built once, as
/// sorted disjoint spans, each naming the section a scan in header order would have
/// found first (sections may overlap in a hostile file).
#[derive(Debug, Default)]
struct SectionMap<'data> {
    /// Sorted by start, disjoint.
    spans: Vec<Span<'data>>,
}

/// Addresses `[start, end)`, all in one section.
#[derive(Clone, Copy, Debug)]
struct Span<'data> {
    start: u64,
    end: u64,
    /// Which section (its place in the input).
    index: usize,
    /// The section's address and bytes (empty when the file holds none).
    address: u64,
    data: &'data [u8],
}

impl<'data> SectionMap<'data> {
    /// The map of `sections` (address, size, bytes), in header order; empty sections and
    /// those whose end overflows cover nothing.
    fn new(sections: impl IntoIterator<Item = (u64, u64, &'data [u8])>) -> Self {
        // (start, end, bytes, place in the input)
        let sections: Vec<(u64, u64, &[u8], usize)> = sections
            .into_iter()
            .enumerate()
            .filter_map(|(index, (address, size, data))| {
                let end = address.checked_add(size).filter(|&end| end > address)?;
                Some((address, end, data, index))
            })
            .collect();
        let mut bounds: Vec<u64> = sections.iter().flat_map(|s| [s.0, s.1]).collect();
        bounds.sort_unstable();
        bounds.dedup();
        let mut by_start: Vec<usize> = (0..sections.len()).collect();
        by_start.sort_unstable_by_key(|&i| sections[i].0);
        // Sweep: between two consecutive bounds the same sections cover every address;
        // the first of them in header order is the smallest index still open (indices
        // into `sections` keep the input's order).
        let mut open = BinaryHeap::new();
        let mut next = 0;
        let mut spans: Vec<Span> = Vec::new();
        for pair in bounds.windows(2) {
            let (start, end) = (pair[0], pair[1]);
            while next < by_start.len() && sections[by_start[next]].0 <= start {
                open.push(Reverse(by_start[next]));
                next += 1;
            }
            while open
                .peek()
                .is_some_and(|&Reverse(i)| sections[i].1 <= start)
            {
                open.pop();
            }
            let Some(&Reverse(first)) = open.peek() else {
                continue;
            };
            let (address, _, data, index) = sections[first];
            match spans.last_mut() {
                Some(last) if last.index == index && last.end == start => last.end = end,
                _ => spans.push(Span {
                    start,
                    end,
                    index,
                    address,
                    data,
                }),
            }
        }
        SectionMap { spans }
    }

    /// The span holding `address`, if a section covers it.
    fn find(&self, address: u64) -> Option<&Span<'data>> {
        let at = self.spans.partition_point(|s| s.end <= address);
        self.spans.get(at).filter(|s| s.start <= address)
    }

    /// Up to `len` bytes of the covering section's data from `address`.
    fn bytes_at(&self, address: u64, len: usize) -> Option<&'data [u8]> {
        let span = self.find(address)?;
        let start = usize::try_from(address - span.address).ok()?;
        span.data
            .get(start..span.data.len().min(start.saturating_add(len)))
    }
}

/// Resolves branch targets of one parsed file.
pub struct CallResolver<'data, 'file> {
    /// GOT slot address -> the symbol its relocation binds.
    got: HashMap<u64, String>,
    /// The PLT sections.
    plt: SectionMap<'data>,
    /// The code sections.
    text: SectionMap<'data>,
    /// Function symbols by address.
    names: HashMap<u64, String>,
    file: std::marker::PhantomData<&'file object::File<'data>>,
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
        let map = |keep: &dyn Fn(&object::Section<'data, 'file>) -> bool| {
            SectionMap::new(
                file.sections()
                    .filter(|s| keep(s))
                    .map(|s| (s.address(), s.size(), s.data().unwrap_or(&[]))),
            )
        };
        let plt = map(&|s| s.name().is_ok_and(|n| n.starts_with(".plt")));
        let text = map(&|s| s.kind() == object::SectionKind::Text);
        let names = file
            .dynamic_symbols()
            .chain(file.symbols())
            .filter(|s| s.is_definition() && s.kind() == object::SymbolKind::Text)
            .filter_map(|s| Some((s.address(), s.name().ok()?.to_string())))
            .collect();
        CallResolver {
            got,
            plt,
            text,
            names,
            file: std::marker::PhantomData,
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
        self.text.bytes_at(address, 16)
    }

    fn in_plt(&self, address: u64) -> bool {
        self.plt.find(address).is_some()
    }

    /// The symbol a PLT stub at `address` jumps to through its GOT slot.
    fn plt_symbol(&self, address: u64) -> Option<&str> {
        let code = self.plt.bytes_at(address, 32)?;
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

    /// The section map finds what a scan of the sections in header order finds, however
    /// they overlap.
    #[test]
    fn the_section_map_agrees_with_a_scan_in_header_order() {
        let bytes: Vec<u8> = (0..=255).collect();
        // (address, size): nested, overlapping, adjacent, empty, duplicated, overflowing.
        let sections = [
            (100u64, 50u64),
            (120, 10),
            (90, 20),
            (150, 30),
            (0, 500),
            (140, 0),
            (120, 10),
            (400, 20),
            (u64::MAX - 4, 10),
            (600, 5),
        ];
        let map = SectionMap::new(sections.iter().map(|&(a, n)| (a, n, &bytes[..])));
        for address in 0..700 {
            let scan = sections.iter().position(|&(a, n)| {
                a.checked_add(n)
                    .is_some_and(|end| (a..end).contains(&address))
            });
            assert_eq!(map.find(address).map(|s| s.index), scan, "at {address}");
            let expected = scan.and_then(|i| {
                let start = (address - sections[i].0) as usize;
                bytes.get(start..bytes.len().min(start + 16))
            });
            assert_eq!(map.bytes_at(address, 16), expected, "at {address}");
        }
        // Every section covering every address still makes one span each lookup finds.
        let whole: Vec<(u64, u64, &[u8])> = vec![(0, 1 << 28, &bytes[..]); 4096];
        let map = SectionMap::new(whole);
        assert_eq!(map.spans.len(), 1);
        assert_eq!(map.find((1 << 28) - 1).map(|s| s.index), Some(0));
        assert!(map.find(1 << 28).is_none());
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
