//! The Go runtime's heap-profile buckets, walked in the process's memory.
//!
//! A bucket (`runtime/mprof.go`, the same from Go 1.19 to 1.26 on amd64) is a header
//! (`next`, `allnext`, `typ`, `hash`, `size`, `nstk`), `nstk` return addresses, then a
//! `memRecord`: the `active` cycle (cumulative counts as of the last completed GC) and
//! three `future` cycles, each `allocs`, `frees`, `alloc_bytes`, `free_bytes`. The list
//! starts at `mbuckets` and goes on through `allnext`; buckets are never freed, and a
//! new one is published at the head only once written whole.
//!
//! The process can forge all of it: the walk stops at [`MAX_BUCKETS`] buckets or
//! [`MAX_WALK_BYTES`] read, or at an address seen before, each read is one bounded `process_vm_readv`, a bucket whose
//! type or depth is impossible ends the walk, and counts are taken as they come (torn
//! counts of a bucket being updated are what a reader without the runtime's locks
//! gets; they settle by the next read).

use std::collections::HashSet;

use allocbpf_images::memory::ProcessMemory;

/// Most buckets read in one walk.
pub const MAX_BUCKETS: usize = 1 << 18;

/// Most bytes of the process's memory one walk reads (a forged list of deep buckets
/// would otherwise have it read and hold gigabytes).
pub const MAX_WALK_BYTES: u64 = 64 << 20;

/// Deepest stack believed (Go 1.23+ `GODEBUG=profstackdepth` goes up to 1024, plus the
/// runtime's own frames).
pub const MAX_STACK: u64 = 1024 + 8;

/// `bucketType` of heap-profile buckets.
const MEM_PROFILE: u64 = 1;

/// Bytes of a bucket's header.
const HEADER_BYTES: usize = 0x30;

/// Bytes of a `memRecordCycle`.
const CYCLE_BYTES: usize = 32;

/// One `memRecordCycle`: counts of sampled allocations and frees and their bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Sampled allocations.
    pub allocs: u64,
    /// Sampled frees.
    pub frees: u64,
    /// Their bytes.
    pub alloc_bytes: u64,
    /// Freed bytes.
    pub free_bytes: u64,
}

impl Counts {
    fn read(bytes: &[u8]) -> Counts {
        let word = |i: usize| {
            bytes
                .get(8 * i..8 * i + 8)
                .map_or(0, |w| u64::from_le_bytes(w.try_into().unwrap_or_default()))
        };
        Counts {
            allocs: word(0),
            frees: word(1),
            alloc_bytes: word(2),
            free_bytes: word(3),
        }
    }

    /// The sum of two cycles' counts.
    pub fn plus(&self, other: &Counts) -> Counts {
        Counts {
            allocs: self.allocs.wrapping_add(other.allocs),
            frees: self.frees.wrapping_add(other.frees),
            alloc_bytes: self.alloc_bytes.wrapping_add(other.alloc_bytes),
            free_bytes: self.free_bytes.wrapping_add(other.free_bytes),
        }
    }
}

/// One heap-profile bucket as read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// The bucket's address (its identity across reads).
    pub address: u64,
    /// The allocation size of its samples.
    pub size: u64,
    /// Return addresses, innermost first.
    pub stack: Vec<u64>,
    /// The published counts (cumulative as of the last completed GC cycle).
    pub active: Counts,
    /// The three pending cycles.
    pub future: [Counts; 3],
}

impl Bucket {
    /// Every count, published or pending (what a bucket has recorded so far).
    pub fn pending(&self) -> Counts {
        self.future
            .iter()
            .fold(self.active, |total, cycle| total.plus(cycle))
    }

    /// What `runtime.MemProfile` reports for the bucket when the cycle counter reads
    /// `cycle`: the published counts plus the pending cycle it folds in first.
    pub fn reported(&self, cycle: Option<u32>) -> Counts {
        match cycle {
            Some(cycle) => self.active.plus(&self.future[(cycle as usize >> 1) % 3]),
            None => self.active,
        }
    }
}

/// Bytes of a bucket as read: header, stack, record.
pub fn bytes_of(bucket: &Bucket) -> u64 {
    (HEADER_BYTES + bucket.stack.len() * 8 + 4 * CYCLE_BYTES) as u64
}

/// How a walk ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WalkEnd {
    /// At the list's end.
    Complete,
    /// At [`MAX_BUCKETS`].
    TooMany,
    /// At an address seen before (a cycle: a forged list).
    Cycle,
    /// At a bucket that could not be read or is not a heap-profile bucket.
    Bad(u64),
}

/// The buckets of the process whose memory is `memory`, from the list head at
/// `mbuckets` (an address in the process); and how the walk ended.
pub fn walk(memory: &ProcessMemory, mbuckets: u64) -> (Vec<Bucket>, WalkEnd) {
    let mut buckets = Vec::new();
    let mut seen = HashSet::new();
    let Ok(mut next) = memory.u64(mbuckets) else {
        return (buckets, WalkEnd::Bad(mbuckets));
    };
    let mut buffer = Vec::new();
    let mut bytes = 0u64;
    while next != 0 {
        if buckets.len() >= MAX_BUCKETS || bytes >= MAX_WALK_BYTES {
            return (buckets, WalkEnd::TooMany);
        }
        if !seen.insert(next) {
            return (buckets, WalkEnd::Cycle);
        }
        let Some((bucket, allnext)) = read_bucket(memory, next, &mut buffer) else {
            return (buckets, WalkEnd::Bad(next));
        };
        bytes += bytes_of(&bucket);
        buckets.push(bucket);
        next = allnext;
    }
    (buckets, WalkEnd::Complete)
}

/// The bucket at `address` and its `allnext`, in two bounded reads.
fn read_bucket(
    memory: &ProcessMemory,
    address: u64,
    buffer: &mut Vec<u8>,
) -> Option<(Bucket, u64)> {
    let mut header = [0u8; HEADER_BYTES];
    memory.read(address, &mut header).ok()?;
    let word =
        |i: usize| u64::from_le_bytes(header[8 * i..8 * i + 8].try_into().unwrap_or_default());
    let (allnext, typ, size, nstk) = (word(1), word(2), word(4), word(5));
    if typ != MEM_PROFILE || nstk > MAX_STACK {
        return None;
    }
    let stack_bytes = nstk as usize * 8;
    buffer.resize(stack_bytes + 4 * CYCLE_BYTES, 0);
    memory
        .read(address.checked_add(HEADER_BYTES as u64)?, buffer)
        .ok()?;
    let stack = buffer[..stack_bytes]
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().unwrap_or_default()))
        .collect();
    let record = &buffer[stack_bytes..];
    let cycle = |i: usize| Counts::read(&record[i * CYCLE_BYTES..(i + 1) * CYCLE_BYTES]);
    Some((
        Bucket {
            address,
            size,
            stack,
            active: cycle(0),
            future: [cycle(1), cycle(2), cycle(3)],
        },
        allnext,
    ))
}

#[cfg(test)]
mod tests {
    //! Forged bucket lists in this process's own memory, read back through
    //! `process_vm_readv` as a target's would be.

    use super::*;

    /// A bucket's words: header, `nstk` return addresses, a memRecord.
    fn bucket(allnext: u64, typ: u64, size: u64, stack: &[u64], active: [u64; 4]) -> Vec<u64> {
        let mut words = vec![0, allnext, typ, 0, size, stack.len() as u64];
        words.extend_from_slice(stack);
        words.extend_from_slice(&active);
        words.extend_from_slice(&[0; 12]);
        words
    }

    fn me() -> ProcessMemory {
        ProcessMemory::new(std::process::id())
    }

    #[test]
    fn a_list_is_read_to_its_end() {
        let second = bucket(0, MEM_PROFILE, 64, &[0x401000], [3, 1, 192, 64]);
        let first = bucket(
            second.as_ptr() as u64,
            MEM_PROFILE,
            128,
            &[1, 2],
            [5, 0, 640, 0],
        );
        let head = [first.as_ptr() as u64];
        let (buckets, end) = walk(&me(), head.as_ptr() as u64);
        assert_eq!(end, WalkEnd::Complete);
        assert_eq!(buckets.len(), 2);
        assert_eq!(buckets[0].size, 128);
        assert_eq!(buckets[0].stack, vec![1, 2]);
        assert_eq!(buckets[1].active.frees, 1);
        assert_eq!(buckets[1].reported(Some(4)).allocs, 3);
    }

    #[test]
    fn a_cycle_ends_the_walk() {
        let mut looped = bucket(0, MEM_PROFILE, 64, &[1], [1, 0, 64, 0]);
        looped[1] = looped.as_ptr() as u64;
        let head = [looped.as_ptr() as u64];
        let (buckets, end) = walk(&me(), head.as_ptr() as u64);
        assert_eq!(end, WalkEnd::Cycle);
        assert_eq!(buckets.len(), 1);
    }

    #[test]
    fn impossible_buckets_and_pointers_end_the_walk() {
        // A stack deeper than any runtime keeps: not read.
        let mut deep = bucket(0, MEM_PROFILE, 64, &[1], [1, 0, 64, 0]);
        deep[5] = 1 << 40;
        let head = [deep.as_ptr() as u64];
        assert_eq!(
            walk(&me(), head.as_ptr() as u64).1,
            WalkEnd::Bad(deep.as_ptr() as u64)
        );
        // Another profile's bucket (a block profile's): not read.
        let block = bucket(0, 2, 64, &[1], [1, 0, 64, 0]);
        let head = [block.as_ptr() as u64];
        assert!(matches!(
            walk(&me(), head.as_ptr() as u64).1,
            WalkEnd::Bad(_)
        ));
        // A next pointer into nothing mapped.
        let wild = bucket(0x10, MEM_PROFILE, 64, &[1], [1, 0, 64, 0]);
        let head = [wild.as_ptr() as u64];
        let (buckets, end) = walk(&me(), head.as_ptr() as u64);
        assert_eq!((buckets.len(), end), (1, WalkEnd::Bad(0x10)));
        // A head that cannot be read.
        assert_eq!(walk(&me(), 0x10).1, WalkEnd::Bad(0x10));
    }
}
