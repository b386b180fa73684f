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

mod build_id;
mod headers;
mod sections;

pub use self::build_id::read_build_id;
use self::headers::{set_u64, u32_at, u64_at, Headers};
use self::sections::Sections;

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

/// Places the `compressed` DWARF sections (index, compressed bytes, inflated size)
/// inflated in the copy, one after the other past the file's `file_size` bytes, and
/// rewrites their headers to say so; returns what to inflate where.
fn place_inflated(
    elf: &mut Headers,
    compressed: Vec<(usize, Range<u64>, u64)>,
    file_size: u64,
) -> Vec<Inflate> {
    let mut to = align8(file_size);
    let mut inflate = Vec::new();
    for (section, from, size) in compressed {
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
    inflate
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
        let Sections {
            symbols,
            dwarf,
            compressed_dwarf,
            mut neutral,
        } = Sections::sort(file, &elf, size)?;
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
            let inflate = place_inflated(&mut elf, compressed_dwarf, size);
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

#[cfg(test)]
mod tests;
