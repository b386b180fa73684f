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

use std::{io, ops::Range};

/// `SHT_NOBITS`: a section with no bytes in the file (`.bss`).
const SHT_NOBITS: u64 = 8;

/// Section-name string tables larger than this are not trusted: the file is not read.
const MAX_SECTION_NAMES: u64 = 1 << 20;

/// The ranges of a file of `size` bytes to read, given `read_at` (a positioned read
/// that fills the buffer or fails); `None` if it is not an ELF file this profiler can
/// examine (64-bit little-endian, with section headers inside the file).
pub fn needed_ranges(
    size: u64,
    read_at: impl Fn(u64, &mut [u8]) -> io::Result<()>,
) -> Option<Vec<Range<u64>>> {
    sections_to_read(size, read_at)
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

/// Whether a section named `name` is left unread.
fn skipped(name: &[u8]) -> bool {
    (name.starts_with(b".debug") && name != b".debug_frame") || name.starts_with(b".zdebug")
}

fn sections_to_read(
    size: u64,
    read_at: impl Fn(u64, &mut [u8]) -> io::Result<()>,
) -> Option<Vec<Range<u64>>> {
    let within = |start: u64, len: u64| -> Option<Range<u64>> {
        let end = start.checked_add(len)?;
        (end <= size).then_some(start..end)
    };
    let mut header = [0u8; 64];
    read_at(0, &mut header).ok()?;
    // 64-bit little-endian ELF only (x86-64); anything else is not read.
    if header[..4] != *b"\x7fELF" || header[4] != 2 || header[5] != 1 {
        return None;
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
    if shentsize != 64 || shnum == 0 || shstrndx >= shnum {
        return None;
    }
    let table = within(shoff, shnum * 64)?;
    let mut ranges = vec![0..64, within(phoff, phentsize * phnum)?, table.clone()];
    let mut headers = vec![0u8; (shnum * 64) as usize];
    read_at(table.start, &mut headers).ok()?;
    let section = |i: u64| &headers[(i * 64) as usize..(i * 64 + 64) as usize];
    let names_header = section(shstrndx);
    let names_range = within(u64_at(names_header, 0x18), u64_at(names_header, 0x20))?;
    if names_range.end - names_range.start > MAX_SECTION_NAMES {
        return None;
    }
    let mut names = vec![0u8; (names_range.end - names_range.start) as usize];
    read_at(names_range.start, &mut names).ok()?;
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
    Some(ranges)
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
        assert_eq!(ranges_of(text), None);
        // An ELF header whose section table lies outside the file.
        let mut elf = [0u8; 128];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        elf[0x28..0x30].copy_from_slice(&(1u64 << 40).to_le_bytes());
        elf[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        elf[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        assert_eq!(ranges_of(&elf), None);
    }
}
