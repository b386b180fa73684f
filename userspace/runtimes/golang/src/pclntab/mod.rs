//! The function table every Go binary keeps (`.gopclntab`), stripped or not: function
//! entries and names, and per function the tables that map a pc to its file, line and
//! inlined call. Formats of Go 1.18 and 1.19 (magic `0xfffffff0`) and of Go 1.20 and
//! later (`0xfffffff1`), little-endian 64-bit, as `debug/gosym` and the runtime's
//! `symtab.go` read them.
//!
//! The file is another user's input: every offset is checked against the section,
//! every string and table walk bounded; a malformed table gives errors or `None`,
//! never a panic.

use allocbpf_images::image::GO_PCLNTAB_SECTIONS;
use object::{Object, ObjectSection, ObjectSegment};

mod pcvalue;

use pcvalue::pc_value;

/// Magic of Go 1.18 and 1.19 tables.
const MAGIC_118: u32 = 0xffff_fff0;
/// Magic of Go 1.20+ tables.
const MAGIC_120: u32 = 0xffff_fff1;

/// Longest function or file name believed.
const MAX_NAME_BYTES: usize = 4096;

/// `PCDATA_InlTreeIndex`: the pc table giving the innermost inlined call at a pc.
const PCDATA_INL_TREE_INDEX: u32 = 2;
/// `FUNCDATA_InlTree`: the function's inlined calls.
const FUNCDATA_INL_TREE: u32 = 3;

/// Offset of `text` in the runtime's `moduledata` (every version read here).
const MODULEDATA_TEXT: u64 = 0xb0;

/// Which table format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Go 1.18 and 1.19.
    Go118,
    /// Go 1.20 and later.
    Go120,
}

/// Why a table cannot be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PclntabError {
    /// The file has no `.gopclntab` section.
    #[error("no .gopclntab section")]
    Missing,
    /// Its magic is not one of the formats read here (Go 1.18+).
    #[error("a .gopclntab of magic {0:#x}, not one of Go 1.18 or later")]
    UnknownFormat(u32),
    /// Its header or function table points outside it.
    #[error(".gopclntab is malformed: {0}")]
    Malformed(&'static str),
}

/// A function of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Func {
    /// Its entry address (in the file's addresses).
    pub entry: u64,
    /// Where its `_func` record is in the function data.
    record: usize,
}

/// Where a pc is in the source: the function (the innermost inlined one at that pc),
/// its file and line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    /// Function name (`main.allocSmall`, `runtime.mallocgc`).
    pub function: String,
    /// Source file.
    pub file: Option<String>,
    /// Line.
    pub line: Option<u32>,
}

/// Most bytes of the inline trees' area (`go:func.*`) kept.
const MAX_GOFUNC_BYTES: usize = 64 << 20;

/// A parsed table: its own copy of `.gopclntab` (and of the inline trees' area), so
/// that the file it came from need not be kept.
pub struct Pclntab {
    format: Format,
    quantum: u64,
    nfunc: usize,
    text_start: u64,
    /// The section's bytes.
    table: Vec<u8>,
    /// Where each sub-table starts in `table`.
    funcnames: usize,
    cutab: usize,
    filetab: usize,
    pctab: usize,
    /// The function table, followed by the `_func` records it points into.
    funcdata: usize,
    /// The file's bytes at `moduledata.gofunc` onwards (inlining trees), when found.
    gofunc: Option<Vec<u8>>,
}

impl Pclntab {
    /// The table of `file`.
    pub fn parse(file: &object::File) -> Result<Self, PclntabError> {
        let section = GO_PCLNTAB_SECTIONS
            .iter()
            .find_map(|name| file.section_by_name(name))
            .ok_or(PclntabError::Missing)?;
        let data = section
            .data()
            .map_err(|_| PclntabError::Malformed("unreadable"))?;
        let word = |index: usize| read_u64(data, 8 + 8 * index);
        let magic = read_u32(data, 0).ok_or(PclntabError::Malformed("short header"))?;
        let format = match magic {
            MAGIC_118 => Format::Go118,
            MAGIC_120 => Format::Go120,
            other => return Err(PclntabError::UnknownFormat(other)),
        };
        if data.get(4..8) != Some(&[0, 0, 1, 8][..]) {
            return Err(PclntabError::Malformed(
                "not amd64 (pc quantum 1, 8-byte pointers)",
            ));
        }
        let bad = PclntabError::Malformed("header offsets");
        let offset = |index: usize| -> Result<usize, PclntabError> {
            let offset =
                usize::try_from(word(index).ok_or(bad.clone())?).map_err(|_| bad.clone())?;
            (offset <= data.len()).then_some(offset).ok_or(bad.clone())
        };
        let funcdata = offset(7)?;
        // nfunc + 1 entries of 8 bytes must fit (checked: a forged count must not wrap).
        let nfunc = usize::try_from(word(0).ok_or(bad.clone())?).map_err(|_| bad.clone())?;
        let table_bytes = nfunc.checked_add(1).and_then(|n| n.checked_mul(8));
        if table_bytes.is_none_or(|bytes| bytes > data.len() - funcdata) {
            return Err(PclntabError::Malformed("function table"));
        }
        let relocated = Relocated::of(file);
        let moduledata = module_data(file, section.address(), &relocated);
        let field = |at: u64| relocated.word(file, moduledata?.checked_add(at)?);
        let text_start = match word(2).ok_or(bad.clone())? {
            0 => field(MODULEDATA_TEXT)
                .filter(|&t| t != 0)
                .or_else(|| file.section_by_name(".text").map(|s| s.address()))
                .ok_or(PclntabError::Malformed("no text start"))?,
            text => text,
        };
        let gofunc_field = match format {
            Format::Go118 => 0x130,
            Format::Go120 => 0x140,
        };
        let gofunc = field(gofunc_field)
            .and_then(|address| bytes_at(file, address))
            .map(|bytes| bytes[..bytes.len().min(MAX_GOFUNC_BYTES)].to_vec());
        Ok(Pclntab {
            format,
            quantum: 1,
            nfunc,
            text_start,
            funcnames: offset(3)?,
            cutab: offset(4)?,
            filetab: offset(5)?,
            pctab: offset(6)?,
            funcdata,
            table: data.to_vec(),
            gofunc,
        })
    }

    fn funcnames(&self) -> &[u8] {
        &self.table[self.funcnames..]
    }

    fn cutab(&self) -> &[u8] {
        &self.table[self.cutab..]
    }

    fn filetab(&self) -> &[u8] {
        &self.table[self.filetab..]
    }

    fn pctab(&self) -> &[u8] {
        &self.table[self.pctab..]
    }

    fn funcdata(&self) -> &[u8] {
        &self.table[self.funcdata..]
    }

    /// The table's format.
    pub fn format(&self) -> Format {
        self.format
    }

    /// Number of functions.
    pub fn len(&self) -> usize {
        self.nfunc
    }

    /// True if the table has no function.
    pub fn is_empty(&self) -> bool {
        self.nfunc == 0
    }

    /// The `index`th function table entry: (entry offset, record offset).
    fn entry(&self, index: usize) -> Option<(u32, u32)> {
        Some((
            read_u32(self.funcdata(), 8 * index)?,
            read_u32(self.funcdata(), 8 * index + 4)?,
        ))
    }

    /// The `index`th function.
    fn func(&self, index: usize) -> Option<Func> {
        let (entry, record) = self.entry(index)?;
        Some(Func {
            // The text start is the file's to forge: an entry past the top of the
            // address space wraps (and names nothing), it does not stop the reader.
            entry: self.text_start.wrapping_add(u64::from(entry)),
            record: record as usize,
        })
    }

    /// Every function.
    pub fn functions(&self) -> impl Iterator<Item = Func> + '_ {
        (0..self.nfunc).filter_map(|i| self.func(i))
    }

    /// The function named `name` (a linear search: for the few the reader needs).
    pub fn find(&self, name: &str) -> Option<Func> {
        self.functions()
            .find(|f| self.name(f).as_deref() == Some(name))
    }

    /// The function whose code holds `pc`.
    pub fn func_at(&self, pc: u64) -> Option<Func> {
        let offset = pc.checked_sub(self.text_start)?;
        let offset = u32::try_from(offset).ok()?;
        // The last function whose entry is at or before `pc` (the table is sorted and
        // ends with the end of the text).
        let (mut lo, mut hi) = (0usize, self.nfunc);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.entry(mid)?.0 <= offset {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let index = lo.checked_sub(1)?;
        let end = self.entry(index + 1)?.0;
        (offset < end).then(|| self.func(index)).flatten()
    }

    /// The size of `func`'s code (to the next function's entry).
    pub fn size(&self, func: &Func) -> Option<u64> {
        let offset = u32::try_from(func.entry.checked_sub(self.text_start)?).ok()?;
        let index = (0..self.nfunc).find(|&i| self.entry(i).map(|e| e.0) == Some(offset))?;
        Some(u64::from(self.entry(index + 1)?.0.checked_sub(offset)?))
    }

    /// A field of `func`'s `_func` record, as an u32 at `offset`.
    fn field(&self, func: &Func, offset: usize) -> Option<u32> {
        read_u32(self.funcdata(), func.record.checked_add(offset)?)
    }

    /// The size of the record's fixed part (where its pcdata offsets start).
    fn fixed_size(&self) -> usize {
        match self.format {
            Format::Go118 => 40,
            Format::Go120 => 44,
        }
    }

    /// `npcdata` and `nfuncdata` of `func`.
    fn data_counts(&self, func: &Func) -> Option<(u32, u32)> {
        let npcdata = self.field(func, 28)?;
        let nfuncdata_at = self.fixed_size() - 1;
        let nfuncdata = *self
            .funcdata()
            .get(func.record.checked_add(nfuncdata_at)?)?;
        Some((npcdata, u32::from(nfuncdata)))
    }

    /// The name of `func`.
    pub fn name(&self, func: &Func) -> Option<String> {
        c_string(self.funcnames(), self.field(func, 4)? as usize)
    }

    /// Where `pc` (an address inside `func`, not a return address) is: the innermost
    /// function inlined there, its file and line.
    pub fn location(&self, func: &Func, pc: u64) -> Option<Location> {
        let file = self.file_at(func, pc);
        let line = self.value_at(func, self.field(func, 24)?, pc);
        let function = self.inlined_name(func, pc).or_else(|| self.name(func))?;
        Some(Location {
            function,
            file,
            line: line.and_then(|l| u32::try_from(l).ok()),
        })
    }

    /// The value of the pc table at `offset` (into `pctab`) for `pc` in `func`.
    fn value_at(&self, func: &Func, offset: u32, pc: u64) -> Option<i64> {
        if offset == 0 {
            return None;
        }
        pc_value(
            self.pctab().get(offset as usize..)?,
            func.entry,
            pc,
            self.quantum,
        )
    }

    /// The file of `pc` in `func`.
    fn file_at(&self, func: &Func, pc: u64) -> Option<String> {
        let index = self.value_at(func, self.field(func, 20)?, pc)?;
        let cu = self.field(func, 32)? as usize;
        let slot = cu.checked_add(usize::try_from(index).ok()?)?;
        let offset = read_u32(self.cutab(), slot.checked_mul(4)?)?;
        c_string(self.filetab(), offset as usize)
    }

    /// The name of the innermost call inlined at `pc` in `func`, if any.
    fn inlined_name(&self, func: &Func, pc: u64) -> Option<String> {
        let (npcdata, nfuncdata) = self.data_counts(func)?;
        if npcdata <= PCDATA_INL_TREE_INDEX || nfuncdata <= FUNCDATA_INL_TREE {
            return None;
        }
        let fixed = self.fixed_size();
        let pcdata = self.field(func, fixed + 4 * PCDATA_INL_TREE_INDEX as usize)?;
        let index = self.value_at(func, pcdata, pc)?;
        if index < 0 {
            return None;
        }
        let funcdata_at = fixed + 4 * npcdata as usize + 4 * FUNCDATA_INL_TREE as usize;
        let tree = self.field(func, funcdata_at)?;
        if tree == u32::MAX {
            return None;
        }
        let tree = self.gofunc.as_deref()?.get(tree as usize..)?;
        let index = usize::try_from(index).ok()?;
        let name_offset = match self.format {
            // funcID u8, pad [3]u8, nameOff i32, parentPc i32, startLine i32
            Format::Go120 => read_u32(tree, index.checked_mul(16)?.checked_add(4)?)?,
            // parent i16, funcID u8, pad u8, file i32, line i32, func_ i32, parentPc i32
            Format::Go118 => read_u32(tree, index.checked_mul(20)?.checked_add(12)?)?,
        };
        c_string(self.funcnames(), name_offset as usize)
    }
}

/// The address of the runtime's `moduledata` in `file` (its first word points to the
/// pc table at `pclntab`): the `.go.module` section (Go 1.26+), else the first such
/// word in `.noptrdata` or `.data` (as the file holds it, or as a relocation of a
/// position-independent file sets it).
fn module_data(file: &object::File, pclntab: u64, relocated: &Relocated) -> Option<u64> {
    if let Some(section) = file.section_by_name(".go.module") {
        if relocated.word(file, section.address()) == Some(pclntab) {
            return Some(section.address());
        }
    }
    [".noptrdata", ".data"].iter().find_map(|name| {
        let section = file.section_by_name(name)?;
        let data = section.data().ok()?;
        let position = data
            .chunks_exact(8)
            .position(|word| u64::from_le_bytes(word.try_into().unwrap_or_default()) == pclntab);
        let range = section.address()..section.address().saturating_add(section.size());
        position
            .map(|p| section.address() + p as u64 * 8)
            .or_else(|| relocated.address_of(pclntab, &range))
    })
}

/// A position-independent file's `R_X86_64_RELATIVE` relocations: what the loader
/// writes at an address (the file holds 0 there).
struct Relocated {
    /// (address, value), sorted by address.
    values: Vec<(u64, u64)>,
}

impl Relocated {
    /// Most relocations kept (a Go binary has tens of thousands).
    const MAX: usize = 1 << 22;

    fn of(file: &object::File) -> Relocated {
        let mut values: Vec<(u64, u64)> = file
            .dynamic_relocations()
            .into_iter()
            .flatten()
            .filter(|(_, r)| {
                r.flags()
                    == object::RelocationFlags::Elf {
                        r_type: object::elf::R_X86_64_RELATIVE,
                    }
            })
            .take(Self::MAX)
            .map(|(address, r)| (address, r.addend() as u64))
            .collect();
        values.sort_unstable();
        Relocated { values }
    }

    /// The word at `address`: the file's, or the relocation's where the file has 0.
    fn word(&self, file: &object::File, address: u64) -> Option<u64> {
        let stored = bytes_at(file, address).and_then(|b| read_u64(b, 0));
        match stored {
            Some(value) if value != 0 => Some(value),
            _ => self
                .values
                .binary_search_by_key(&address, |&(a, _)| a)
                .ok()
                .map(|i| self.values[i].1)
                .or(stored),
        }
    }

    /// The first address in `range` a relocation sets to `value`.
    fn address_of(&self, value: u64, range: &std::ops::Range<u64>) -> Option<u64> {
        self.values
            .iter()
            .find(|&&(address, v)| v == value && range.contains(&address))
            .map(|&(address, _)| address)
    }
}

/// The file's bytes from virtual address `address` to its segment's end.
fn bytes_at<'data>(file: &object::File<'data>, address: u64) -> Option<&'data [u8]> {
    file.segments().find_map(|segment| {
        let start = segment.address();
        if !(start..start.saturating_add(segment.size())).contains(&address) {
            return None;
        }
        segment.data().ok()?.get((address - start) as usize..)
    })
}

/// The NUL-terminated string at `offset` of `table`, at most [`MAX_NAME_BYTES`].
fn c_string(table: &[u8], offset: usize) -> Option<String> {
    let bytes = table.get(offset..)?;
    let bytes = &bytes[..bytes.len().min(MAX_NAME_BYTES)];
    let end = bytes.iter().position(|&b| b == 0)?;
    Some(String::from_utf8_lossy(&bytes[..end]).into_owned())
}

fn read_u32(data: &[u8], offset: usize) -> Option<u32> {
    Some(u32::from_le_bytes(
        data.get(offset..offset.checked_add(4)?)?.try_into().ok()?,
    ))
}

fn read_u64(data: &[u8], offset: usize) -> Option<u64> {
    Some(u64::from_le_bytes(
        data.get(offset..offset.checked_add(8)?)?.try_into().ok()?,
    ))
}

#[cfg(test)]
mod tests;
