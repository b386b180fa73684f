//! Sealed copies of mapped ELF files for the symbolizer, and build ids read without one.
//!
//! blazesym maps every ELF file it reads into memory, follows the debug links it finds
//! in them, and trusts their headers: given another user's file, its owner could
//! truncate it under the mapping (`SIGBUS` kills the profiler), name a FIFO in its
//! `.gnu_debuglink` (blazesym looks next to the file, under `/usr/lib/debug` and in
//! `.build-id` directories, and opens what it finds with a blocking `open`: a FIFO
//! never returns), point its `.gnu_debugaltlink` or `.debug_sup` anywhere, or declare
//! a compressed section of any decompressed size (`SHF_COMPRESSED`: blazesym reserves
//! the header's `ch_size`, and inflates without a limit).
//!
//! So blazesym never reads a file another user controls. It reads a [`SealedCopy`]: an
//! anonymous memory file of ours (`memfd`) the size of the original, holding only what
//! symbolization reads (the ELF header, the program and section header tables, the
//! section names, the symbol and string tables, note sections and the DWARF sections
//! that name functions and lines; everything else reads as zeros and takes no memory),
//! copied with positioned reads of bounded length from a descriptor opened by
//! [`crate::procfs::open_mapped`], then sealed: nobody can shrink, grow or write it,
//! so it cannot change under blazesym's mapping. In the copy:
//! - `.gnu_debuglink`, `.gnu_debugaltlink`, `.gnu_debugdata` and `.debug_sup` are
//!   renamed (their first byte becomes `X`): blazesym finds no link to follow;
//! - zlib-compressed DWARF sections are inflated here, into the copy, up to the bytes
//!   their header declares and within the copy's cap ([`MAX_COPY_BYTES`]), and appear
//!   uncompressed; any other compressed section (zstd, a failed inflate, a symbol table,
//!   a note) is renamed and marked uncompressed, so no `SHF_COMPRESSED` flag is left;
//! - the headers and names are the very bytes parsed and checked here, written last,
//!   so nothing read from the file afterwards can change them.
//!
//! Only 64-bit little-endian executables and shared objects (`ET_EXEC`, `ET_DYN`) are
//! copied: relocatable objects would make blazesym apply their relocations.
//!
//! [`read_build_id`] reads a file's GNU build id from its note segments or sections
//! with bounded positioned reads: nothing is mapped.

use std::{
    ffi::CStr,
    fs::File,
    io::{self, Read},
    ops::Range,
    os::{
        fd::{AsRawFd, FromRawFd},
        unix::fs::{FileExt, MetadataExt},
    },
    path::PathBuf,
};

use crate::procfs::MAX_MAPPED_FILE_BYTES;

/// Bytes a copy holds at most: copied ranges, inflated sections and headers. Symbol
/// tables are a few MB even for large programs; DWARF can be hundreds: a file whose
/// debug sections would take the copy past this is copied without them (symbols, no
/// line numbers), one whose symbol tables alone exceed it is not copied.
pub const MAX_COPY_BYTES: u64 = 256 << 20;

/// Section headers accepted at most (linked programs have tens; 256 KiB of headers).
pub const MAX_SECTIONS: u64 = 4096;

/// Program headers accepted at most (linked programs have about ten).
pub const MAX_PROGRAM_HEADERS: u64 = 1024;

/// Section-name string tables larger than this are not trusted.
const MAX_SECTION_NAMES: u64 = 1 << 20;

/// A note segment or section larger than this is not read for a build id, nor copied.
const MAX_NOTE_BYTES: u64 = 64 << 10;

/// Note bytes read at most in search of a build id.
const MAX_NOTES_READ: u64 = 1 << 20;

/// A GNU build id is a hash: 20 bytes (sha1), 16 (md5) or 8 (xxhash); longer ones are
/// refused.
const MAX_BUILD_ID_BYTES: usize = 64;

/// Bytes copied per read.
const CHUNK: usize = 1 << 20;

const ET_EXEC: u64 = 2;
const ET_DYN: u64 = 3;
const PT_LOAD: u64 = 1;
const PT_NOTE: u64 = 4;
const PN_XNUM: u64 = 0xffff;
const SHT_NOTE: u64 = 7;
const SHT_NOBITS: u64 = 8;
const SHF_COMPRESSED: u64 = 0x800;
const ELFCOMPRESS_ZLIB: u64 = 1;
const NT_GNU_BUILD_ID: u64 = 3;
const EHDR: u64 = 64;
const PHDR: u64 = 56;
const SHDR: u64 = 64;
const CHDR: u64 = 24;

/// Sections that send a reader to another file (or embed one): never left in a copy.
const LINKS: [&[u8]; 4] = [
    b".gnu_debuglink",
    b".gnu_debugaltlink",
    b".gnu_debugdata",
    b".debug_sup",
];

/// The symbol and string tables blazesym reads (by these names).
const SYMBOLS: [&[u8]; 4] = [b".symtab", b".strtab", b".dynsym", b".dynstr"];

/// Debug sections symbolization never reads (unwinding and macros).
const UNREAD_DEBUG: [&[u8]; 3] = [b".debug_frame", b".debug_macro", b".debug_macinfo"];

/// Why a file was not copied.
#[derive(Debug, thiserror::Error)]
pub enum CopyError {
    /// Over [`MAX_MAPPED_FILE_BYTES`].
    #[error("{size} bytes, over the {MAX_MAPPED_FILE_BYTES}-byte cap")]
    TooLarge {
        /// Its size.
        size: u64,
    },
    /// Not an ELF file this profiler symbolizes, or one whose headers do not hold.
    #[error("not copied for symbolization: {0}")]
    Refused(&'static str),
    /// The file changed (size, times or inode) while it was read.
    #[error("the file changed while it was copied")]
    Changed,
    /// Reading the file failed (a file that shrinks fails here).
    #[error("reading the file: {0}")]
    Read(#[source] io::Error),
    /// Making, writing or sealing the copy failed.
    #[error("making the copy: {0}")]
    Copy(#[source] io::Error),
}

/// What a file is, as our own descriptor's `fstat` says: device, inode, size and
/// modification and change times. Two descriptors of one unchanged file agree; a file
/// with another inode, or written since, does not. A build id is no identity: it is
/// bytes in the file, which anyone can copy into a file of theirs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FileIdentity {
    /// `st_dev`.
    pub device: u64,
    /// `st_ino`.
    pub inode: u64,
    /// `st_size`.
    pub size: u64,
    /// `st_mtime`, seconds and nanoseconds.
    pub modified: (i64, i64),
    /// `st_ctime`, seconds and nanoseconds.
    pub changed: (i64, i64),
}

impl FileIdentity {
    /// The identity of the file open as `file`.
    pub fn of(file: &File) -> io::Result<FileIdentity> {
        let meta = file.metadata()?;
        Ok(FileIdentity {
            device: meta.dev(),
            inode: meta.ino(),
            size: meta.size(),
            modified: (meta.mtime(), meta.mtime_nsec()),
            changed: (meta.ctime(), meta.ctime_nsec()),
        })
    }
}

/// A sealed in-memory copy of a mapped ELF file: what blazesym reads instead of it.
#[derive(Debug)]
pub struct SealedCopy {
    file: File,
    bytes: u64,
    debug_info: bool,
    /// The file's `PT_LOAD` segments: file offset, bytes in the file, virtual address.
    loads: Vec<(u64, u64, u64)>,
}

impl SealedCopy {
    /// The copy (a sealed memfd).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// `/proc/self/fd/N` of the copy: the path to give blazesym.
    pub fn path(&self) -> PathBuf {
        crate::procfs::descriptor_path(&self.file)
    }

    /// Bytes the copy holds (what it costs in memory).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether its DWARF sections were kept (else symbols only).
    pub fn has_debug_info(&self) -> bool {
        self.debug_info
    }

    /// The virtual address (as in the file's symbols) of file offset `offset`, through
    /// the `PT_LOAD` segment that holds it, as blazesym translates it.
    pub fn virtual_offset(&self, offset: u64) -> Option<u64> {
        self.loads.iter().find_map(|&(start, len, address)| {
            (start..start + len)
                .contains(&offset)
                .then(|| offset - start + address)
        })
    }
}

/// Where distributions install detached debug files by build id (Debian's `-dbg` and
/// `-dbgsym` packages, Fedora's `debuginfo`): root's directory.
pub const DEBUG_BUILD_ID_DIR: &str = "/usr/lib/debug/.build-id";

/// The detached debug file for build id `build_id`
/// (`/usr/lib/debug/.build-id/xx/yyyy.debug`), if one is installed: a regular file
/// owned by root, writable by no one else, whose own build id is `build_id`. The path
/// is made of hex digits only, in a directory tree only root writes: no other user can
/// place or swap a file there (a process choosing a build id chooses which of root's
/// files describes its own module, nothing more). Opened without blocking, and read
/// like any other file: through a [`SealedCopy`].
pub fn open_debug_file(build_id: &[u8]) -> Option<File> {
    use std::os::unix::fs::OpenOptionsExt;
    // As blazesym: shorter ids are not looked up.
    if build_id.len() < 8 {
        return None;
    }
    let hex: String = build_id.iter().map(|b| format!("{b:02x}")).collect();
    let path = format!("{DEBUG_BUILD_ID_DIR}/{}/{}.debug", &hex[..2], &hex[2..]);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC)
        .open(path)
        .ok()?;
    let meta = file.metadata().ok()?;
    let trusted = meta.file_type().is_file() && meta.uid() == 0 && meta.mode() & 0o022 == 0;
    (trusted && read_build_id(&file).as_deref() == Some(build_id)).then_some(file)
}

/// Copies `file` (opened by [`crate::procfs::open_mapped`]): [`CopyPlan::new`] then
/// [`CopyPlan::copy`].
pub fn sealed_copy(file: &File) -> Result<SealedCopy, CopyError> {
    CopyPlan::new(file)?.copy(file)
}

/// A zlib-compressed DWARF section inflated into the copy.
#[derive(Clone, Debug)]
struct Inflate {
    section: usize,
    /// The compressed bytes in the file (after the compression header).
    from: Range<u64>,
    /// Where its bytes go in the copy.
    to: u64,
    /// Its size once inflated, as its header declares.
    size: u64,
}

/// What a copy of a file will hold, from its headers read and checked: how many bytes
/// (to budget copies before making one) and, by [`CopyPlan::copy`], the copy itself.
#[derive(Debug)]
pub struct CopyPlan {
    identity: FileIdentity,
    elf: Headers,
    /// Ranges of the file copied as they are (sorted, disjoint).
    ranges: Vec<Range<u64>>,
    inflate: Vec<Inflate>,
    bytes: u64,
    debug_info: bool,
}

/// The headers of a file as read (and, for the copy, as patched).
#[derive(Clone, Debug)]
struct Headers {
    size: u64,
    header: Vec<u8>,
    phoff: u64,
    phdrs: Vec<u8>,
    shoff: u64,
    shdrs: Vec<u8>,
    names_at: u64,
    names: Vec<u8>,
}

fn u16_at(bytes: &[u8], at: usize) -> u64 {
    u64::from(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

fn u32_at(bytes: &[u8], at: usize) -> u64 {
    u64::from(u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()))
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
}

fn set_u64(bytes: &mut [u8], at: usize, value: u64) {
    bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
}

/// `start..start + len` if it lies inside a file of `size` bytes.
fn within(start: u64, len: u64, size: u64) -> Option<Range<u64>> {
    let end = start.checked_add(len)?;
    (end <= size).then_some(start..end)
}

/// `len` bytes of `file` at `at`, if they lie inside its `size` bytes.
fn read_range(file: &File, at: u64, len: u64, size: u64) -> Result<Vec<u8>, CopyError> {
    within(at, len, size).ok_or(CopyError::Refused("headers outside the file"))?;
    let mut bytes = vec![0u8; len as usize];
    file.read_exact_at(&mut bytes, at)
        .map_err(CopyError::Read)?;
    Ok(bytes)
}

/// The NUL-terminated name at `at` in a string table (empty if out of it).
fn name_at(names: &[u8], at: u64) -> &[u8] {
    let name = names.get(at as usize..).unwrap_or(&[]);
    &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())]
}

/// The ELF header of a 64-bit little-endian file, if it is one.
fn elf_header(file: &File, size: u64) -> Result<Vec<u8>, CopyError> {
    if size < EHDR {
        return Err(CopyError::Refused("shorter than an ELF header"));
    }
    let header = read_range(file, 0, EHDR, size)?;
    if header[..4] != *b"\x7fELF" || header[4] != 2 || header[5] != 1 {
        return Err(CopyError::Refused("not a 64-bit little-endian ELF file"));
    }
    Ok(header)
}

impl Headers {
    /// Reads and checks the headers of `file`, `size` bytes long.
    fn read(file: &File, size: u64) -> Result<Headers, CopyError> {
        let header = elf_header(file, size)?;
        if !matches!(u16_at(&header, 0x10), ET_EXEC | ET_DYN) {
            return Err(CopyError::Refused("not an executable or shared object"));
        }
        let (phoff, phentsize, phnum) = (
            u64_at(&header, 0x20),
            u16_at(&header, 0x36),
            u16_at(&header, 0x38),
        );
        let (shoff, shentsize, shnum, shstrndx) = (
            u64_at(&header, 0x28),
            u16_at(&header, 0x3a),
            u16_at(&header, 0x3c),
            u16_at(&header, 0x3e),
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

    fn sections(&self) -> usize {
        self.shdrs.len() / SHDR as usize
    }

    fn section(&self, i: usize) -> &[u8] {
        &self.shdrs[i * SHDR as usize..][..SHDR as usize]
    }

    fn section_mut(&mut self, i: usize) -> &mut [u8] {
        &mut self.shdrs[i * SHDR as usize..][..SHDR as usize]
    }

    fn name(&self, i: usize) -> &[u8] {
        name_at(&self.names, u32_at(self.section(i), 0))
    }

    /// Hides section `i` from every reader: renamed (`.x` becomes `Xx`: no name
    /// blazesym looks up has an `X`) and marked uncompressed (its bytes, zeros or
    /// whatever was copied, are never inflated).
    fn neutralize(&mut self, i: usize) {
        let at = u32_at(self.section(i), 0) as usize;
        if let Some(first) = self.names.get_mut(at).filter(|b| **b != 0) {
            *first = b'X';
        }
        let header = self.section_mut(i);
        let flags = u64_at(header, 8) & !SHF_COMPRESSED;
        set_u64(header, 8, flags);
    }

    /// Nothing left that links elsewhere or is compressed (checked on what is written).
    fn check_neutral(&self) -> Result<(), CopyError> {
        for i in 0..self.sections() {
            if LINKS.contains(&self.name(i)) || u64_at(self.section(i), 8) & SHF_COMPRESSED != 0 {
                return Err(CopyError::Refused("a link or compressed section is left"));
            }
        }
        Ok(())
    }

    /// Header bytes written into the copy.
    fn bytes(&self) -> u64 {
        (self.header.len() + self.phdrs.len() + self.shdrs.len() + self.names.len()) as u64
    }
}

/// What symbolization does with a section.
enum Class {
    Link,
    Symbols,
    Note,
    Dwarf,
    Other,
}

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

/// Sorts and merges `ranges`; returns them and the bytes they cover.
fn merged(mut ranges: Vec<Range<u64>>) -> (Vec<Range<u64>>, u64) {
    ranges.retain(|r| !r.is_empty());
    ranges.sort_by_key(|r| r.start);
    let mut out: Vec<Range<u64>> = Vec::with_capacity(ranges.len());
    for range in ranges {
        match out.last_mut() {
            Some(last) if range.start <= last.end => last.end = last.end.max(range.end),
            _ => out.push(range),
        }
    }
    let bytes = out.iter().map(|r| r.end - r.start).sum();
    (out, bytes)
}

fn align8(at: u64) -> u64 {
    at.div_ceil(8) * 8
}

impl CopyPlan {
    /// Reads and checks the headers of `file` (opened by
    /// [`crate::procfs::open_mapped`]) and plans its copy.
    pub fn new(file: &File) -> Result<CopyPlan, CopyError> {
        let identity = FileIdentity::of(file).map_err(CopyError::Read)?;
        let size = identity.size;
        if size > MAX_MAPPED_FILE_BYTES {
            return Err(CopyError::TooLarge { size });
        }
        let mut elf = Headers::read(file, size)?;
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
        let (mandatory, mandatory_bytes) = merged(symbols.clone());
        let mandatory_bytes = mandatory_bytes + elf.bytes();
        if mandatory_bytes > MAX_COPY_BYTES {
            return Err(CopyError::Refused("symbol tables over the copy cap"));
        }
        let all_ranges = symbols
            .into_iter()
            .chain(dwarf.iter().map(|(_, r)| r.clone()))
            .collect();
        let (all, all_bytes) = merged(all_ranges);
        let inflated: u64 = compressed_dwarf
            .iter()
            .map(|&(_, _, size)| align8(size))
            .sum();
        let with_dwarf = all_bytes
            .saturating_add(elf.bytes())
            .saturating_add(inflated);
        let debug_info = with_dwarf <= MAX_COPY_BYTES && (!dwarf.is_empty() || inflated > 0);
        let (ranges, bytes, inflate) = if with_dwarf <= MAX_COPY_BYTES {
            let mut to = align8(size);
            let mut inflate = Vec::new();
            for (section, from, size) in compressed_dwarf {
                inflate.push(Inflate {
                    section,
                    from,
                    to,
                    size,
                });
                // The header says where the inflated bytes are, uncompressed.
                let header = elf.section_mut(section);
                set_u64(header, 0x18, to);
                set_u64(header, 0x20, size);
                let flags = u64_at(header, 8) & !SHF_COMPRESSED;
                set_u64(header, 8, flags);
                to = align8(to + size);
            }
            (all, with_dwarf, inflate)
        } else {
            // Symbols only: no debug section is left for blazesym to read as zeros.
            neutral.extend(dwarf.iter().map(|&(i, _)| i));
            neutral.extend(compressed_dwarf.iter().map(|&(i, _, _)| i));
            (mandatory, mandatory_bytes, Vec::new())
        };
        for i in neutral {
            elf.neutralize(i);
        }
        elf.check_neutral()?;
        Ok(CopyPlan {
            identity,
            elf,
            ranges,
            inflate,
            bytes,
            debug_info,
        })
    }

    /// Bytes the copy will hold.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Makes the sealed copy of `file`, the file this plan was made from: fails if it
    /// changed since (or while it is read) or could not be read.
    pub fn copy(mut self, file: &File) -> Result<SealedCopy, CopyError> {
        let unchanged = |file: &File| match FileIdentity::of(file) {
            Ok(identity) if identity == self.identity => Ok(()),
            Ok(_) => Err(CopyError::Changed),
            Err(error) => Err(CopyError::Read(error)),
        };
        unchanged(file)?;
        let copy = memfd().map_err(CopyError::Copy)?;
        copy.set_len(self.elf.size).map_err(CopyError::Copy)?;
        let mut buffer = vec![0u8; CHUNK.min(self.bytes as usize)];
        for range in &self.ranges {
            copy_range(file, &copy, range.clone(), &mut buffer)?;
        }
        for inflate in &self.inflate {
            if !inflate_into(file, &copy, inflate) {
                self.elf.neutralize(inflate.section);
            }
        }
        // Last: the checked headers and names, over anything a range put there.
        let elf = &self.elf;
        elf.check_neutral()?;
        for (at, bytes) in [
            (elf.names_at, &elf.names),
            (elf.shoff, &elf.shdrs),
            (elf.phoff, &elf.phdrs),
            (0, &elf.header),
        ] {
            copy.write_all_at(bytes, at).map_err(CopyError::Copy)?;
        }
        unchanged(file)?;
        seal(&copy).map_err(CopyError::Copy)?;
        let loads = elf
            .phdrs
            .chunks_exact(PHDR as usize)
            .filter(|phdr| u32_at(phdr, 0) == PT_LOAD)
            .map(|phdr| (u64_at(phdr, 8), u64_at(phdr, 32), u64_at(phdr, 16)))
            .collect();
        Ok(SealedCopy {
            file: copy,
            bytes: self.bytes,
            debug_info: self.debug_info,
            loads,
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

/// Copies `range` of `from` to the same offsets of `to`.
fn copy_range(
    from: &File,
    to: &File,
    range: Range<u64>,
    buffer: &mut [u8],
) -> Result<(), CopyError> {
    let mut at = range.start;
    while at < range.end {
        let len = buffer.len().min((range.end - at) as usize);
        let chunk = &mut buffer[..len];
        from.read_exact_at(chunk, at).map_err(CopyError::Read)?;
        to.write_all_at(chunk, at).map_err(CopyError::Copy)?;
        at += len as u64;
    }
    Ok(())
}

/// Positioned reads of a range of a file, as a stream.
struct RangeReader<'a> {
    file: &'a File,
    at: u64,
    end: u64,
}

impl Read for RangeReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let len = buf.len().min((self.end - self.at) as usize);
        if len == 0 {
            return Ok(0);
        }
        let read = self.file.read_at(&mut buf[..len], self.at)?;
        if read == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        self.at += read as u64;
        Ok(read)
    }
}

/// Inflates `inflate.from` of `from` into `to` at `inflate.to`; true if it gave exactly
/// the declared size (never more is written).
fn inflate_into(from: &File, to: &File, inflate: &Inflate) -> bool {
    let reader = RangeReader {
        file: from,
        at: inflate.from.start,
        end: inflate.from.end,
    };
    let mut decoder = flate2::read::ZlibDecoder::new(reader);
    let mut buffer = vec![0u8; 64 << 10];
    let mut written = 0u64;
    loop {
        let read = match decoder.read(&mut buffer) {
            Ok(0) => return written == inflate.size,
            Ok(read) => read as u64,
            Err(_) => return false,
        };
        if written + read > inflate.size {
            return false;
        }
        if to
            .write_all_at(&buffer[..read as usize], inflate.to + written)
            .is_err()
        {
            return false;
        }
        written += read;
    }
}

/// A new anonymous memory file that can be sealed.
fn memfd() -> io::Result<File> {
    let name: &CStr = c"allocbpf-symbols";
    // SAFETY: a NUL-terminated name and flags; the descriptor returned is ours.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned to us and nothing else owns it.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// Seals `file`: no shrinking, growing or writing from now on, nor other seals' removal.
fn seal(file: &File) -> io::Result<()> {
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on a descriptor we own.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The GNU build id of `file` (opened by [`crate::procfs::open_mapped`]): the
/// `NT_GNU_BUILD_ID` note named `GNU` in its note segments, else in its note sections,
/// read with bounded positioned reads (nothing mapped, at most [`MAX_NOTES_READ`] note
/// bytes). `None` if it has none, or is not a 64-bit little-endian ELF file.
pub fn read_build_id(file: &File) -> Option<Vec<u8>> {
    let size = file.metadata().ok()?.len();
    let header = elf_header(file, size).ok()?;
    let mut budget = MAX_NOTES_READ;
    let mut notes_at = |offset: u64, len: u64, align: u64| -> Option<Vec<u8>> {
        if len > MAX_NOTE_BYTES || len > budget {
            return None;
        }
        budget -= len;
        let notes = read_range(file, offset, len, size).ok()?;
        gnu_build_id(&notes, if align == 8 { 8 } else { 4 })
    };
    let (phoff, phentsize, phnum) = (
        u64_at(&header, 0x20),
        u16_at(&header, 0x36),
        u16_at(&header, 0x38),
    );
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
    let (shoff, shentsize, shnum) = (
        u64_at(&header, 0x28),
        u16_at(&header, 0x3a),
        u16_at(&header, 0x3c),
    );
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
fn gnu_build_id(mut notes: &[u8], align: usize) -> Option<Vec<u8>> {
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

#[cfg(test)]
mod tests {
    use std::{
        io::Write,
        path::{Path, PathBuf},
        process::Command,
    };

    use object::{Object, ObjectSection};

    use super::*;

    /// A scratch directory for one test.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("sealed-copy-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn run(command: &mut Command) {
        let status = command.status().expect("binutils and gcc are installed");
        assert!(status.success(), "{command:?}");
    }

    /// A C program built with `flags` in `dir`.
    fn program(dir: &Path, flags: &[&str]) -> PathBuf {
        let source = dir.join("prog.c");
        std::fs::write(
            &source,
            "#include <stdlib.h>\n\
             __attribute__((noinline)) void *sealed_copy_site(int n) { return malloc(n); }\n\
             int main(int argc, char **argv) { free(sealed_copy_site(argc)); return 0; }\n",
        )
        .unwrap();
        let binary = dir.join("prog");
        run(Command::new("gcc")
            .args(flags)
            .arg("-o")
            .arg(&binary)
            .arg(&source));
        binary
    }

    /// The sealed copy's bytes.
    fn copied(path: &Path) -> (SealedCopy, Vec<u8>) {
        let copy = sealed_copy(&File::open(path).unwrap()).unwrap();
        let mut bytes = Vec::new();
        File::open(copy.path())
            .unwrap()
            .read_to_end(&mut bytes)
            .unwrap();
        (copy, bytes)
    }

    fn section<'a>(elf: &'a object::File<'a>, name: &str) -> Option<&'a [u8]> {
        elf.section_by_name(name).map(|s| s.data().unwrap())
    }

    #[test]
    fn sealed_copy_neutralizes_debug_links_and_keeps_symbols() {
        let dir = scratch("debuglink");
        let binary = program(&dir, &["-g", "-O1"]);
        let debug = dir.join("prog.debug");
        run(Command::new("objcopy")
            .arg("--only-keep-debug")
            .arg(&binary)
            .arg(&debug));
        run(Command::new("strip").arg("-g").arg(&binary));
        run(Command::new("objcopy")
            .arg(format!("--add-gnu-debuglink={}", debug.display()))
            .arg(&binary)
            .current_dir(&dir));
        let original = std::fs::read(&binary).unwrap();
        let (copy, bytes) = copied(&binary);
        assert_eq!(bytes.len(), original.len());
        let source = object::File::parse(&*original).unwrap();
        let elf = object::File::parse(&*bytes).unwrap();
        assert!(section(&source, ".gnu_debuglink").is_some());
        assert!(
            section(&elf, ".gnu_debuglink").is_none(),
            "the link is left"
        );
        assert!(section(&elf, "Xgnu_debuglink").is_some());
        for name in [
            ".symtab",
            ".strtab",
            ".dynsym",
            ".dynstr",
            ".note.gnu.build-id",
        ] {
            assert_eq!(section(&elf, name), section(&source, name), "{name}");
        }
        // Code is not copied: zeros, no memory.
        assert!(section(&elf, ".text").unwrap().iter().all(|&b| b == 0));
        assert!(copy.bytes() < original.len() as u64);
        assert_eq!(
            read_build_id(copy.file()),
            read_build_id(&File::open(&binary).unwrap())
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// File offsets translate to virtual addresses as the file's segments say.
    #[test]
    fn sealed_copy_translates_file_offsets() {
        use object::ObjectSegment;
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let data = std::fs::read(&exe).unwrap();
        let elf = object::File::parse(&*data).unwrap();
        let copy = sealed_copy(&File::open(&exe).unwrap()).unwrap();
        for segment in elf.segments() {
            let (start, len) = segment.file_range();
            if len > 0 {
                assert_eq!(
                    copy.virtual_offset(start + len - 1),
                    Some(segment.address() + len - 1)
                );
            }
        }
        assert_eq!(copy.virtual_offset(u64::MAX), None);
    }

    /// The C library's detached debug file is found by its build id if installed
    /// (libc6-dbg), and nothing is found for an id no file has.
    #[test]
    fn debug_files_are_found_by_build_id_in_roots_directory() {
        let libc = File::open("/usr/lib/x86_64-linux-gnu/libc.so.6").unwrap();
        let id = read_build_id(&libc).unwrap();
        if let Some(debug) = open_debug_file(&id) {
            assert_eq!(read_build_id(&debug), Some(id));
            assert!(sealed_copy(&debug).unwrap().has_debug_info());
        }
        assert!(open_debug_file(&[0x5a; 20]).is_none());
        assert!(open_debug_file(&[0x5a; 4]).is_none());
    }

    #[test]
    fn sealed_copy_keeps_dwarf_and_inflates_zlib_sections() {
        let dir = scratch("dwarf");
        for flags in [&["-g", "-O1"][..], &["-g", "-O1", "-gz=zlib"][..]] {
            let binary = program(&dir, flags);
            let original = std::fs::read(&binary).unwrap();
            let source = object::File::parse(&*original).unwrap();
            let (copy, bytes) = copied(&binary);
            assert!(copy.has_debug_info());
            let elf = object::File::parse(&*bytes).unwrap();
            for name in [".debug_info", ".debug_line", ".debug_abbrev", ".debug_str"] {
                let theirs = source
                    .section_by_name(name)
                    .unwrap()
                    .compressed_data()
                    .unwrap();
                let theirs = match theirs.format {
                    object::CompressionFormat::None => theirs.data.to_vec(),
                    object::CompressionFormat::Zlib => {
                        let mut inflated = Vec::new();
                        flate2::read::ZlibDecoder::new(theirs.data)
                            .read_to_end(&mut inflated)
                            .unwrap();
                        inflated
                    }
                    other => panic!("{other:?}"),
                };
                let ours = elf.section_by_name(name).unwrap();
                // Ours is stored inflated.
                assert_eq!(ours.data().unwrap(), &*theirs, "{name} {flags:?}");
                assert_eq!(
                    ours.compressed_file_range().unwrap().format,
                    object::CompressionFormat::None
                );
            }
            if flags.contains(&"-gz=zlib") {
                let info = source.section_by_name(".debug_info").unwrap();
                let format = info.compressed_file_range().unwrap().format;
                assert_eq!(format, object::CompressionFormat::Zlib, "not compressed");
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn sealed_copy_is_sealed() {
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let copy = sealed_copy(&File::open(&exe).unwrap()).unwrap();
        // SAFETY: fcntl on a descriptor we own.
        let seals = unsafe { libc::fcntl(copy.file().as_raw_fd(), libc::F_GET_SEALS) };
        let all = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE | libc::F_SEAL_SEAL;
        assert_eq!(seals & all, all);
        let writable = std::fs::OpenOptions::new()
            .write(true)
            .open(copy.path())
            .unwrap();
        assert!(writable.write_all_at(b"x", 0).is_err());
        assert!(writable.set_len(1).is_err());
        assert!(writable.set_len(1 << 40).is_err());
    }

    #[test]
    fn sealed_copy_fails_when_the_file_shrinks_before_or_while_it_is_read() {
        let dir = scratch("shrink");
        let binary = program(&dir, &["-g"]);
        let victim = dir.join("victim");
        std::fs::copy(&binary, &victim).unwrap();
        let file = File::options()
            .read(true)
            .write(true)
            .open(&victim)
            .unwrap();
        let plan = CopyPlan::new(&file).unwrap();
        let size = file.metadata().unwrap().len();
        file.set_len(size / 2).unwrap();
        assert!(matches!(
            plan.copy(&file),
            Err(CopyError::Changed | CopyError::Read(_))
        ));
        // Reading past the end of a shrunk file is an error, not a signal.
        let mut buffer = vec![0u8; 4096];
        assert!(copy_range(&file, &memfd().unwrap(), size - 4096..size, &mut buffer).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A minimal ELF header (`ET_DYN`) with `shnum` sections at `shoff` and no
    /// program headers.
    fn elf_header_bytes(shoff: u64, shnum: u16, shstrndx: u16) -> Vec<u8> {
        let mut elf = vec![0u8; 64];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        elf[0x10] = ET_DYN as u8;
        elf[0x28..0x30].copy_from_slice(&shoff.to_le_bytes());
        elf[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        elf[0x3c..0x3e].copy_from_slice(&shnum.to_le_bytes());
        elf[0x3e..0x40].copy_from_slice(&shstrndx.to_le_bytes());
        elf
    }

    fn section_header(name: u32, kind: u32, flags: u64, offset: u64, size: u64) -> Vec<u8> {
        let mut header = vec![0u8; 64];
        header[0..4].copy_from_slice(&name.to_le_bytes());
        header[4..8].copy_from_slice(&kind.to_le_bytes());
        header[8..16].copy_from_slice(&flags.to_le_bytes());
        header[0x18..0x20].copy_from_slice(&offset.to_le_bytes());
        header[0x20..0x28].copy_from_slice(&size.to_le_bytes());
        header
    }

    fn file_of(bytes: &[u8]) -> File {
        let file = memfd().unwrap();
        (&file).write_all(bytes).unwrap();
        file
    }

    /// A crafted file: names at 64, `sections` after them.
    fn crafted(names: &[u8], sections: &[Vec<u8>], tail: &[u8]) -> Vec<u8> {
        let shoff = 64 + names.len() as u64;
        let mut all = vec![section_header(0, 0, 0, 0, 0)];
        all.push(section_header(1, 3, 0, 64, names.len() as u64));
        all.extend_from_slice(sections);
        let mut bytes = elf_header_bytes(shoff, all.len() as u16, 1);
        bytes.extend_from_slice(names);
        for header in all {
            bytes.extend_from_slice(&header);
        }
        bytes.extend_from_slice(tail);
        bytes
    }

    #[test]
    fn sealed_copy_refuses_headers_past_the_end_and_hides_compressed_sections() {
        // Section headers past the end of the file.
        let past = elf_header_bytes(1 << 40, 3, 1);
        assert!(matches!(
            sealed_copy(&file_of(&past)),
            Err(CopyError::Refused(_))
        ));
        let names = b"\0.shstrtab\0.symtab\0.debug_info\0.gnu_debugaltlink\0";
        let symtab = 11;
        let debug_info = 19;
        let altlink = 31;
        // A symbol table past the end of the file: refused.
        let bytes = crafted(names, &[section_header(symtab, 2, 0, 1 << 30, 24)], &[]);
        assert!(matches!(
            sealed_copy(&file_of(&bytes)),
            Err(CopyError::Refused(_))
        ));
        // A zlib debug section claiming 2^60 bytes, a zstd one, and an altlink: all
        // hidden, nothing allocated.
        let tail_at = 64 + names.len() as u64 + 5 * 64;
        let chdr = |kind: u32, size: u64| {
            let mut chdr = vec![0u8; 24];
            chdr[0..4].copy_from_slice(&kind.to_le_bytes());
            chdr[8..16].copy_from_slice(&size.to_le_bytes());
            chdr
        };
        let bytes = crafted(
            names,
            &[
                section_header(debug_info, 1, SHF_COMPRESSED, tail_at, 24),
                section_header(altlink, 1, 0, tail_at, 24),
                section_header(debug_info, 1, SHF_COMPRESSED, tail_at + 24, 24),
            ],
            &[chdr(1, 1 << 60), chdr(2, 100)].concat(),
        );
        let (copy, out) = {
            let copy = sealed_copy(&file_of(&bytes)).unwrap();
            let mut out = Vec::new();
            File::open(copy.path())
                .unwrap()
                .read_to_end(&mut out)
                .unwrap();
            (copy, out)
        };
        assert!(!copy.has_debug_info());
        let shoff = 64 + names.len();
        for i in 2..5 {
            let header = &out[shoff + i * 64..][..64];
            assert_eq!(u64_at(header, 8) & SHF_COMPRESSED, 0, "section {i}");
        }
        let out_names = &out[64..64 + names.len()];
        assert_eq!(name_at(out_names, u64::from(debug_info)), b"Xdebug_info");
        assert_eq!(name_at(out_names, u64::from(altlink)), b"Xgnu_debugaltlink");
    }

    /// Arbitrary damage to a real binary's headers: refused or copied, never a panic.
    #[test]
    fn sealed_copy_survives_damaged_headers() {
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let original = std::fs::read(&exe).unwrap();
        let shoff = u64_at(&original, 0x28) as usize;
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for round in 0..200 {
            let mut bytes = original[..original.len().min(shoff + 64 * 64)].to_vec();
            if round % 2 == 0 {
                bytes = original.clone();
            }
            for _ in 0..1 + next() % 8 {
                let at = match next() % 3 {
                    0 => (next() % 64) as usize,
                    _ => shoff + (next() % (64 * 40)) as usize,
                };
                if at < bytes.len() {
                    bytes[at] = next() as u8;
                }
            }
            let file = file_of(&bytes);
            let _ = sealed_copy(&file);
            let _ = read_build_id(&file);
        }
    }

    #[test]
    fn build_ids_are_read_from_crafted_notes_and_real_files() {
        let note = |name: &[u8], kind: u32, desc: &[u8]| {
            let mut note = Vec::new();
            note.extend_from_slice(&(name.len() as u32).to_le_bytes());
            note.extend_from_slice(&(desc.len() as u32).to_le_bytes());
            note.extend_from_slice(&kind.to_le_bytes());
            note.extend_from_slice(name);
            note.resize(note.len().next_multiple_of(4), 0);
            note.extend_from_slice(desc);
            note.resize(note.len().next_multiple_of(4), 0);
            note
        };
        let id = [0xabu8, 0xcd, 0xef, 0x01, 0x23, 0x45, 0x67, 0x89, 0x10];
        // Another vendor's note of type 3 first, then a GNU property, then the id.
        let mut notes = note(b"Go\0\0", 3, b"not a gnu id");
        notes.extend(note(b"GNU\0", 5, &[0; 16]));
        notes.extend(note(b"GNU\0", 3, &id));
        assert_eq!(gnu_build_id(&notes, 4).as_deref(), Some(&id[..]));
        // A descriptor running past the notes, or a huge one: none.
        let mut bad = note(b"GNU\0", 3, &id);
        bad[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(gnu_build_id(&bad, 4), None);
        assert_eq!(gnu_build_id(&note(b"GNU\0", 3, &[7; 100]), 4), None);

        // In a PT_NOTE segment of a crafted file.
        let mut elf = elf_header_bytes(0, 0, 0);
        elf[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
        elf[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        elf[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
        let mut phdr = vec![0u8; 56];
        phdr[0..4].copy_from_slice(&(PT_NOTE as u32).to_le_bytes());
        phdr[8..16].copy_from_slice(&120u64.to_le_bytes());
        phdr[32..40].copy_from_slice(&(notes.len() as u64).to_le_bytes());
        phdr[48..56].copy_from_slice(&4u64.to_le_bytes());
        elf.extend(phdr);
        elf.extend(&notes);
        assert_eq!(read_build_id(&file_of(&elf)).as_deref(), Some(&id[..]));
        // Its segment past the end of the file: none.
        elf.truncate(130);
        assert_eq!(read_build_id(&file_of(&elf)), None);

        // Our own executable, as object reads it.
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let data = std::fs::read(&exe).unwrap();
        let expected = object::File::parse(&*data)
            .unwrap()
            .build_id()
            .unwrap()
            .map(<[u8]>::to_vec);
        assert!(expected.is_some());
        assert_eq!(read_build_id(&File::open(&exe).unwrap()), expected);
    }
}
