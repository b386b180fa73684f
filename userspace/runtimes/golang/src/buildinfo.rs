//! The Go version a binary was built with, from its `.go.buildinfo` section: the magic
//! `\xff Go buildinf:`, the pointer size, a flags byte and, since Go 1.18 (flag 2:
//! strings inline), the version as a length-prefixed string at offset 32.

use object::{Object, ObjectSection};

/// The section's magic.
const MAGIC: &[u8] = b"\xff Go buildinf:";

/// Flag: the strings follow the header (Go 1.18+).
const FLAG_INLINE_STRINGS: u8 = 2;

/// Longest version string believed (`go1.26.8`, `devel go1.27-abcdef +...`).
const MAX_VERSION_BYTES: u64 = 128;

/// A Go release, `go1.MINOR[.PATCH]`, as the build info names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GoVersion {
    /// The string as found (`go1.26.8`).
    pub text: String,
    /// `1.MINOR`'s minor, if the string has one.
    pub minor: Option<u32>,
}

/// The version in `file`'s build info: `None` when it has no `.go.buildinfo` section
/// (not Go, or older than 1.13), or one in the old pointer format (before 1.18).
pub fn version(file: &object::File) -> Option<GoVersion> {
    let data = file.section_by_name(".go.buildinfo")?.data().ok()?;
    if !data.starts_with(MAGIC) || data.len() < 32 {
        return None;
    }
    if data[15] & FLAG_INLINE_STRINGS == 0 {
        return None;
    }
    let (length, used) = uvarint(&data[32..])?;
    if length > MAX_VERSION_BYTES {
        return None;
    }
    let start = 32 + used;
    let bytes = data.get(start..start + length as usize)?;
    let text = std::str::from_utf8(bytes).ok()?.to_string();
    Some(GoVersion {
        minor: minor_of(&text),
        text,
    })
}

/// `26` of `go1.26.8` (or of `devel go1.26-...`).
fn minor_of(text: &str) -> Option<u32> {
    let rest = &text[text.find("go1.")? + 4..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// An unsigned LEB128 varint at the start of `data`: its value and length.
pub(crate) fn uvarint(data: &[u8]) -> Option<(u64, usize)> {
    let mut value = 0u64;
    for (i, &byte) in data.iter().enumerate().take(10) {
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((value, i + 1));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minors_and_varints() {
        assert_eq!(minor_of("go1.26.8"), Some(26));
        assert_eq!(minor_of("go1.19"), Some(19));
        assert_eq!(minor_of("devel go1.27-1234 +x"), Some(27));
        assert_eq!(minor_of("gccgo"), None);
        assert_eq!(uvarint(&[0x08]), Some((8, 1)));
        assert_eq!(uvarint(&[0x96, 0x01]), Some((150, 2)));
        assert_eq!(uvarint(&[0x80; 11]), None);
    }
}
