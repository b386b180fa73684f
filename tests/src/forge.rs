//! Forging a running process's memory, for the tests that check allocbpf survives what
//! a hostile process could put there: words read and written through `/proc/PID/mem`
//! (root).

use std::os::unix::fs::FileExt;

use anyhow::Result;

/// A running process's memory.
pub struct Memory(std::fs::File);

impl Memory {
    /// Opens `pid`'s memory for reading and writing.
    pub fn open(pid: u32) -> Result<Memory> {
        Ok(Memory(
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(format!("/proc/{pid}/mem"))?,
        ))
    }

    /// The little-endian word at `address`.
    pub fn read(&self, address: u64) -> Result<u64> {
        let mut word = [0u8; 8];
        self.0.read_exact_at(&mut word, address)?;
        Ok(u64::from_le_bytes(word))
    }

    /// Writes the little-endian `value` at `address`.
    pub fn write(&self, address: u64, value: u64) -> Result<()> {
        self.0.write_all_at(&value.to_le_bytes(), address)?;
        Ok(())
    }
}
