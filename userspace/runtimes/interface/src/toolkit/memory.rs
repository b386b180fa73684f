//! Another process's memory, as every runtime reads it: a trait over
//! `process_vm_readv` ([`ProcessMemory`]) and a fake that serves forged bytes
//! ([`FakeMemory`]), so that readers are tested on what a hostile process could put in
//! its memory. Nothing read is believed: callers bound every length and validate every
//! word.

use std::{collections::BTreeMap, io};

use allocbpf_images::memory::ProcessMemory;

/// Reads of one process's memory.
pub trait RemoteMemory {
    /// Fills `buffer` from `address`; fails unless every byte was read.
    fn read(&self, address: u64, buffer: &mut [u8]) -> io::Result<()>;

    /// The little-endian u64 at `address`.
    fn u64(&self, address: u64) -> io::Result<u64> {
        let mut word = [0u8; 8];
        self.read(address, &mut word)?;
        Ok(u64::from_le_bytes(word))
    }

    /// The little-endian u32 at `address`.
    fn u32(&self, address: u64) -> io::Result<u32> {
        let mut word = [0u8; 4];
        self.read(address, &mut word)?;
        Ok(u32::from_le_bytes(word))
    }

    /// The little-endian i32 at `address`.
    fn i32(&self, address: u64) -> io::Result<i32> {
        Ok(self.u32(address)? as i32)
    }

    /// The little-endian u16 at `address`.
    fn u16(&self, address: u64) -> io::Result<u16> {
        let mut word = [0u8; 2];
        self.read(address, &mut word)?;
        Ok(u16::from_le_bytes(word))
    }
}

impl RemoteMemory for ProcessMemory {
    fn read(&self, address: u64, buffer: &mut [u8]) -> io::Result<()> {
        ProcessMemory::read(self, address, buffer)
    }
}

/// Forged memory for tests: regions of bytes at addresses, and nothing elsewhere. A
/// read succeeds only if every byte it asks for lies in one region, as a read of a
/// real process fails across an unmapped page.
#[derive(Clone, Debug, Default)]
pub struct FakeMemory {
    regions: BTreeMap<u64, Vec<u8>>,
}

impl FakeMemory {
    /// No memory at all.
    pub fn new() -> Self {
        Self::default()
    }

    /// Maps `bytes` at `address` (replacing a region that starts there).
    pub fn map(&mut self, address: u64, bytes: impl Into<Vec<u8>>) -> &mut Self {
        self.regions.insert(address, bytes.into());
        self
    }

    /// Writes `bytes` at `address` inside a region mapped before.
    ///
    /// # Panics
    /// If no region holds every byte (a test's own mistake).
    pub fn write(&mut self, address: u64, bytes: &[u8]) -> &mut Self {
        let (start, region) = (self.regions.range_mut(..=address))
            .next_back()
            .expect("a region mapped below the write");
        let at = (address - start) as usize;
        region[at..at + bytes.len()].copy_from_slice(bytes);
        self
    }

    /// Writes the little-endian `value` at `address` (see [`FakeMemory::write`]).
    pub fn write_u64(&mut self, address: u64, value: u64) -> &mut Self {
        self.write(address, &value.to_le_bytes())
    }

    /// Writes the little-endian `value` at `address` (see [`FakeMemory::write`]).
    pub fn write_u32(&mut self, address: u64, value: u32) -> &mut Self {
        self.write(address, &value.to_le_bytes())
    }
}

impl RemoteMemory for FakeMemory {
    fn read(&self, address: u64, buffer: &mut [u8]) -> io::Result<()> {
        let unmapped = || io::Error::from_raw_os_error(libc_efault());
        let (start, region) = self
            .regions
            .range(..=address)
            .next_back()
            .ok_or_else(unmapped)?;
        let at = usize::try_from(address - start).map_err(|_| unmapped())?;
        let end = at.checked_add(buffer.len()).ok_or_else(unmapped)?;
        buffer.copy_from_slice(region.get(at..end).ok_or_else(unmapped)?);
        Ok(())
    }
}

/// `EFAULT`, what `process_vm_readv` says of an address nothing maps.
const fn libc_efault() -> i32 {
    14
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_within_a_region_succeed_and_across_its_end_fail() {
        let mut memory = FakeMemory::new();
        memory
            .map(0x1000, vec![0u8; 16])
            .write_u64(0x1008, 0xdead_beef);
        assert_eq!(memory.u64(0x1008).unwrap(), 0xdead_beef);
        assert_eq!(memory.u32(0x1008).unwrap(), 0xdead_beef);
        assert!(memory.u64(0x100c).is_err(), "past the region's end");
        assert!(memory.u64(0xff8).is_err(), "below every region");
        assert!(
            memory.u64(u64::MAX - 3).is_err(),
            "at the top of the address space"
        );
        let mut empty = [0u8; 0];
        assert!(memory.read(0x1010, &mut empty).is_ok());
    }

    #[test]
    fn a_real_process_reads_through_the_same_trait() {
        let value: u64 = 0x0123_4567_89ab_cdef;
        let memory: &dyn RemoteMemory = &ProcessMemory::new(std::process::id());
        assert_eq!(memory.u64(&value as *const u64 as u64).unwrap(), value);
    }
}
