//! `THREAD_SLOTS`, read through memory mappings a chunk at a time (`mapped_array.rs`):
//! the resident set holds one chunk at most, not the whole table, and a scan costs a
//! few system calls per chunk, not one per slot.

use std::os::fd::{AsFd, OwnedFd};

use allocbpf_common::ThreadState;
use aya::maps::Map;

use super::{
    load_error,
    mapped_array::{MappedArray, PAGE},
    missing, ProbeError,
};

/// Slots mapped at once: a whole number of pages (512 slots of 152 bytes are 19 pages),
/// so every chunk starts on a page boundary.
const CHUNK_SLOTS: usize = 4096;

/// `THREAD_SLOTS`: its length and a descriptor of its own, to map chunks of it.
pub(super) struct SlotTable {
    fd: OwnedFd,
    len: usize,
}

impl SlotTable {
    /// The `len` slots of the (`BPF_F_MMAPABLE`) array `map`.
    pub(super) fn new(map: &Map, len: usize) -> Result<SlotTable, ProbeError> {
        let Map::Array(data) = map else {
            return Err(load_error(missing("THREAD_SLOTS array")));
        };
        let fd = data
            .fd()
            .as_fd()
            .try_clone_to_owned()
            .map_err(|source| ProbeError::System {
                map: "THREAD_SLOTS",
                source,
            })?;
        const { assert!((CHUNK_SLOTS * std::mem::size_of::<ThreadState>()).is_multiple_of(PAGE)) };
        // Mapped once now, so that a table that cannot be mapped fails the load, not
        // every scan after it.
        MappedArray::<ThreadState>::map(fd.as_fd(), "THREAD_SLOTS", 0, len.min(CHUNK_SLOTS))?;
        Ok(SlotTable { fd, len })
    }

    /// Calls `visit` with each chunk of the table, mapped, in order; stops at the first
    /// chunk that cannot be mapped.
    pub(super) fn for_each_chunk(
        &self,
        mut visit: impl FnMut(&SlotChunk),
    ) -> Result<(), ProbeError> {
        for first in (0..self.len).step_by(CHUNK_SLOTS) {
            let len = CHUNK_SLOTS.min(self.len - first);
            let slots = MappedArray::map(self.fd.as_fd(), "THREAD_SLOTS", first, len)?;
            visit(&SlotChunk { slots });
        }
        Ok(())
    }
}

/// A chunk of `THREAD_SLOTS`, mapped while it is visited.
pub(super) struct SlotChunk {
    slots: MappedArray<ThreadState>,
}

impl SlotChunk {
    /// Slots in this chunk.
    pub(super) fn len(&self) -> usize {
        self.slots.len()
    }

    /// A copy of slot `index` of this chunk, or `None` for a free slot. `tid` and
    /// `exited` are read first: a slot being claimed meanwhile (a free slot holds zero
    /// counts, see [`SlotChunk::free`]) shows at worst a new thread's zero counts.
    pub(super) fn get(&self, index: usize) -> Option<ThreadState> {
        let slot = self.slots.entry(index);
        // SAFETY: a slot of the mapping; the kernel may write concurrently, which
        // volatile reads tolerate (only frozen or closed-epoch fields are used).
        unsafe {
            if std::ptr::addr_of!((*slot).tid).read_volatile() == 0 {
                return None;
            }
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            Some(std::ptr::read_volatile(slot))
        }
    }

    /// Frees a frozen slot: its counts are zeroed (still frozen), then `tid`, so a thread
    /// claiming it (which checks `tid == 0`, then writes the whole slot) never meets
    /// stale counts or a stale `exited`.
    pub(super) fn free(&self, index: usize) {
        let slot = self.slots.entry(index);
        // SAFETY: a slot of the mapping; a frozen slot has no other writer until `tid`
        // is 0.
        unsafe {
            let tid = (*slot).tid;
            std::ptr::write_volatile(
                slot,
                // Still frozen: a thread reusing the tid must not adopt it half-zeroed.
                ThreadState {
                    tid,
                    exited: 1,
                    ..ThreadState::default()
                },
            );
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            std::ptr::addr_of_mut!((*slot).tid).write_volatile(0);
        }
    }
}
