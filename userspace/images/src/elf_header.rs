//! The fields of a 64-bit little-endian ELF file header, for the readers that take a
//! hostile file apart with bounded reads of their own (`elf_ranges.rs`,
//! `sealed_copy/`) rather than through `object`, and the little-endian integers they
//! read from its tables.

/// Bytes of a 64-bit ELF file header.
pub(crate) const EHDR_SIZE: usize = 64;

/// The header fields the readers use, each widened to `u64`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ElfHeader {
    /// `e_type`: executable, shared object, ...
    pub e_type: u64,
    /// Where the program headers are, their size and count.
    pub phoff: u64,
    pub phentsize: u64,
    pub phnum: u64,
    /// Where the section headers are, their size, count and the names' section index.
    pub shoff: u64,
    pub shentsize: u64,
    pub shnum: u64,
    pub shstrndx: u64,
}

impl ElfHeader {
    /// The header in `bytes` (at least [`EHDR_SIZE`] of them), unless they are not the
    /// start of a 64-bit little-endian ELF file (the only kind read: x86-64).
    pub fn parse(bytes: &[u8]) -> Option<ElfHeader> {
        if bytes.len() < EHDR_SIZE || bytes[..4] != *b"\x7fELF" || bytes[4] != 2 || bytes[5] != 1 {
            return None;
        }
        Some(ElfHeader {
            e_type: u16_at(bytes, 0x10),
            phoff: u64_at(bytes, 0x20),
            phentsize: u16_at(bytes, 0x36),
            phnum: u16_at(bytes, 0x38),
            shoff: u64_at(bytes, 0x28),
            shentsize: u16_at(bytes, 0x3a),
            shnum: u16_at(bytes, 0x3c),
            shstrndx: u16_at(bytes, 0x3e),
        })
    }
}

/// The little-endian `u16` at `at` (panics past the end: callers read within tables
/// whose size they checked).
pub(crate) fn u16_at(bytes: &[u8], at: usize) -> u64 {
    u64::from(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

/// The little-endian `u32` at `at`.
pub(crate) fn u32_at(bytes: &[u8], at: usize) -> u64 {
    u64::from(u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()))
}

/// The little-endian `u64` at `at`.
pub(crate) fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_64_bit_little_endian_elf_headers_parse() {
        let mut bytes = [0u8; EHDR_SIZE];
        bytes[..6].copy_from_slice(b"\x7fELF\x02\x01");
        bytes[0x10] = 3;
        bytes[0x20] = 64;
        bytes[0x38] = 9;
        bytes[0x3c..0x40].copy_from_slice(&[30, 0, 29, 0]);
        let header = ElfHeader::parse(&bytes).unwrap();
        assert_eq!(
            (
                header.e_type,
                header.phoff,
                header.phnum,
                header.shnum,
                header.shstrndx
            ),
            (3, 64, 9, 30, 29)
        );
        assert!(ElfHeader::parse(&bytes[..63]).is_none());
        bytes[4] = 1;
        assert!(ElfHeader::parse(&bytes).is_none(), "32-bit");
        bytes[4] = 2;
        bytes[5] = 2;
        assert!(ElfHeader::parse(&bytes).is_none(), "big-endian");
    }
}
