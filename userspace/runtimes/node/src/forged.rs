//! Forged V8 heaps for tests: node 20's layout (from the debug constants its binary
//! publishes) and objects written in [`FakeMemory`] at made-up addresses as V8 lays
//! them out, so that every reader is tested on what a hostile process could write in
//! its memory.

use allocbpf_runtime::toolkit::FakeMemory;

use crate::v8dbg::{tests::node20, Layout};

/// Where the forged heap starts: objects are written from here, and any address
/// outside it (and outside what a test maps besides) is unmapped.
pub const HEAP: u64 = 0x1000;

/// The forged heap's bytes (zeroed: a zero word is a Smi, never a pointer).
pub const HEAP_BYTES: usize = 1 << 20;

/// An address nothing maps.
pub const UNMAPPED: u64 = 0xdead_0000;

/// Node 20's layout (V8 11.3).
pub fn layout() -> Layout {
    Layout::new(&node20(), (11, 3)).unwrap()
}

/// A forged heap: [`HEAP_BYTES`] of zeros at [`HEAP`], nothing else.
pub fn heap() -> FakeMemory {
    let mut memory = FakeMemory::new();
    memory.map(HEAP, vec![0u8; HEAP_BYTES]);
    memory
}

/// The Smi of `value`, as a tagged word.
pub fn smi(value: i64) -> u64 {
    (value as u64) << 32
}

/// V8 objects written in forged memory, at untagged addresses inside a mapped region;
/// each returns its tagged pointer. Offsets are node 20's ([`layout`]).
pub trait Forge {
    /// A map at `at` of instance type `instance_type`.
    fn v8_map(&mut self, at: u64, instance_type: u16) -> u64;

    /// An object at `at` of map `map` (its fields are the test's to write).
    fn object(&mut self, at: u64, map: u64) -> u64;

    /// A sequential one-byte string at `at`, of map `map`.
    fn string(&mut self, at: u64, map: u64, text: &str) -> u64;

    /// A cons string at `at` of map `map`, claiming `length` characters.
    fn cons(&mut self, at: u64, map: u64, length: u32, first: u64, second: u64) -> u64;

    /// A fixed array at `at` of map `map`, whose length reads `length` (a tagged
    /// word, forged or not) and whose first elements are `elements`.
    fn fixed_array(&mut self, at: u64, map: u64, length: u64, elements: &[u64]) -> u64;

    /// A byte array at `at` of map `map` holding `bytes`.
    fn byte_array(&mut self, at: u64, map: u64, bytes: &[u8]) -> u64;
}

impl Forge for FakeMemory {
    fn v8_map(&mut self, at: u64, instance_type: u16) -> u64 {
        self.write(at + 12, &instance_type.to_le_bytes());
        at + 1
    }

    fn object(&mut self, at: u64, map: u64) -> u64 {
        self.write_u64(at, map);
        at + 1
    }

    fn string(&mut self, at: u64, map: u64, text: &str) -> u64 {
        self.write_u64(at, map)
            .write_u32(at + 12, text.len() as u32)
            .write(at + 16, text.as_bytes());
        at + 1
    }

    fn cons(&mut self, at: u64, map: u64, length: u32, first: u64, second: u64) -> u64 {
        self.write_u64(at, map)
            .write_u32(at + 12, length)
            .write_u64(at + 16, first)
            .write_u64(at + 24, second);
        at + 1
    }

    fn fixed_array(&mut self, at: u64, map: u64, length: u64, elements: &[u64]) -> u64 {
        self.write_u64(at, map).write_u64(at + 8, length);
        for (i, &element) in elements.iter().enumerate() {
            self.write_u64(at + 16 + 8 * i as u64, element);
        }
        at + 1
    }

    fn byte_array(&mut self, at: u64, map: u64, bytes: &[u8]) -> u64 {
        self.write_u64(at, map)
            .write_u64(at + 8, smi(bytes.len() as i64))
            .write(at + 16, bytes);
        at + 1
    }
}
