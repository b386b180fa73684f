//! Reading another process's memory: `process_vm_readv`, bounded by the caller's
//! buffer, never following anything on its own, and never waited for longer than a
//! deadline ([`deadline`]). What comes back is the target's to forge: callers validate
//! every word before they believe it.

pub mod deadline;
pub mod mappings;

use std::io;

/// Reads of one process's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessMemory {
    pid: u32,
}

impl ProcessMemory {
    /// The memory of process `pid` (readable by root), as the image it runs now: once
    /// it execs or exits, reads fail until [`mappings::forget`] ([`mappings::bind`]).
    pub fn new(pid: u32) -> Self {
        mappings::bind(pid);
        Self { pid }
    }

    /// The process read.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Fills `buffer` from `address`; fails unless every byte was read, and within
    /// [`deadline::READ_DEADLINE`] (past it the process is set aside: see [`deadline`]).
    pub fn read(&self, address: u64, buffer: &mut [u8]) -> io::Result<()> {
        if buffer.is_empty() {
            return Ok(());
        }
        match mappings::verdict(self.pid, address, buffer.len()) {
            mappings::Verdict::Direct => {
                deadline::read_unless_set_aside(self.pid, address, buffer, read_unguarded)
            }
            mappings::Verdict::Deadline => {
                deadline::read_within_deadline(self.pid, address, buffer, read_unguarded)
            }
            mappings::Verdict::Unmapped => Err(io::Error::from_raw_os_error(libc::EFAULT)),
            mappings::Verdict::Changed => Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "pid {} no longer runs the image its reader was made for (exec or exit)",
                    self.pid
                ),
            )),
        }
    }

    /// The little-endian u64 at `address`.
    pub fn u64(&self, address: u64) -> io::Result<u64> {
        let mut word = [0u8; 8];
        self.read(address, &mut word)?;
        Ok(u64::from_le_bytes(word))
    }

    /// The little-endian i32 at `address`.
    pub fn i32(&self, address: u64) -> io::Result<i32> {
        let mut word = [0u8; 4];
        self.read(address, &mut word)?;
        Ok(i32::from_le_bytes(word))
    }
}

/// One `process_vm_readv` of `buffer.len()` bytes at `address` in `pid`, on this thread
/// and unjudged: it may wait as long as a fault takes. Only [`ProcessMemory::read`]'s
/// verdicts call it on another process (and the benchmark, as its baseline).
pub fn read_unguarded(pid: u32, address: u64, buffer: &mut [u8]) -> io::Result<()> {
    let local = libc::iovec {
        iov_base: buffer.as_mut_ptr().cast(),
        iov_len: buffer.len(),
    };
    let remote = libc::iovec {
        iov_base: address as usize as *mut libc::c_void,
        iov_len: buffer.len(),
    };
    // SAFETY: `local` describes `buffer`, writable for its length; the kernel checks
    // the remote range and copies at most that many bytes.
    let read = unsafe { libc::process_vm_readv(pid as i32, &local, 1, &remote, 1, 0) };
    if read < 0 {
        return Err(io::Error::last_os_error());
    }
    if read as usize != buffer.len() {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "short read"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_our_own_memory_and_refuses_unmapped_addresses() {
        let value: u64 = 0x0123_4567_89ab_cdef;
        let memory = ProcessMemory::new(std::process::id());
        assert_eq!(memory.u64(&value as *const u64 as u64).unwrap(), value);
        assert!(memory.u64(8).is_err());
    }
}
