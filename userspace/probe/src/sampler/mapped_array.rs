//! A window of a `BPF_F_MMAPABLE` array, mapped into our address space until dropped.
//!
//! The kernel fills an array's mapping at `mmap` time, every page of it, so a mapping
//! kept for the agent's life would keep the whole array in our resident set although
//! we touch it only now and then. Readers and writers map what they need for one pass
//! and unmap it after: a few system calls a pass instead of a system call an entry.

use std::{
    marker::PhantomData,
    os::fd::{AsFd, AsRawFd, BorrowedFd},
};

use super::ProbeError;

/// The page size the kernel maps arrays in.
pub(super) const PAGE: usize = 4096;

/// Entries `first..first + len` of an array of `T`, mapped read-write.
pub(super) struct MappedArray<T> {
    base: *mut T,
    len: usize,
    bytes: usize,
    _entries: PhantomData<T>,
}

impl<T> MappedArray<T> {
    /// Maps entries `first..first + len` of the array behind `fd` (named `map` in
    /// errors). `first * size_of::<T>()` must be a whole number of pages; the kernel
    /// checks the range against the array's own pages.
    pub(super) fn map(
        fd: BorrowedFd<'_>,
        map: &'static str,
        first: usize,
        len: usize,
    ) -> Result<MappedArray<T>, ProbeError> {
        let size = std::mem::size_of::<T>();
        let offset = first * size;
        assert!(
            offset.is_multiple_of(PAGE),
            "{map}: a window must start on a page"
        );
        let bytes = (len * size).div_ceil(PAGE) * PAGE;
        // SAFETY: a shared mapping of a BPF array fd; the kernel refuses ranges outside
        // the array.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_fd().as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(ProbeError::System {
                map,
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(MappedArray {
            base: base.cast(),
            len,
            bytes,
            _entries: PhantomData,
        })
    }

    /// Entries in this window.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// A pointer to entry `index` of this window, which the kernel may write
    /// concurrently: read and write it with volatile accesses.
    pub(super) fn entry(&self, index: usize) -> *mut T {
        assert!(index < self.len);
        // SAFETY: in bounds of the mapping.
        unsafe { self.base.add(index) }
    }
}

impl<T> Drop for MappedArray<T> {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `map` mapped.
        unsafe { libc::munmap(self.base.cast(), self.bytes) };
    }
}
