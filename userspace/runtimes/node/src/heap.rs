//! A V8 heap read from outside: tagged words, objects and their instance types,
//! strings of every representation, and arrays, each read with a bound. Nothing read
//! is believed: a type is checked before a field is read, lengths are capped, and a
//! string's parts are followed a bounded number of times (a forged cons string may
//! point at itself).

use allocbpf_images::memory::ProcessMemory;

use crate::v8dbg::Layout;

/// Reads of a process's memory (a trait so that the walks can be tested on forged
/// memory).
pub trait Memory {
    /// Fills `buffer` from `address`; false unless every byte was read.
    fn read(&self, address: u64, buffer: &mut [u8]) -> bool;
}

impl Memory for ProcessMemory {
    fn read(&self, address: u64, buffer: &mut [u8]) -> bool {
        ProcessMemory::read(self, address, buffer).is_ok()
    }
}

/// Longest name (function or script) read, in characters.
pub const MAX_NAME_CHARS: usize = 512;

/// Longest script source scanned for its line ends, in characters.
pub const MAX_SOURCE_CHARS: usize = 4 << 20;

/// String parts followed at most for one string (cons, thin and sliced strings).
const MAX_STRING_PARTS: usize = 1024;

/// Elements of a fixed array read at most (a script's line ends).
pub const MAX_ARRAY_ELEMENTS: usize = 4 << 20;

/// The heap of one process, read with its build's layout.
pub struct Heap<'a, M: Memory + ?Sized> {
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

impl<M: Memory + ?Sized> Heap<'_, M> {
    /// The word at `address`.
    pub fn word(&self, address: u64) -> Option<u64> {
        let mut bytes = [0u8; 8];
        self.memory
            .read(address, &mut bytes)
            .then(|| u64::from_le_bytes(bytes))
    }

    /// The field at byte `offset` of the object `object` points to.
    pub fn field(&self, object: u64, offset: u32) -> Option<u64> {
        self.word(object.wrapping_sub(1).wrapping_add(offset as u64))
    }

    /// The 32-bit field at byte `offset` of `object`.
    fn field_u32(&self, object: u64, offset: u32) -> Option<u32> {
        let mut bytes = [0u8; 4];
        let address = object.wrapping_sub(1).wrapping_add(offset as u64);
        self.memory
            .read(address, &mut bytes)
            .then(|| u32::from_le_bytes(bytes))
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
        let mut bytes = [0u8; 2];
        let address = map
            .wrapping_sub(1)
            .wrapping_add(self.layout.fields.instance_type as u64);
        self.memory
            .read(address, &mut bytes)
            .then(|| u16::from_le_bytes(bytes))
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
        self.memory.read(start, &mut bytes).then_some(bytes)
    }

    /// A fixed array of Smis (a script's line ends), at most `limit` of them.
    pub fn smi_array(&self, array: u64, limit: usize) -> Option<Vec<i64>> {
        self.typed(array, self.layout.types.fixed_array)?;
        let length = self.array_length(array, limit)?;
        let mut bytes = vec![0u8; length * 8];
        let start = array
            .wrapping_sub(1)
            .wrapping_add(self.layout.fields.array_data as u64);
        if !self.memory.read(start, &mut bytes) {
            return None;
        }
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
        if !self.memory.read(start, &mut bytes) {
            return None;
        }
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
pub(crate) mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::v8dbg::{tests::node20, Layout};

    /// Memory made of the pages a test writes.
    #[derive(Default)]
    pub(crate) struct FakeMemory(pub(crate) BTreeMap<u64, u8>);

    impl FakeMemory {
        pub(crate) fn put(&mut self, address: u64, bytes: &[u8]) {
            for (i, &b) in bytes.iter().enumerate() {
                self.0.insert(address + i as u64, b);
            }
        }

        pub(crate) fn word(&mut self, address: u64, value: u64) {
            self.put(address, &value.to_le_bytes());
        }

        /// A map at `map` of instance type `instance_type`; returns its tagged pointer.
        pub(crate) fn map(&mut self, map: u64, instance_type: u16) -> u64 {
            self.put(map + 12, &instance_type.to_le_bytes());
            map + 1
        }

        /// A sequential one-byte string at `at`, of map `map` (tagged).
        pub(crate) fn string(&mut self, at: u64, map: u64, text: &str) -> u64 {
            self.word(at, map);
            self.put(at + 12, &(text.len() as u32).to_le_bytes());
            self.put(at + 16, text.as_bytes());
            at + 1
        }
    }

    impl Memory for FakeMemory {
        fn read(&self, address: u64, buffer: &mut [u8]) -> bool {
            for (i, b) in buffer.iter_mut().enumerate() {
                match self.0.get(&(address + i as u64)) {
                    Some(&v) => *b = v,
                    None => return false,
                }
            }
            true
        }
    }

    pub(crate) fn layout() -> Layout {
        Layout::new(&node20(), (11, 3)).unwrap()
    }

    #[test]
    fn strings_of_every_representation_are_read() {
        let layout = layout();
        let mut memory = FakeMemory::default();
        let seq = memory.map(0x1000, 40);
        let cons = memory.map(0x1100, 41);
        let thin = memory.map(0x1200, 45);
        let sliced = memory.map(0x1300, 43);
        let hello = memory.string(0x2000, seq, "hello ");
        let world = memory.string(0x2100, seq, "world");
        // cons("hello ", "world")
        memory.word(0x2200, cons);
        memory.put(0x220c, &11u32.to_le_bytes());
        memory.word(0x2210, hello);
        memory.word(0x2218, world);
        // thin -> cons
        memory.word(0x2300, thin);
        memory.put(0x230c, &11u32.to_le_bytes());
        memory.word(0x2310, 0x2201);
        // sliced(cons, 3, 5) = "lo wo"
        memory.word(0x2400, sliced);
        memory.put(0x240c, &5u32.to_le_bytes());
        memory.word(0x2410, 0x2201);
        memory.word(0x2418, 3u64 << 32);
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
        let mut memory = FakeMemory::default();
        let seq = memory.map(0x1000, 40);
        let cons = memory.map(0x1100, 41);
        // A cons string whose parts are itself: followed a bounded number of times.
        memory.word(0x2200, cons);
        memory.put(0x220c, &11u32.to_le_bytes());
        memory.word(0x2210, 0x2201);
        memory.word(0x2218, 0x2201);
        // A string claiming 2^31 characters.
        memory.word(0x2300, seq);
        memory.put(0x230c, &(1u32 << 31).to_le_bytes());
        // A map whose type is no string's.
        let other = memory.map(0x1200, 2066);
        memory.word(0x2400, other);
        let heap = Heap {
            memory: &memory,
            layout: &layout,
        };
        assert_eq!(heap.name(0x2201), None);
        assert_eq!(heap.name(0x2301), None);
        assert_eq!(heap.name(0x2401), None);
        assert_eq!(heap.name(0x2400), None, "an untagged word is no object");
    }
}
