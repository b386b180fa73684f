//! Build ids read from a file's notes with bounded positioned reads: nothing mapped.

use std::fs::File;

use super::headers::{elf_header, read_range, u32_at, u64_at};
use super::{
    MAX_BUILD_ID_BYTES, MAX_NOTES_READ, MAX_NOTE_BYTES, MAX_PROGRAM_HEADERS, MAX_SECTIONS,
    NT_GNU_BUILD_ID, PHDR, PT_NOTE, SHDR, SHF_COMPRESSED, SHT_NOTE,
};

/// The GNU build id of `file` (opened by [`crate::procfs::open_mapped`]): the
/// `NT_GNU_BUILD_ID` note named `GNU` in its note segments, else in its note sections,
/// read with bounded positioned reads (nothing mapped, at most `MAX_NOTES_READ` note
/// bytes). `None` if it has none, or is not a 64-bit little-endian ELF file. Metadata
/// for reports only: anyone can put any build id in a file of theirs, so it never
/// identifies a file.
pub fn read_build_id(file: &File) -> Option<Vec<u8>> {
    let size = file.metadata().ok()?.len();
    let (_, header) = elf_header(file, size).ok()?;
    let mut budget = MAX_NOTES_READ;
    let mut notes_at = |offset: u64, len: u64, align: u64| -> Option<Vec<u8>> {
        if len > MAX_NOTE_BYTES || len > budget {
            return None;
        }
        budget -= len;
        let notes = read_range(file, offset, len, size).ok()?;
        gnu_build_id(&notes, if align == 8 { 8 } else { 4 })
    };
    let (phoff, phentsize, phnum) = (header.phoff, header.phentsize, header.phnum);
    if phentsize == PHDR && phnum <= MAX_PROGRAM_HEADERS {
        if let Ok(phdrs) = read_range(file, phoff, phnum * PHDR, size) {
            for phdr in phdrs.chunks_exact(PHDR as usize) {
                if u32_at(phdr, 0) != PT_NOTE {
                    continue;
                }
                let (offset, len, align) = (u64_at(phdr, 8), u64_at(phdr, 32), u64_at(phdr, 48));
                if let Some(id) = notes_at(offset, len, align) {
                    return Some(id);
                }
            }
        }
    }
    let (shoff, shentsize, shnum) = (header.shoff, header.shentsize, header.shnum);
    if shentsize == SHDR && shnum <= MAX_SECTIONS {
        let shdrs = read_range(file, shoff, shnum * SHDR, size).ok()?;
        for shdr in shdrs.chunks_exact(SHDR as usize) {
            if u32_at(shdr, 4) != SHT_NOTE || u64_at(shdr, 8) & SHF_COMPRESSED != 0 {
                continue;
            }
            let (offset, len, align) = (u64_at(shdr, 0x18), u64_at(shdr, 0x20), u64_at(shdr, 0x30));
            if let Some(id) = notes_at(offset, len, align) {
                return Some(id);
            }
        }
    }
    None
}

/// The descriptor of the first `GNU` `NT_GNU_BUILD_ID` note in `notes` (a note
/// segment or section whose entries are aligned to `align` bytes).
pub(super) fn gnu_build_id(mut notes: &[u8], align: usize) -> Option<Vec<u8>> {
    let up = |at: usize| at.checked_next_multiple_of(align);
    while notes.len() >= 12 {
        let (namesz, descsz, kind) = (u32_at(notes, 0), u32_at(notes, 4), u32_at(notes, 8));
        let name_end = 12usize.checked_add(usize::try_from(namesz).ok()?)?;
        let desc_start = up(name_end)?;
        let desc_end = desc_start.checked_add(usize::try_from(descsz).ok()?)?;
        if desc_end > notes.len() {
            return None;
        }
        if kind == NT_GNU_BUILD_ID && notes[12..name_end] == *b"GNU\0" {
            let id = &notes[desc_start..desc_end];
            return (!id.is_empty() && id.len() <= MAX_BUILD_ID_BYTES).then(|| id.to_vec());
        }
        notes = notes.get(up(desc_end)?..).unwrap_or(&[]);
    }
    None
}
