//! What a copy does with each section of a file: symbol and string tables and notes
//! are copied always, DWARF when it fits (inflated if zlib-compressed), and links and
//! compressed sections nothing inflates are renamed (module docs of [`super`]).

use std::{fs::File, ops::Range, os::unix::fs::FileExt};

use super::headers::{u32_at, u64_at, within, Headers};
use super::{
    CopyError, CHDR, ELFCOMPRESS_ZLIB, LINKS, MAX_COPY_BYTES, MAX_NOTE_BYTES, SHF_COMPRESSED,
    SHT_NOBITS, SHT_NOTE, SYMBOLS, UNREAD_DEBUG,
};

/// What symbolization does with a section.
enum Class {
    Link,
    Symbols,
    Note,
    Dwarf,
    Other,
}

/// The class of the section named `name`, of type `kind`.
fn classify(name: &[u8], kind: u64) -> Class {
    if LINKS.contains(&name) {
        Class::Link
    } else if SYMBOLS.contains(&name) {
        Class::Symbols
    } else if name.starts_with(b".debug_") && !UNREAD_DEBUG.contains(&name) {
        Class::Dwarf
    } else if kind == SHT_NOTE {
        Class::Note
    } else {
        Class::Other
    }
}

/// A file's sections by what its copy does with them.
pub(super) struct Sections {
    /// Ranges of the file every copy holds: symbol and string tables, notes.
    pub symbols: Vec<Range<u64>>,
    /// Uncompressed DWARF sections (index, range): copied if they fit.
    pub dwarf: Vec<(usize, Range<u64>)>,
    /// zlib-compressed DWARF sections (index, compressed bytes, inflated size):
    /// inflated into the copy if they fit.
    pub compressed_dwarf: Vec<(usize, Range<u64>, u64)>,
    /// Sections renamed in the copy (links, compressed sections not inflated).
    pub neutral: Vec<usize>,
}

impl Sections {
    /// Sorts the sections `elf` declares in `file` (of `size` bytes); refuses a file
    /// whose symbol tables lie outside it.
    pub(super) fn sort(file: &File, elf: &Headers, size: u64) -> Result<Sections, CopyError> {
        let mut symbols = Vec::new();
        let mut dwarf = Vec::new();
        let mut compressed_dwarf = Vec::new();
        let mut neutral = Vec::new();
        for i in 0..elf.sections() {
            let header = elf.section(i);
            let (kind, flags) = (u32_at(header, 4), u64_at(header, 8));
            let (offset, len) = (u64_at(header, 0x18), u64_at(header, 0x20));
            let compressed = flags & SHF_COMPRESSED != 0;
            let range = within(offset, len, size).filter(|_| kind != SHT_NOBITS);
            match classify(elf.name(i), kind) {
                Class::Link => neutral.push(i),
                Class::Other | Class::Symbols | Class::Note if compressed => neutral.push(i),
                Class::Other => {}
                // No bytes: nothing read, whatever its flags; hidden if compressed.
                _ if kind == SHT_NOBITS => {
                    if compressed {
                        neutral.push(i);
                    }
                }
                Class::Symbols => symbols
                    .push(range.ok_or(CopyError::Refused("a symbol table lies outside the file"))?),
                Class::Note => {
                    if let Some(range) = range.filter(|_| len <= MAX_NOTE_BYTES) {
                        symbols.push(range);
                    }
                }
                Class::Dwarf => match range {
                    Some(range) if compressed => match compression(file, &range)? {
                        Some(size) => {
                            compressed_dwarf.push((i, range.start + CHDR..range.end, size))
                        }
                        None => neutral.push(i),
                    },
                    Some(range) => dwarf.push((i, range)),
                    None => neutral.push(i),
                },
            }
        }
        Ok(Sections {
            symbols,
            dwarf,
            compressed_dwarf,
            neutral,
        })
    }
}

/// The inflated size of the zlib-compressed section at `range` of `file`, if it is
/// zlib and could fit in a copy (`None`: the section is not kept).
fn compression(file: &File, range: &Range<u64>) -> Result<Option<u64>, CopyError> {
    if range.end - range.start < CHDR {
        return Ok(None);
    }
    let mut header = [0u8; CHDR as usize];
    file.read_exact_at(&mut header, range.start)
        .map_err(CopyError::Read)?;
    let (kind, size) = (u32_at(&header, 0), u64_at(&header, 8));
    Ok((kind == ELFCOMPRESS_ZLIB && size > 0 && size <= MAX_COPY_BYTES).then_some(size))
}
