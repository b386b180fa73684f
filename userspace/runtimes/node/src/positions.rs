//! V8's source position tables and line ends.
//!
//! A source position table (a `BytecodeArray`'s or a `Code` object's) is a sequence of
//! (code offset, source position) pairs, each stored as the difference from the
//! previous pair in zigzag variable-length quantities; the sign of a code offset's
//! difference says whether the position is a statement's. A source position packs the
//! script offset (plus one, so that "none" is zero) above one bit, and in optimized
//! code an inlining id above that. A script offset becomes a line through the script's
//! line ends (the offsets of its line breaks).

/// Pairs decoded at most from one table.
const MAX_PAIRS: usize = 1 << 20;

/// A source position's script offset bits (above the external bit).
const SCRIPT_OFFSET_BITS: u32 = 30;

/// One decoded pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Position {
    /// Offset in the bytecodes or machine code.
    pub code_offset: i64,
    /// Offset in the script's source, if the position has one.
    pub script_offset: Option<u32>,
    /// For code inlined from another function (optimized code): the index of its
    /// inlining in the code's inlining positions, plus one; 0 otherwise.
    pub inlining_id: u32,
}

/// Reads one zigzag variable-length quantity.
fn vlq(bytes: &[u8], at: &mut usize) -> Option<i64> {
    let mut value: u64 = 0;
    let mut shift = 0u32;
    loop {
        let byte = *bytes.get(*at)?;
        *at += 1;
        if shift >= 64 {
            return None;
        }
        value |= ((byte & 0x7f) as u64) << shift;
        shift += 7;
        if byte & 0x80 == 0 {
            break;
        }
    }
    Some(((value >> 1) as i64) ^ -((value & 1) as i64))
}

/// Decodes a whole table (at most [`MAX_PAIRS`] pairs; a malformed tail ends it).
pub fn decode(table: &[u8]) -> Vec<Position> {
    let mut out = Vec::new();
    let mut at = 0usize;
    let mut code_offset: i64 = -1;
    let mut source: i64 = 0;
    while at < table.len() && out.len() < MAX_PAIRS {
        let Some(code_delta) = vlq(table, &mut at) else {
            break;
        };
        // A negative difference marks a statement; its magnitude less one is the step.
        code_offset = match code_delta >= 0 {
            true => code_offset.wrapping_add(code_delta),
            false => code_offset.wrapping_sub(code_delta.wrapping_add(1)),
        };
        let Some(source_delta) = vlq(table, &mut at) else {
            break;
        };
        source = source.wrapping_add(source_delta);
        out.push(Position::from_raw(code_offset, source as u64));
    }
    out
}

impl Position {
    /// The position a raw `SourcePosition` says, at `code_offset`.
    pub fn from_raw(code_offset: i64, raw: u64) -> Self {
        let offset_plus_one = ((raw >> 1) & ((1 << SCRIPT_OFFSET_BITS) - 1)) as u32;
        Position {
            code_offset,
            script_offset: offset_plus_one.checked_sub(1),
            inlining_id: (raw >> (1 + SCRIPT_OFFSET_BITS)) as u32 & 0xffff,
        }
    }
}

/// The position in force at `code_offset`: the last pair at or before it.
pub fn at(positions: &[Position], code_offset: i64) -> Option<Position> {
    let index = positions.partition_point(|p| p.code_offset <= code_offset);
    index.checked_sub(1).map(|i| positions[i])
}

/// The line (from 1) of `script_offset`, given the offsets of the script's line
/// breaks in order.
pub fn line_of(line_ends: &[u32], script_offset: u32) -> u32 {
    line_ends.partition_point(|&end| end < script_offset) as u32 + 1
}

/// The offsets of the line breaks of `source` (UTF-16 units).
pub fn line_ends(source: &[u16]) -> Vec<u32> {
    (source.iter().enumerate())
        .filter(|(_, &unit)| unit == u16::from(b'\n'))
        .map(|(i, _)| i as u32)
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn zigzag(value: i64, out: &mut Vec<u8>) {
        let mut v = ((value << 1) ^ (value >> 63)) as u64;
        loop {
            let byte = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                out.push(byte);
                break;
            }
            out.push(byte | 0x80);
        }
    }

    /// Encodes pairs the way V8 does: differences, statements by a negative code step.
    pub(crate) fn encode(pairs: &[(i64, u32, bool)]) -> Vec<u8> {
        let mut out = Vec::new();
        let (mut code, mut source) = (-1i64, 0i64);
        for &(offset, script_offset, statement) in pairs {
            let step = offset - code;
            zigzag(if statement { -step - 1 } else { step }, &mut out);
            let position = (script_offset as i64 + 1) << 1;
            zigzag(position - source, &mut out);
            code = offset;
            source = position;
        }
        out
    }

    #[test]
    fn tables_decode_and_map_offsets_to_lines() {
        let table = encode(&[(0, 10, true), (5, 42, false), (9, 120, true), (30, 7, true)]);
        let positions = decode(&table);
        assert_eq!(positions.len(), 4);
        assert_eq!(at(&positions, 7).unwrap().script_offset, Some(42));
        assert_eq!(at(&positions, 9).unwrap().script_offset, Some(120));
        assert_eq!(at(&positions, 1000).unwrap().script_offset, Some(7));
        assert_eq!(at(&positions, -5), None);
        let source: Vec<u16> = "a\nbb\nccc\n".encode_utf16().collect();
        let ends = line_ends(&source);
        assert_eq!(ends, vec![1, 4, 8]);
        assert_eq!(line_of(&ends, 0), 1);
        assert_eq!(line_of(&ends, 2), 2);
        assert_eq!(line_of(&ends, 5), 3);
        assert_eq!(line_of(&ends, 9), 4);
    }

    #[test]
    fn malformed_tables_end_without_panicking() {
        assert!(decode(&[0xff; 64]).is_empty());
        assert_eq!(decode(&[0x02]).len(), 0);
        let _ = decode(&[0x80, 0x80, 0x80, 0x01, 0x7f, 0x7f]);
    }
}
