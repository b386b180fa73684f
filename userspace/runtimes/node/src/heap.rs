//! A V8 heap read from outside: tagged words, objects and their instance types,
//! strings of every representation, and arrays, each read with a bound. Nothing read
//! is believed: a type is checked before a field is read, lengths are capped, and a
//! string's parts are followed a bounded number of times (a forged cons string may
//! point at itself).

use allocbpf_runtime::toolkit::RemoteMemory;

use crate::v8dbg::Layout;

/// Longest name (function or script) read, in characters.
pub const MAX_NAME_CHARS: usize = 512;

/// Longest script source scanned for its line ends, in characters.
pub const MAX_SOURCE_CHARS: usize = 4 << 20;

/// String parts followed at most for one string (cons, thin and sliced strings).
const MAX_STRING_PARTS: usize = 1024;

/// Elements of a fixed array read at most (a script's line ends).
pub const MAX_ARRAY_ELEMENTS: usize = 4 << 20;

/// The heap of one process, read with its build's layout.
pub struct Heap<'a, M: RemoteMemory + ?Sized> {
    /// Its memory.
    pub memory: &'a M,
    /// Its layout.
    pub layout: &'a Layout,
}

/// True for a tagged pointer to a heap object.
pub fn is_object(word: u64) -> bool {
    word & 3 == 1
}

/// The value of a Smi (a 32-bit integer in the upper half), if `word` is one.
pub fn smi(word: u64) -> Option<i64> {
    (word & 1 == 0).then_some((word as i64) >> 32)
}

impl<M: RemoteMemory + ?Sized> Heap<'_, M> {
    /// The word at `address`.
    pub fn word(&self, address: u64) -> Option<u64> {
        self.memory.u64(address).ok()
    }

    /// The field at byte `offset` of the object `object` points to.
    pub fn field(&self, object: u64, offset: u32) -> Option<u64> {
        self.word(object.wrapping_sub(1).wrapping_add(offset as u64))
    }

    /// The 32-bit field at byte `offset` of `object`.
    fn field_u32(&self, object: u64, offset: u32) -> Option<u32> {
        let address = object.wrapping_sub(1).wrapping_add(offset as u64);
        self.memory.u32(address).ok()
    }

    /// The instance type of the object `word` points to; `None` for a Smi or an
    /// unreadable object.
    pub fn instance_type(&self, word: u64) -> Option<u16> {
        if !is_object(word) {
            return None;
        }
        let map = self.field(word, self.layout.fields.map)?;
        if !is_object(map) {
            return None;
        }
        let address = map
            .wrapping_sub(1)
            .wrapping_add(self.layout.fields.instance_type as u64);
        self.memory.u16(address).ok()
    }

    /// `word` if it points to an object of type `wanted`.
    pub fn typed(&self, word: u64, wanted: u16) -> Option<u64> {
        (self.instance_type(word)? == wanted).then_some(word)
    }

    /// A fixed array's or byte array's length, at most `limit`.
    pub fn array_length(&self, array: u64, limit: usize) -> Option<usize> {
        let length = smi(self.field(array, self.layout.fields.array_length)?)?;
        (0..=limit as i64)
            .contains(&length)
            .then_some(length as usize)
    }

    /// A byte array's bytes (at most `limit`).
    pub fn byte_array(&self, array: u64, limit: usize) -> Option<Vec<u8>> {
        let types = &self.layout.types;
        let kind = self.instance_type(array)?;
        if kind != types.byte_array && kind != types.trusted_byte_array {
            return None;
        }
        let length = self.array_length(array, limit)?;
        let mut bytes = vec![0u8; length];
        let start = array
            .wrapping_sub(1)
            .wrapping_add(self.layout.fields.array_data as u64);
        self.memory.read(start, &mut bytes).ok()?;
        Some(bytes)
    }

    /// A fixed array of Smis (a script's line ends), at most `limit` of them.
    pub fn smi_array(&self, array: u64, limit: usize) -> Option<Vec<i64>> {
        self.typed(array, self.layout.types.fixed_array)?;
        let length = self.array_length(array, limit)?;
        let mut bytes = vec![0u8; length * 8];
        let start = array
            .wrapping_sub(1)
            .wrapping_add(self.layout.fields.array_data as u64);
        self.memory.read(start, &mut bytes).ok()?;
        bytes
            .chunks_exact(8)
            .map(|word| smi(u64::from_le_bytes(word.try_into().ok()?)))
            .collect()
    }

    /// The characters of the string `word` points to, as UTF-16 code units (V8's
    /// source positions count those), at most `limit` of them; `None` when it is no
    /// string, longer than `limit`, or not readable.
    pub fn string_units(&self, word: u64, limit: usize) -> Option<Vec<u16>> {
        let mut out = Vec::new();
        let mut parts = 0usize;
        // Pending (string, skip, take): what is left to append, in order.
        let mut pending = vec![(word, 0usize, usize::MAX)];
        while let Some((string, skip, take)) = pending.pop() {
            parts += 1;
            if parts > MAX_STRING_PARTS {
                return None;
            }
            let instance_type = self.instance_type(string)?;
            if instance_type >= self.layout.types.first_nonstring {
                return None;
            }
            let length = self.field_u32(string, self.layout.fields.string_length)? as usize;
            if length > limit {
                return None;
            }
            let end = length.min(skip.saturating_add(take));
            if skip >= end {
                continue;
            }
            if out.len() + (end - skip) > limit {
                return None;
            }
            let tags = &self.layout.strings;
            let fields = &self.layout.fields;
            let one_byte = instance_type & tags.encoding_mask == tags.one_byte;
            match instance_type & tags.representation_mask {
                r if r == tags.sequential => {
                    let chars = string
                        .wrapping_sub(1)
                        .wrapping_add(fields.sequential_chars as u64);
                    self.append_chars(&mut out, chars, skip, end, one_byte)?;
                }
                r if r == tags.external => {
                    // Uncached external strings have no data pointer of their own.
                    const UNCACHED: u16 = 0x10;
                    if instance_type & UNCACHED != 0 {
                        return None;
                    }
                    let chars = self.field(string, fields.external_resource + 8)?;
                    self.append_chars(&mut out, chars, skip, end, one_byte)?;
                }
                r if r == tags.cons => {
                    let first = self.field(string, fields.cons_first)?;
                    let second = self.field(string, fields.cons_second)?;
                    let first_length = self.field_u32(first, fields.string_length)? as usize;
                    // Appended in order: the second part after the first.
                    let split = first_length.min(end);
                    if end > split {
                        pending.push((second, skip.saturating_sub(split), end - skip.max(split)));
                    }
                    if skip < split {
                        pending.push((first, skip, split - skip));
                    }
                }
                r if r == tags.thin => {
                    let actual = self.field(string, fields.thin_actual)?;
                    pending.push((actual, skip, end - skip));
                }
                r if r == tags.sliced => {
                    let parent = self.field(string, fields.sliced_parent)?;
                    let offset = smi(self.field(string, fields.sliced_offset)?)?;
                    let offset = usize::try_from(offset).ok()?;
                    pending.push((parent, offset.checked_add(skip)?, end - skip));
                }
                _ => return None,
            }
        }
        Some(out)
    }

    /// Appends characters `skip..end` of the array at `chars` to `out`.
    fn append_chars(
        &self,
        out: &mut Vec<u16>,
        chars: u64,
        skip: usize,
        end: usize,
        one_byte: bool,
    ) -> Option<()> {
        let width = if one_byte { 1 } else { 2 };
        let mut bytes = vec![0u8; (end - skip) * width];
        let start = chars.wrapping_add((skip * width) as u64);
        self.memory.read(start, &mut bytes).ok()?;
        match one_byte {
            true => out.extend(bytes.iter().map(|&b| b as u16)),
            false => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|pair| u16::from_le_bytes([pair[0], pair[1]])),
            ),
        }
        Some(())
    }

    /// The string `word` points to, at most [`MAX_NAME_CHARS`] characters.
    pub fn name(&self, word: u64) -> Option<String> {
        let units = self.string_units(word, MAX_NAME_CHARS)?;
        Some(String::from_utf16_lossy(&units))
    }
}

#[cfg(test)]
mod tests {
    use allocbpf_runtime::toolkit::FakeMemory;

    use super::*;
    use crate::forged::{self, layout, Forge};

    #[test]
    fn strings_of_every_representation_are_read() {
        let layout = layout();
        let mut memory = forged::heap();
        let seq = memory.v8_map(0x1000, 40);
        let cons = memory.v8_map(0x1100, 41);
        let thin = memory.v8_map(0x1200, 45);
        let sliced = memory.v8_map(0x1300, 43);
        let hello = memory.string(0x2000, seq, "hello ");
        let world = memory.string(0x2100, seq, "world");
        // cons("hello ", "world")
        memory.cons(0x2200, cons, 11, hello, world);
        // thin -> cons
        memory
            .write_u64(0x2300, thin)
            .write_u32(0x230c, 11)
            .write_u64(0x2310, 0x2201);
        // sliced(cons, 3, 5) = "lo wo"
        memory
            .write_u64(0x2400, sliced)
            .write_u32(0x240c, 5)
            .write_u64(0x2410, 0x2201)
            .write_u64(0x2418, 3u64 << 32);
        let heap = Heap {
            memory: &memory,
            layout: &layout,
        };
        assert_eq!(heap.name(hello).as_deref(), Some("hello "));
        assert_eq!(heap.name(0x2201).as_deref(), Some("hello world"));
        assert_eq!(heap.name(0x2301).as_deref(), Some("hello world"));
        assert_eq!(heap.name(0x2401).as_deref(), Some("lo wo"));
    }

    #[test]
    fn forged_strings_end_unread() {
        let layout = layout();
        let mut memory = forged::heap();
        let seq = memory.v8_map(0x1000, 40);
        let cons = memory.v8_map(0x1100, 41);
        // A cons string whose parts are itself: followed a bounded number of times.
        memory.cons(0x2200, cons, 11, 0x2201, 0x2201);
        // A string claiming 2^31 characters.
        memory.write_u64(0x2300, seq).write_u32(0x230c, 1 << 31);
        // A map whose type is no string's.
        let other = memory.v8_map(0x1200, 2066);
        memory.write_u64(0x2400, other);
        let heap = Heap {
            memory: &memory,
            layout: &layout,
        };
        assert_eq!(heap.name(0x2201), None);
        assert_eq!(heap.name(0x2301), None);
        assert_eq!(heap.name(0x2401), None);
        assert_eq!(heap.name(0x2400), None, "an untagged word is no object");
    }

    #[test]
    fn objects_past_the_mapped_memory_are_not_read() {
        let layout = layout();
        let mut memory = FakeMemory::new();
        // A string whose map is mapped but whose characters run past its region.
        memory.map(0x1000, vec![0u8; 0x20]);
        let seq = memory.v8_map(0x1000, 40);
        memory.map(0x2000, vec![0u8; 0x18]);
        memory.write_u64(0x2000, seq).write_u32(0x200c, 16);
        memory.write(0x2010, b"abcdefgh");
        let heap = Heap {
            memory: &memory,
            layout: &layout,
        };
        assert_eq!(heap.name(0x2001), None, "half its characters are unmapped");
        assert_eq!(heap.instance_type(0x2001), Some(40));
        assert_eq!(heap.instance_type(0x3001), None, "nothing maps it");
        assert_eq!(heap.word(u64::MAX - 3), None);
        assert_eq!(heap.field(0, 0), None, "wraps below zero");
    }
}
