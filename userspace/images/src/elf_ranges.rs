//! Which bytes of a mapped ELF file the profiler reads: all of it but its DWARF debug
//! sections.
//!
//! A binary built with debug info is mostly `.debug_*` (a Rust service can carry
//! hundreds of MB of it), and no examination reads them: entry points come from the
//! symbol tables and code, unwinding from `.eh_frame` (or `.debug_frame`, which is
//! kept), symbolization from blazesym through the file itself. The file is read into a
//! zeroed buffer whose pages the kernel only backs where something is written
//! ([`crate::procfs::read_mapped`]), so skipped sections cost no memory, and the
//! buffer still parses as the whole file (offsets unchanged; skipped sections read as
//! zeros). A file whose headers are not those of a 64-bit little-endian ELF file with
//! section headers is not read at all: nothing the profiler examines can be in it, and
//! reading it whole would let any process make the agent read (and hold) up to the size
//! cap of a sparse file full of nothing.
//!
//! What is read is bounded by the file's layout, not only by its size: the ranges are
//! sorted and merged (sections may overlap, and a file can name the same bytes in every
//! one of its section headers), and a file with more section headers than a linked
//! binary has ([`MAX_SECTIONS`]) or more bytes to read than any real one
//! ([`MAX_READ_BYTES`]) is refused ([`Refusal`]). A sparse 256 MiB file with 60,000
//! section headers each covering all of it once made the profiler read 60,000 x 256 MiB.

use std::{io, ops::Range};

use crate::elf_header::{u32_at, u64_at, ElfHeader, EHDR_SIZE};

/// `SHT_NOBITS`: a section with no bytes in the file (`.bss`).
const SHT_NOBITS: u64 = 8;

/// Section-name string tables larger than this are not trusted: the file is not read.
const MAX_SECTION_NAMES: u64 = 1 << 20;

/// Section headers a file may have; more and it is refused unread. Linked files have
/// few: 31 in libLLVM.so.22.1 (150 MB), 34 in gcc's cc1, 64 in Debian's libc.so.6, 74
/// at most among the 2,730 ELF files of a Debian host with a Rust toolchain (its
/// relocatable `.o` files, never mapped to run, reach 739). Every header costs a range
/// to sort and 64 bytes read; the cap keeps that to 256 KiB.
pub const MAX_SECTIONS: u64 = 4096;

/// Bytes a file may need read (its headers and non-debug sections, overlaps counted
/// once); more and it is refused unread. The largest real need seen is libLLVM.so.22.1:
/// 143 MiB, all of it code and data. The buffer's written pages stay resident while
/// the file is examined, so this bounds that memory below [`MAX_MAPPED_FILE_BYTES`],
/// the size of a file, whatever its layout.
///
/// [`MAX_MAPPED_FILE_BYTES`]: crate::procfs::MAX_MAPPED_FILE_BYTES
pub const MAX_READ_BYTES: u64 = 256 << 20;

/// Why a file's bytes are not read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RangesError {
    /// Not a 64-bit little-endian ELF file with section headers inside the file (or its
    /// headers could not be read): nothing the profiler examines can be in it.
    #[error("not an ELF file this profiler can examine")]
    NotElf,
    /// An ELF file whose layout would make reading it cost more than any real one.
    #[error(transparent)]
    Refused(#[from] Refusal),
}

/// An ELF file refused for its layout: what a hostile file does, never a real one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// More than [`MAX_SECTIONS`] section headers.
    #[error("{count} section headers, over the {MAX_SECTIONS} a linked file may have")]
    TooManySections {
        /// Its section headers.
        count: u64,
    },
    /// More than [`MAX_READ_BYTES`] to read.
    #[error("{bytes} bytes to read outside debug sections, over the {MAX_READ_BYTES}-byte cap")]
    TooManyBytes {
        /// Bytes its merged ranges cover.
        bytes: u64,
    },
}

/// The ranges of a file of `size` bytes to read, given `read_at` (a positioned read
/// that fills the buffer or fails): sorted, disjoint and not adjacent, each byte read
/// once. [`RangesError::NotElf`] if it is not an ELF file this profiler can examine
/// (64-bit little-endian, with section headers inside the file), a [`Refusal`] if its
/// layout is hostile.
pub fn needed_ranges(
    size: u64,
    read_at: impl Fn(u64, &mut [u8]) -> io::Result<()>,
) -> Result<Vec<Range<u64>>, RangesError> {
    let ranges = sections_to_read(size, read_at)?;
    let merged = merge(ranges);
    let bytes: u64 = merged.iter().map(|r| r.end - r.start).sum();
    if bytes > MAX_READ_BYTES {
        return Err(Refusal::TooManyBytes { bytes }.into());
    }
    Ok(merged)
}

/// `ranges` sorted and merged: overlapping or adjacent ranges become one, empty ones go.
fn merge(mut ranges: Vec<Range<u64>>) -> Vec<Range<u64>> {
    ranges.retain(|r| r.start < r.end);
    ranges.sort_unstable_by_key(|r| r.start);
    let mut merged: Vec<Range<u64>> = Vec::with_capacity(ranges.len());
    for range in ranges {
        match merged.last_mut() {
            Some(last) if range.start <= last.end => last.end = last.end.max(range.end),
            _ => merged.push(range),
        }
    }
    merged
}

/// Whether a section named `name` is left unread.
fn skipped(name: &[u8]) -> bool {
    (name.starts_with(b".debug") && name != b".debug_frame") || name.starts_with(b".zdebug")
}

/// Every range to read, unmerged (one per section).
fn sections_to_read(
    size: u64,
    read_at: impl Fn(u64, &mut [u8]) -> io::Result<()>,
) -> Result<Vec<Range<u64>>, RangesError> {
    let within = |start: u64, len: u64| -> Result<Range<u64>, RangesError> {
        let end = start.checked_add(len).ok_or(RangesError::NotElf)?;
        (end <= size)
            .then_some(start..end)
            .ok_or(RangesError::NotElf)
    };
    let read = |at: u64, buf: &mut [u8]| read_at(at, buf).map_err(|_| RangesError::NotElf);
    let mut bytes = [0u8; EHDR_SIZE];
    read(0, &mut bytes)?;
    // 64-bit little-endian ELF only (x86-64); anything else is not read.
    let header = ElfHeader::parse(&bytes).ok_or(RangesError::NotElf)?;
    let (phoff, phentsize, phnum) = (header.phoff, header.phentsize, header.phnum);
    let (shoff, shentsize, shnum, shstrndx) = (
        header.shoff,
        header.shentsize,
        header.shnum,
        header.shstrndx,
    );
    if shentsize != 64 || shnum == 0 || shstrndx >= shnum {
        return Err(RangesError::NotElf);
    }
    // Before the table is read: a hostile count costs nothing.
    if shnum > MAX_SECTIONS {
        return Err(Refusal::TooManySections { count: shnum }.into());
    }
    let table = within(shoff, shnum * 64)?;
    let mut ranges = vec![0..64, within(phoff, phentsize * phnum)?, table.clone()];
    let mut headers = vec![0u8; (shnum * 64) as usize];
    read(table.start, &mut headers)?;
    let section = |i: u64| &headers[(i * 64) as usize..(i * 64 + 64) as usize];
    let names_header = section(shstrndx);
    let names_range = within(u64_at(names_header, 0x18), u64_at(names_header, 0x20))?;
    if names_range.end - names_range.start > MAX_SECTION_NAMES {
        return Err(RangesError::NotElf);
    }
    let mut names = vec![0u8; (names_range.end - names_range.start) as usize];
    read(names_range.start, &mut names)?;
    for i in 0..shnum {
        let header = section(i);
        if u32_at(header, 4) == SHT_NOBITS {
            continue;
        }
        let name_at = u32_at(header, 0) as usize;
        let name = names.get(name_at..).unwrap_or(&[]);
        let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
        if skipped(name) {
            continue;
        }
        ranges.push(within(u64_at(header, 0x18), u64_at(header, 0x20))?);
    }
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use std::{fs::File, os::unix::fs::FileExt, path::Path, process::Command};

    use object::{Object, ObjectSection};

    use super::*;

    /// Reads `path` as `read_mapped` does: zeroed buffer, needed ranges only.
    fn sparse(path: &Path) -> (Vec<u8>, u64) {
        let file = File::open(path).unwrap();
        let size = file.metadata().unwrap().len();
        let mut data = vec![0u8; size as usize];
        let ranges = needed_ranges(size, |at, buf| file.read_exact_at(buf, at)).unwrap();
        let mut read = 0;
        for range in ranges {
            let (start, end) = (range.start as usize, range.end as usize);
            file.read_exact_at(&mut data[start..end], range.start)
                .unwrap();
            read += range.end - range.start;
        }
        (data, read)
    }

    #[test]
    fn debug_sections_are_left_out_and_everything_else_is_read() {
        let dir = std::env::temp_dir().join(format!("elf-ranges-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let source = dir.join("debug.c");
        std::fs::write(&source, "int main(void) { return 0; }\n").unwrap();
        let binary = dir.join("debug");
        let built = Command::new("gcc")
            .args(["-g3", "-O0", "-o"])
            .arg(&binary)
            .arg(&source)
            .status()
            .expect("gcc is installed by cargo xtask setup");
        assert!(built.success());
        let whole = std::fs::read(&binary).unwrap();
        let (data, read) = sparse(&binary);
        assert_eq!(data.len(), whole.len());
        let full = object::File::parse(&*whole).unwrap();
        let partial = object::File::parse(&*data).unwrap();
        let mut skipped_bytes = 0;
        for section in full.sections() {
            let name = section.name().unwrap();
            let same = partial.section_by_name(name).unwrap();
            if name.starts_with(".debug") && name != ".debug_frame" {
                skipped_bytes += section.size();
                assert!(
                    same.data().unwrap().iter().all(|&b| b == 0),
                    "{name} was read"
                );
            } else {
                assert_eq!(
                    same.data().unwrap(),
                    section.data().unwrap(),
                    "{name} differs"
                );
            }
        }
        assert!(skipped_bytes > 0);
        assert!(read + skipped_bytes <= whole.len() as u64);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn what_is_not_a_64_bit_elf_file_is_not_read() {
        let ranges_of = |bytes: &[u8]| {
            needed_ranges(bytes.len() as u64, |at, buf| {
                let at = at as usize;
                buf.copy_from_slice(
                    bytes
                        .get(at..at + buf.len())
                        .ok_or(io::ErrorKind::UnexpectedEof)?,
                );
                Ok(())
            })
        };
        let text = b"#!/bin/sh\necho not an ELF file, long enough for a header ...........\n";
        assert_eq!(ranges_of(text), Err(RangesError::NotElf));
        // An ELF header whose section table lies outside the file.
        let mut elf = [0u8; 128];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        elf[0x28..0x30].copy_from_slice(&(1u64 << 40).to_le_bytes());
        elf[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        elf[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        assert_eq!(ranges_of(&elf), Err(RangesError::NotElf));
    }

    #[test]
    fn ranges_are_sorted_and_merged() {
        assert_eq!(
            merge(vec![
                50..60,
                0..10,
                5..20,
                20..30,
                40..45,
                41..42,
                7..7,
                60..61
            ]),
            [0..30, 40..45, 50..61]
        );
        assert_eq!(merge(vec![]), []);
        assert_eq!(merge([3..3, 5..5].to_vec()), []);
    }

    /// A sparse ELF file of `size` bytes as a positioned read: a header, one `PT_LOAD`
    /// R+X program header, `sections` section headers (the first `SHT_NULL`, the last
    /// `.shstrtab`) and every other one a `.text` of `section_size` bytes at offset 0.
    /// Past its headers the file reads as zeros.
    fn hostile_elf(
        size: u64,
        sections: u16,
        section_size: u64,
    ) -> impl Fn(u64, &mut [u8]) -> io::Result<()> {
        let table = 0x1000u64;
        let names_at = table + u64::from(sections) * 64;
        let names = b"\0.text\0.shstrtab\0";
        let mut head = vec![0u8; (names_at as usize) + names.len()];
        head[..6].copy_from_slice(b"\x7fELF\x02\x01");
        head[6] = 1; // EV_CURRENT
        head[0x10..0x12].copy_from_slice(&3u16.to_le_bytes()); // ET_DYN
        head[0x12..0x14].copy_from_slice(&62u16.to_le_bytes()); // EM_X86_64
        head[0x14..0x18].copy_from_slice(&1u32.to_le_bytes());
        head[0x20..0x28].copy_from_slice(&64u64.to_le_bytes()); // e_phoff
        head[0x28..0x30].copy_from_slice(&table.to_le_bytes()); // e_shoff
        head[0x34..0x36].copy_from_slice(&64u16.to_le_bytes()); // e_ehsize
        head[0x36..0x38].copy_from_slice(&56u16.to_le_bytes()); // e_phentsize
        head[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes()); // e_phnum
        head[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes()); // e_shentsize
        head[0x3c..0x3e].copy_from_slice(&sections.to_le_bytes()); // e_shnum
        head[0x3e..0x40].copy_from_slice(&(sections - 1).to_le_bytes()); // e_shstrndx
        let phdr = &mut head[64..120];
        phdr[0..4].copy_from_slice(&1u32.to_le_bytes()); // PT_LOAD
        phdr[4..8].copy_from_slice(&5u32.to_le_bytes()); // PF_R | PF_X
        phdr[0x20..0x28].copy_from_slice(&size.to_le_bytes()); // p_filesz
        phdr[0x28..0x30].copy_from_slice(&size.to_le_bytes()); // p_memsz
        for i in 1..u64::from(sections) {
            let at = (table + i * 64) as usize;
            let header = &mut head[at..at + 64];
            let last = i == u64::from(sections) - 1;
            let (name, kind, offset, len) = match last {
                true => (7u32, 3u32, names_at, names.len() as u64), // SHT_STRTAB
                false => (1, 1, 0, section_size),                   // SHT_PROGBITS
            };
            header[0..4].copy_from_slice(&name.to_le_bytes());
            header[4..8].copy_from_slice(&kind.to_le_bytes());
            header[0x18..0x20].copy_from_slice(&offset.to_le_bytes());
            header[0x20..0x28].copy_from_slice(&len.to_le_bytes());
        }
        let at = names_at as usize;
        head[at..at + names.len()].copy_from_slice(names);
        move |at: u64, buf: &mut [u8]| {
            let end = at.checked_add(buf.len() as u64);
            if end.is_none_or(|end| end > size) {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            for (i, byte) in buf.iter_mut().enumerate() {
                *byte = head.get(at as usize + i).copied().unwrap_or(0);
            }
            Ok(())
        }
    }

    /// The file that made a system-wide run read 60,000 x 256 MiB: refused before its
    /// section table is even read.
    #[test]
    fn sixty_thousand_sections_over_the_whole_file_are_refused() {
        let size = 256 << 20;
        let refused = needed_ranges(size, hostile_elf(size, 60_000, size));
        assert_eq!(
            refused,
            Err(RangesError::Refused(Refusal::TooManySections {
                count: 60_000
            }))
        );
    }

    /// Under the section cap, sections that all cover the whole file are read once: one
    /// range, the file.
    #[test]
    fn overlapping_sections_are_read_once() {
        let size = 64 << 20;
        let sections = MAX_SECTIONS as u16;
        let ranges = needed_ranges(size, hostile_elf(size, sections, size)).unwrap();
        assert_eq!(ranges.len(), 1);
        assert_eq!(ranges[0], 0..size);
        // The same at exactly the byte cap still reads.
        let ranges = needed_ranges(
            MAX_READ_BYTES,
            hostile_elf(MAX_READ_BYTES, 16, MAX_READ_BYTES),
        )
        .unwrap();
        assert_eq!(ranges.len(), 1);
        assert_eq!(ranges[0], 0..MAX_READ_BYTES);
        // One more section header than the cap is refused.
        assert_eq!(
            needed_ranges(size, hostile_elf(size, sections + 1, size)),
            Err(RangesError::Refused(Refusal::TooManySections {
                count: MAX_SECTIONS + 1
            }))
        );
    }

    /// More bytes to read than the cap (here a section past it) is refused.
    #[test]
    fn more_bytes_than_the_cap_are_refused() {
        let size = MAX_READ_BYTES + (1 << 20);
        assert_eq!(
            needed_ranges(size, hostile_elf(size, 3, size)),
            Err(RangesError::Refused(Refusal::TooManyBytes { bytes: size }))
        );
    }

    /// The largest real files are read, within both caps (gcc's cc1 here; libLLVM when
    /// installed).
    #[test]
    fn large_real_files_are_not_refused() {
        let cc1 = Command::new("gcc")
            .arg("-print-prog-name=cc1")
            .output()
            .expect("gcc is installed by cargo xtask setup");
        let cc1 = String::from_utf8(cc1.stdout).unwrap();
        let llvm = Path::new("/usr/lib/llvm-22/lib/libLLVM.so.1");
        let mut paths = vec![Path::new(cc1.trim())];
        if llvm.exists() {
            paths.push(llvm);
        }
        for path in paths {
            let file = File::open(path).unwrap();
            let size = file.metadata().unwrap().len();
            let ranges = needed_ranges(size, |at, buf| file.read_exact_at(buf, at))
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let bytes: u64 = ranges.iter().map(|r| r.end - r.start).sum();
            assert!(
                bytes <= size && bytes <= MAX_READ_BYTES,
                "{}",
                path.display()
            );
            assert!(ranges.windows(2).all(|w| w[0].end < w[1].start));
        }
    }
}
