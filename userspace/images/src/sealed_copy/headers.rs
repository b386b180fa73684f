//! The ELF headers of a file, read with bounded positioned reads and checked: what a
//! copy is planned from, and what it holds (patched) in place of the file's own.

use std::{fs::File, ops::Range, os::unix::fs::FileExt};

use crate::elf_header::ElfHeader;
pub(super) use crate::elf_header::{u32_at, u64_at};

use super::{
    CopyError, EHDR, ET_DYN, ET_EXEC, LINKS, MAX_PROGRAM_HEADERS, MAX_SECTIONS, MAX_SECTION_NAMES,
    PHDR, PN_XNUM, SHDR, SHF_COMPRESSED, SHT_NOBITS,
};

/// The headers of a file as read (and, for the copy, as patched).
#[derive(Clone, Debug)]
pub(super) struct Headers {
    pub(super) size: u64,
    pub(super) header: Vec<u8>,
    pub(super) phoff: u64,
    pub(super) phdrs: Vec<u8>,
    pub(super) shoff: u64,
    pub(super) shdrs: Vec<u8>,
    pub(super) names_at: u64,
    pub(super) names: Vec<u8>,
}

pub(super) fn set_u64(bytes: &mut [u8], at: usize, value: u64) {
    bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
}

/// `start..start + len` if it lies inside a file of `size` bytes.
pub(super) fn within(start: u64, len: u64, size: u64) -> Option<Range<u64>> {
    let end = start.checked_add(len)?;
    (end <= size).then_some(start..end)
}

/// `len` bytes of `file` at `at`, if they lie inside its `size` bytes.
pub(super) fn read_range(file: &File, at: u64, len: u64, size: u64) -> Result<Vec<u8>, CopyError> {
    within(at, len, size).ok_or(CopyError::Refused("headers outside the file"))?;
    let mut bytes = vec![0u8; len as usize];
    file.read_exact_at(&mut bytes, at)
        .map_err(CopyError::Read)?;
    Ok(bytes)
}

/// The NUL-terminated name at `at` in a string table (empty if out of it).
pub(super) fn name_at(names: &[u8], at: u64) -> &[u8] {
    let name = names.get(at as usize..).unwrap_or(&[]);
    &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())]
}

/// The ELF header of a 64-bit little-endian file, if it is one: its bytes and fields.
pub(super) fn elf_header(file: &File, size: u64) -> Result<(Vec<u8>, ElfHeader), CopyError> {
    if size < EHDR {
        return Err(CopyError::Refused("shorter than an ELF header"));
    }
    let bytes = read_range(file, 0, EHDR, size)?;
    let header = ElfHeader::parse(&bytes)
        .ok_or(CopyError::Refused("not a 64-bit little-endian ELF file"))?;
    Ok((bytes, header))
}

impl Headers {
    /// Reads and checks the headers of `file`, `size` bytes long.
    pub(super) fn read(file: &File, size: u64) -> Result<Headers, CopyError> {
        let (header, fields) = elf_header(file, size)?;
        if !matches!(fields.e_type, ET_EXEC | ET_DYN) {
            return Err(CopyError::Refused("not an executable or shared object"));
        }
        let (phoff, phentsize, phnum) = (fields.phoff, fields.phentsize, fields.phnum);
        let (shoff, shentsize, shnum, shstrndx) = (
            fields.shoff,
            fields.shentsize,
            fields.shnum,
            fields.shstrndx,
        );
        // Extended numbering (phnum PN_XNUM, shnum 0) is refused with the rest.
        if phnum == PN_XNUM || phnum > MAX_PROGRAM_HEADERS || (phnum > 0 && phentsize != PHDR) {
            return Err(CopyError::Refused("unusual program headers"));
        }
        if shentsize != SHDR || shnum == 0 || shnum > MAX_SECTIONS || shstrndx >= shnum {
            return Err(CopyError::Refused("unusual section headers"));
        }
        let phdrs = match phnum {
            0 => Vec::new(),
            _ => read_range(file, phoff, phnum * PHDR, size)?,
        };
        for i in 0..phnum as usize {
            let phdr = &phdrs[i * PHDR as usize..][..PHDR as usize];
            // blazesym adds these: no wrap-around.
            let (offset, filesz) = (u64_at(phdr, 8), u64_at(phdr, 32));
            let (vaddr, memsz) = (u64_at(phdr, 16), u64_at(phdr, 40));
            if offset.checked_add(filesz).is_none() || vaddr.checked_add(memsz).is_none() {
                return Err(CopyError::Refused("program header ranges wrap around"));
            }
        }
        let shdrs = read_range(file, shoff, shnum * SHDR, size)?;
        let names_header = &shdrs[(shstrndx * SHDR) as usize..][..SHDR as usize];
        let (names_at, names_len) = (u64_at(names_header, 0x18), u64_at(names_header, 0x20));
        if u32_at(names_header, 4) == SHT_NOBITS
            || u64_at(names_header, 8) & SHF_COMPRESSED != 0
            || names_len > MAX_SECTION_NAMES
        {
            return Err(CopyError::Refused("unusual section names"));
        }
        let names = read_range(file, names_at, names_len, size)?;
        // The header, the tables and the names are written into the copy as parsed
        // here: they must not overlap, or one would overwrite another.
        let regions = [
            0..EHDR,
            phoff..phoff + phnum * PHDR,
            shoff..shoff + shnum * SHDR,
            names_at..names_at + names_len,
        ];
        for (i, a) in regions.iter().enumerate() {
            for b in &regions[i + 1..] {
                if !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end {
                    return Err(CopyError::Refused("headers overlap"));
                }
            }
        }
        Ok(Headers {
            size,
            header,
            phoff,
            phdrs,
            shoff,
            shdrs,
            names_at,
            names,
        })
    }

    pub(super) fn sections(&self) -> usize {
        self.shdrs.len() / SHDR as usize
    }

    pub(super) fn section(&self, i: usize) -> &[u8] {
        &self.shdrs[i * SHDR as usize..][..SHDR as usize]
    }

    pub(super) fn section_mut(&mut self, i: usize) -> &mut [u8] {
        &mut self.shdrs[i * SHDR as usize..][..SHDR as usize]
    }

    pub(super) fn name(&self, i: usize) -> &[u8] {
        name_at(&self.names, u32_at(self.section(i), 0))
    }

    /// Hides section `i` from every reader: renamed (`.x` becomes `Xx`: no name
    /// blazesym looks up has an `X`) and marked uncompressed (its bytes, zeros or
    /// whatever was copied, are never inflated).
    pub(super) fn neutralize(&mut self, i: usize) {
        let at = u32_at(self.section(i), 0) as usize;
        if let Some(first) = self.names.get_mut(at).filter(|b| **b != 0) {
            *first = b'X';
        }
        let header = self.section_mut(i);
        let flags = u64_at(header, 8) & !SHF_COMPRESSED;
        set_u64(header, 8, flags);
    }

    /// Nothing left that links elsewhere or is compressed (checked on what is written).
    pub(super) fn check_neutral(&self) -> Result<(), CopyError> {
        for i in 0..self.sections() {
            if LINKS.contains(&self.name(i)) || u64_at(self.section(i), 8) & SHF_COMPRESSED != 0 {
                return Err(CopyError::Refused("a link or compressed section is left"));
            }
        }
        Ok(())
    }

    /// Header bytes written into the copy.
    pub(super) fn bytes(&self) -> u64 {
        (self.header.len() + self.phdrs.len() + self.shdrs.len() + self.names.len()) as u64
    }
}
