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
//! [`MAX_WALK_BYTES`] read, or at an address seen before, each read is one bounded
//! read of its memory ([`RemoteMemory`]: `process_vm_readv`, or forged bytes in
//! tests), a bucket whose type or depth is impossible ends the walk, and counts are
//! taken as they come (torn counts of a bucket being updated are what a reader without
//! the runtime's locks gets; they settle by the next read).

use std::collections::HashSet;

use allocbpf_runtime::toolkit::RemoteMemory;

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
pub fn walk(memory: &dyn RemoteMemory, mbuckets: u64) -> (Vec<Bucket>, WalkEnd) {
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
    memory: &dyn RemoteMemory,
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
    //! `process_vm_readv` as a target's would be; and forged in [`FakeMemory`], at
    //! addresses and of sizes no list in this process's memory could have.

    use super::*;
    use allocbpf_images::memory::ProcessMemory;
    use allocbpf_runtime::toolkit::FakeMemory;

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

    /// Little-endian bytes of `words`.
    fn bytes(words: &[u64]) -> Vec<u8> {
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    /// Where the forged list's head and buckets are.
    const HEAD: u64 = 0x1000;
    const FIRST: u64 = 0x10_0000;
    const SECOND: u64 = 0x20_0000;
    const UNMAPPED: u64 = 0xdead_0000;

    /// Memory holding the head, pointing at `FIRST`, and `buckets` at their addresses.
    fn forged(buckets: &[(u64, Vec<u64>)]) -> FakeMemory {
        let mut memory = FakeMemory::new();
        memory.map(HEAD, bytes(&[FIRST]));
        for (address, words) in buckets {
            memory.map(*address, bytes(words));
        }
        memory
    }

    /// The bucket at `address` as read: `stack`, `size`, `active` counts, and `future`
    /// (zeros, as [`bucket`] leaves them).
    fn read(address: u64, size: u64, stack: &[u64], active: [u64; 4]) -> Bucket {
        Bucket {
            address,
            size,
            stack: stack.to_vec(),
            active: Counts {
                allocs: active[0],
                frees: active[1],
                alloc_bytes: active[2],
                free_bytes: active[3],
            },
            future: [Counts::default(); 3],
        }
    }

    #[test]
    fn a_forged_two_bucket_list_is_read_to_its_end() {
        let memory = forged(&[
            (
                FIRST,
                bucket(
                    SECOND,
                    MEM_PROFILE,
                    128,
                    &[0x401000, 0x402000],
                    [5, 2, 640, 256],
                ),
            ),
            (
                SECOND,
                bucket(0, MEM_PROFILE, 64, &[0x403000], [3, 1, 192, 64]),
            ),
        ]);
        let (buckets, end) = walk(&memory, HEAD);
        assert_eq!(end, WalkEnd::Complete);
        assert_eq!(
            buckets,
            [
                read(FIRST, 128, &[0x401000, 0x402000], [5, 2, 640, 256]),
                read(SECOND, 64, &[0x403000], [3, 1, 192, 64]),
            ]
        );
        let read_bytes: u64 = buckets.iter().map(bytes_of).sum();
        assert_eq!(read_bytes, 2 * (48 + 128) + 3 * 8);
        // An empty list: nothing, and complete.
        let mut memory = FakeMemory::new();
        memory.map(HEAD, bytes(&[0]));
        assert_eq!(walk(&memory, HEAD), (vec![], WalkEnd::Complete));
    }

    #[test]
    fn a_forged_loop_ends_at_the_first_bucket_seen_again() {
        // FIRST -> SECOND -> FIRST: each read once.
        let memory = forged(&[
            (
                FIRST,
                bucket(SECOND, MEM_PROFILE, 128, &[1], [1, 0, 128, 0]),
            ),
            (SECOND, bucket(FIRST, MEM_PROFILE, 64, &[2], [2, 0, 128, 0])),
        ]);
        let (buckets, end) = walk(&memory, HEAD);
        assert_eq!(end, WalkEnd::Cycle);
        let addresses: Vec<u64> = buckets.iter().map(|b| b.address).collect();
        assert_eq!(addresses, [FIRST, SECOND]);
        // A bucket that is its own next.
        let memory = forged(&[(FIRST, bucket(FIRST, MEM_PROFILE, 8, &[1], [1, 0, 8, 0]))]);
        let (buckets, end) = walk(&memory, HEAD);
        assert_eq!((buckets.len(), end), (1, WalkEnd::Cycle));
    }

    #[test]
    fn a_huge_stack_depth_is_not_read() {
        // The deepest stack believed, whole: read.
        let deepest: Vec<u64> = (1..=MAX_STACK).collect();
        let memory = forged(&[(FIRST, bucket(0, MEM_PROFILE, 8, &deepest, [1, 0, 8, 0]))]);
        let (buckets, end) = walk(&memory, HEAD);
        assert_eq!(end, WalkEnd::Complete);
        assert_eq!(buckets, [read(FIRST, 8, &deepest, [1, 0, 8, 0])]);
        // One deeper, or as deep as a word says, after a good bucket: the walk ends
        // there, having read nothing of it.
        for depth in [MAX_STACK + 1, 1 << 40, u64::MAX] {
            let mut deep = bucket(0, MEM_PROFILE, 8, &[1], [1, 0, 8, 0]);
            deep[5] = depth;
            let memory = forged(&[
                (
                    FIRST,
                    bucket(SECOND, MEM_PROFILE, 128, &[1], [1, 0, 128, 0]),
                ),
                (SECOND, deep),
            ]);
            let (buckets, end) = walk(&memory, HEAD);
            assert_eq!(end, WalkEnd::Bad(SECOND), "depth {depth}");
            assert_eq!(buckets, [read(FIRST, 128, &[1], [1, 0, 128, 0])]);
        }
        // A depth believed, but a stack the memory ends in.
        let mut cut = bucket(0, MEM_PROFILE, 8, &deepest, [1, 0, 8, 0]);
        cut.truncate(6 + 100);
        let memory = forged(&[(FIRST, cut)]);
        assert_eq!(walk(&memory, HEAD), (vec![], WalkEnd::Bad(FIRST)));
    }

    #[test]
    fn an_unmapped_next_pointer_ends_the_walk_after_the_buckets_read() {
        let good = || bucket(UNMAPPED, MEM_PROFILE, 128, &[7], [4, 1, 512, 128]);
        let memory = forged(&[(FIRST, good())]);
        let (buckets, end) = walk(&memory, HEAD);
        assert_eq!(end, WalkEnd::Bad(UNMAPPED));
        assert_eq!(buckets, [read(FIRST, 128, &[7], [4, 1, 512, 128])]);
        // Next pointers at the top of the address space: no read wraps around.
        for next in [u64::MAX, u64::MAX - HEADER_BYTES as u64 + 8] {
            let mut memory = forged(&[(FIRST, good())]);
            memory.write_u64(FIRST + 8, next);
            let (buckets, end) = walk(&memory, HEAD);
            assert_eq!((buckets.len(), end), (1, WalkEnd::Bad(next)));
        }
        // A head that points at nothing, a head that is not there.
        let memory = forged(&[]);
        assert_eq!(walk(&memory, HEAD), (vec![], WalkEnd::Bad(FIRST)));
        assert_eq!(walk(&memory, UNMAPPED), (vec![], WalkEnd::Bad(UNMAPPED)));
    }

    /// Buckets of depth `depth` every 48 bytes from `FIRST`, `count` of them, each
    /// header inside the previous bucket's stack or record (what a process can forge
    /// in little memory), the last one's next pointing past them all.
    fn overlapping(depth: u64, count: u64) -> FakeMemory {
        let stride = HEADER_BYTES as u64;
        let span = (HEADER_BYTES as u64 + depth * 8 + 4 * CYCLE_BYTES as u64) / 8;
        let mut words = vec![0u64; (count * stride / 8 + span) as usize];
        for index in 0..count {
            let at = (index * stride / 8) as usize;
            let next = FIRST + (index + 1) * stride;
            words[at..at + 6].copy_from_slice(&[0, next, MEM_PROFILE, 0, 16, depth]);
        }
        let mut memory = FakeMemory::new();
        memory.map(HEAD, bytes(&[FIRST])).map(FIRST, bytes(&words));
        memory
    }

    #[test]
    fn forged_deep_buckets_stop_at_the_bytes_a_walk_reads() {
        let each = (HEADER_BYTES as u64) + MAX_STACK * 8 + 4 * CYCLE_BYTES as u64;
        let reached = MAX_WALK_BYTES.div_ceil(each);
        let (buckets, end) = walk(&overlapping(MAX_STACK, reached + 10), HEAD);
        assert_eq!(end, WalkEnd::TooMany);
        assert_eq!(buckets.len() as u64, reached);
        assert!(buckets.iter().all(|b| b.stack.len() as u64 == MAX_STACK));
    }

    #[test]
    fn forged_shallow_buckets_stop_at_the_buckets_a_walk_reads() {
        let (buckets, end) = walk(&overlapping(0, MAX_BUCKETS as u64 + 10), HEAD);
        assert_eq!(end, WalkEnd::TooMany);
        assert_eq!(buckets.len(), MAX_BUCKETS);
        let last = buckets.last().unwrap().address;
        assert_eq!(last, FIRST + (MAX_BUCKETS as u64 - 1) * HEADER_BYTES as u64);
    }
}
