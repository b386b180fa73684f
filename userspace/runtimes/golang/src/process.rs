//! One Go process read from outside: its executable examined once (version, function
//! table, where the profiling variables are), then its buckets read at each poll, the
//! counts since the previous poll given as deltas and the in-use counts as of the last
//! GC cycle.
//!
//! The executable is read through the kernel's link to the very file mapped
//! (`allocbpf_images::procfs::open_mapped`, checked and size-capped); the memory read
//! is the process's own, bounded ([`crate::buckets`]), through the toolkit's
//! [`RemoteMemory`] so that tests hand the reader forged memory.

use std::{collections::HashMap, path::PathBuf};

use allocbpf_images::{
    image::GO_PCLNTAB_SECTIONS,
    memory::ProcessMemory,
    procfs::{self, MapsEntry},
};
use allocbpf_runtime::toolkit::{cache::ENTRY_OVERHEAD, ByteCache, RemoteMemory};
use object::{Object, ObjectSegment};

use crate::{
    buckets::{self, Bucket, Counts, WalkEnd},
    buildinfo::{self, GoVersion},
    pclntab::{Location, Pclntab, PclntabError},
    runtime::{self, LocateError, ProfileVariables},
};

/// What a realistic location costs in the cache: the entry, a package-qualified
/// function name of some sixty characters (`github.com/org/repo/pkg.(*Type).Method`),
/// a source path of about a hundred, and the cache's own bookkeeping.
const TYPICAL_LOCATION_BYTES: usize = size_of::<Option<Location>>() + 64 + 96 + ENTRY_OVERHEAD;

/// Bytes of return addresses' locations a file remembers: as many realistic ones as
/// the 65,536 return addresses the cache was bounded by when it counted entries (more
/// than the call sites of the allocations of most programs). Counted in bytes, a
/// process forging stacks, or names as long as the function table allows, evicts the
/// least used locations and costs lookups, never more memory.
const MAX_CACHED_LOCATION_BYTES: usize = (1 << 16) * TYPICAL_LOCATION_BYTES;

/// The bytes a cached location holds: the entry and its strings.
fn location_bytes(location: &Option<Location>) -> usize {
    size_of::<Option<Location>>()
        + location.as_ref().map_or(0, |location| {
            location.function.len() + location.file.as_ref().map_or(0, String::len)
        })
}

/// Why a Go process cannot be read.
#[derive(Clone, Debug, thiserror::Error)]
pub enum GoError {
    /// Its function table could not be read.
    #[error("{path}: {source}")]
    Pclntab {
        /// The executable.
        path: String,
        /// Why.
        source: PclntabError,
    },
    /// The profiling variables were not found in its code.
    #[error("{path} ({version}): {source}")]
    Variables {
        /// The executable.
        path: String,
        /// Its Go version.
        version: String,
        /// Why.
        source: LocateError,
    },
    /// The executable could not be read.
    #[error("{path}: {reason}")]
    Unreadable {
        /// The executable.
        path: String,
        /// Why.
        reason: String,
        /// Its open failed for want of descriptors.
        out_of_descriptors: bool,
    },
}

/// A Go executable, whichever process runs it: what reading its processes needs (its
/// function table, its variables' addresses), not the file itself.
pub struct GoFile {
    /// Its function table.
    table: Pclntab,
    /// Its Go version.
    pub version: GoVersion,
    /// Where its profiling variables are (file addresses).
    pub variables: ProfileVariables,
    /// Its loadable segments: (address, file offset, file size).
    segments: Vec<(u64, u64, u64)>,
    /// Locations of return addresses (file addresses) seen so far; `None` for one the
    /// function table does not know.
    locations: ByteCache<u64, Option<Location>>,
}

impl GoFile {
    /// Examines the file `pid` maps at `mapping`: `Ok(None)` if it is not a Go
    /// executable (no `.gopclntab`).
    pub fn examine(pid: u32, mapping: &MapsEntry) -> Result<Option<GoFile>, GoError> {
        let path = mapping
            .file_path()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| mapping.name.to_string_lossy().into_owned());
        let unreadable = |reason: String| GoError::Unreadable {
            path: path.clone(),
            reason,
            out_of_descriptors: false,
        };
        let file = procfs::open_mapped(pid, mapping).map_err(|e| GoError::Unreadable {
            path: path.clone(),
            reason: e.to_string(),
            out_of_descriptors: e.out_of_descriptors(),
        })?;
        let data = procfs::read_mapped(&file, PathBuf::from(&path).as_path())
            .map_err(|e| unreadable(e.to_string()))?;
        let elf = object::File::parse(&*data).map_err(|e| unreadable(e.to_string()))?;
        if GO_PCLNTAB_SECTIONS
            .iter()
            .all(|name| elf.section_by_name(name).is_none())
        {
            return Ok(None);
        }
        let version = buildinfo::version(&elf).unwrap_or(GoVersion {
            text: "go (version unknown)".to_string(),
            minor: None,
        });
        let table = Pclntab::parse(&elf).map_err(|source| GoError::Pclntab {
            path: path.clone(),
            source,
        })?;
        let variables = runtime::locate(&elf, &table).map_err(|source| GoError::Variables {
            path: path.clone(),
            version: version.text.clone(),
            source,
        })?;
        let segments = elf
            .segments()
            .map(|s| {
                let (offset, size) = s.file_range();
                (s.address(), offset, size)
            })
            .collect();
        Ok(Some(GoFile {
            table,
            version,
            variables,
            segments,
            locations: ByteCache::new(MAX_CACHED_LOCATION_BYTES),
        }))
    }

    /// Where the return address `pc` (a file address) was: the innermost function at
    /// `pc - 1`, its file and line (the runtime's stacks already list each inlined
    /// call's own return address).
    pub fn location(&mut self, pc: u64) -> Option<Location> {
        if let Some(known) = self.locations.get(&pc) {
            return known.clone();
        }
        let found = pc.checked_sub(1).and_then(|at| {
            let func = self.table.func_at(at)?;
            self.table.location(&func, at)
        });
        let bytes = location_bytes(&found);
        self.locations.insert(pc, found.clone(), bytes);
        found
    }
}

/// Sampled objects of one bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Counted {
    /// The bucket's address in the process (its identity: a bucket never changes its
    /// stack or size).
    pub bucket: u64,
    /// Its stack: return addresses, in the file's addresses, innermost first.
    pub stack: Vec<u64>,
    /// Its objects' size.
    pub size: u64,
    /// How many sampled objects.
    pub count: u64,
}

/// One poll of a process's buckets.
#[derive(Clone, Debug, Default)]
pub struct Poll {
    /// Per bucket with new sampled allocations since the previous poll: the new count.
    pub allocated: Vec<Counted>,
    /// Per bucket with objects in use as of the last GC cycle: their count.
    pub in_use: Vec<Counted>,
    /// `runtime.MemProfileRate` as read (0: profiling is off).
    pub rate: i64,
    /// How the walk ended.
    pub end: Option<WalkEnd>,
    /// Buckets read.
    pub buckets: usize,
    /// Bytes of the process's memory read.
    pub bytes_read: u64,
}

/// A Go process being read.
pub struct GoProcess {
    memory: ProcessMemory,
    /// Added to a file address to get the process's.
    bias: u64,
    /// Counts reported at the previous poll, by bucket address.
    previous: HashMap<u64, Counts>,
    /// A poll set the baseline.
    polled: bool,
}

impl GoProcess {
    /// Process `pid`, which maps `file` at `mapping`; `None` if no loadable segment of
    /// the file holds the mapping's offset.
    pub fn new(pid: u32, file: &GoFile, mapping: &MapsEntry) -> Option<GoProcess> {
        // The address the file gives the mapping's first byte, from the segment the
        // mapping was made for: the one whose page-aligned offset it starts at (a
        // linker that does not pad segments to pages has the previous one's tail in
        // the same page), else one that holds its offset.
        let page = |offset: u64| offset & !0xfff;
        let holds = |&&(_, offset, size): &&(u64, u64, u64)| {
            (page(offset)..offset.saturating_add(size)).contains(&mapping.offset)
        };
        let segment = file
            .segments
            .iter()
            .find(|&&(_, offset, _)| page(offset) == mapping.offset)
            .or_else(|| file.segments.iter().find(holds))?;
        let &(address, offset, _) = segment;
        let linked = address.wrapping_add(mapping.offset).wrapping_sub(offset);
        Some(GoProcess {
            memory: ProcessMemory::new(pid),
            bias: mapping.range.start.wrapping_sub(linked),
            previous: HashMap::new(),
            polled: false,
        })
    }

    /// Reads the buckets of the process running `file`: the allocations sampled since
    /// the previous poll (the first poll only sets the baseline: nothing is new) and
    /// the objects in use.
    pub fn poll(&mut self, file: &GoFile) -> Result<Poll, std::io::Error> {
        let memory = self.memory;
        self.poll_memory(&memory, file.variables)
    }

    /// [`GoProcess::poll`] of the process whose memory `memory` reads (its own, or
    /// forged in tests), whose profiling variables are at `variables` (file addresses).
    fn poll_memory(
        &mut self,
        memory: &dyn RemoteMemory,
        variables: ProfileVariables,
    ) -> Result<Poll, std::io::Error> {
        let rate = memory.u64(self.bias.wrapping_add(variables.rate))? as i64;
        let cycle = variables
            .cycle
            .and_then(|c| memory.i32(self.bias.wrapping_add(c)).ok())
            .map(|c| c as u32);
        let (buckets, end) = buckets::walk(memory, self.bias.wrapping_add(variables.mbuckets));
        let first = !std::mem::replace(&mut self.polled, true);
        let mut poll = Poll {
            rate,
            end: Some(end),
            buckets: buckets.len(),
            // The rate, the cycle, the head, then each bucket whole.
            bytes_read: 8 + 4 + 8 + buckets.iter().map(buckets::bytes_of).sum::<u64>(),
            ..Poll::default()
        };
        // Before the first GC cycle nothing is published: the runtime then reports
        // every pending cycle (runtime.MemProfile does the same).
        let unpublished = buckets
            .iter()
            .all(|b| b.active.allocs == 0 && b.active.frees == 0);
        // A walk cut short keeps what the buckets it did not reach counted, so they
        // are not new when a later walk reaches them.
        let mut seen = match end {
            WalkEnd::Complete => HashMap::with_capacity(buckets.len()),
            _ => self.previous.clone(),
        };
        for bucket in buckets {
            let reported = match unpublished {
                true => bucket.pending(),
                false => bucket.reported(cycle),
            };
            let before = self.previous.get(&bucket.address).copied();
            let new = match before {
                // Counts only grow; a smaller one is a torn or forged read: skipped.
                Some(before) => reported.allocs.saturating_sub(before.allocs),
                None if first => 0,
                None => reported.allocs,
            };
            let live = reported.allocs.saturating_sub(reported.frees);
            let stack = self.file_addresses(&bucket);
            if new > 0 {
                poll.allocated.push(Counted {
                    bucket: bucket.address,
                    stack: stack.clone(),
                    size: bucket.size,
                    count: new,
                });
            }
            if live > 0 {
                poll.in_use.push(Counted {
                    bucket: bucket.address,
                    stack,
                    size: bucket.size,
                    count: live,
                });
            }
            // The baseline counts what was allocated before it, published or still
            // pending (it is published later, and is not new then).
            let counted = if first { bucket.pending() } else { reported };
            let kept = match before {
                Some(before) if counted.allocs < before.allocs => before,
                _ => counted,
            };
            seen.insert(bucket.address, kept);
        }
        self.previous = seen;
        Ok(poll)
    }

    /// The bucket's stack in the file's addresses.
    fn file_addresses(&self, bucket: &Bucket) -> Vec<u64> {
        bucket
            .stack
            .iter()
            .map(|pc| pc.wrapping_sub(self.bias))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    //! A Go process's profiling variables and bucket list forged in [`FakeMemory`],
    //! polled as a real one is.

    use allocbpf_runtime::toolkit::FakeMemory;

    use super::*;

    /// Where the executable is loaded: process addresses are file addresses plus it.
    const BIAS: u64 = 0x7f00_0000_0000;
    const VARIABLES: ProfileVariables = ProfileVariables {
        rate: 0x5000,
        cycle: Some(0x5008),
        mbuckets: 0x5010,
    };
    const FIRST: u64 = 0x10_0000;
    const SECOND: u64 = 0x20_0000;

    /// A heap-profile bucket's bytes: `stack` (process addresses), its active counts
    /// and one pending cycle's allocations in `future[2]`.
    fn bucket(allnext: u64, size: u64, stack: &[u64], active: [u64; 4], pending: u64) -> Vec<u8> {
        let mut words = vec![0, allnext, 1, 0, size, stack.len() as u64];
        words.extend_from_slice(stack);
        words.extend_from_slice(&active);
        words.extend_from_slice(&[0; 8]);
        words.extend_from_slice(&[pending, 0, 0, 0]);
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    fn process() -> GoProcess {
        GoProcess {
            memory: ProcessMemory::new(0),
            bias: BIAS,
            previous: HashMap::new(),
            polled: false,
        }
    }

    fn counted(bucket: u64, stack: &[u64], size: u64, count: u64) -> Counted {
        Counted {
            bucket,
            stack: stack.to_vec(),
            size,
            count,
        }
    }

    #[test]
    fn polls_read_new_allocations_and_objects_in_use_from_forged_memory() {
        let mut memory = FakeMemory::new();
        let mut variables = vec![0u8; 24];
        variables[..8].copy_from_slice(&(512u64 * 1024).to_le_bytes());
        // Cycle 2 (shifted left by one): the reader folds in `future[2]`.
        variables[8..12].copy_from_slice(&4u32.to_le_bytes());
        variables[16..].copy_from_slice(&FIRST.to_le_bytes());
        let stack = [BIAS + 0x401000, BIAS + 0x402000];
        memory
            .map(BIAS + VARIABLES.rate, variables)
            .map(FIRST, bucket(0, 64, &stack, [5, 2, 320, 128], 1));
        let mut process = process();

        // The first poll sets the baseline: nothing new, 6 - 2 objects in use.
        let poll = process.poll_memory(&memory, VARIABLES).unwrap();
        let file_stack = [0x401000, 0x402000];
        assert_eq!(poll.rate, 512 * 1024);
        assert_eq!(poll.allocated, []);
        assert_eq!(poll.in_use, [counted(FIRST, &file_stack, 64, 4)]);

        // Three more published allocations, and a new bucket at the head.
        memory.write_u64(FIRST + 8 * 8, 8);
        memory
            .map(
                SECOND,
                bucket(FIRST, 128, &[BIAS + 0x403000], [2, 0, 256, 0], 0),
            )
            .write_u64(BIAS + VARIABLES.mbuckets, SECOND);
        let poll = process.poll_memory(&memory, VARIABLES).unwrap();
        assert_eq!((poll.end, poll.buckets), (Some(WalkEnd::Complete), 2));
        assert_eq!(
            poll.bytes_read,
            8 + 4 + 8 + (48 + 16 + 128) + (48 + 8 + 128)
        );
        assert_eq!(
            poll.allocated,
            [
                counted(SECOND, &[0x403000], 128, 2),
                counted(FIRST, &file_stack, 64, 3),
            ]
        );
        assert_eq!(
            poll.in_use,
            [
                counted(SECOND, &[0x403000], 128, 2),
                counted(FIRST, &file_stack, 64, 7),
            ]
        );

        // A count that went down is torn or forged: nothing new, and the next poll
        // counts from the larger one.
        memory.write_u64(FIRST + 8 * 8, 1);
        let poll = process.poll_memory(&memory, VARIABLES).unwrap();
        assert_eq!(poll.allocated, []);
        memory.write_u64(FIRST + 8 * 8, 10);
        let poll = process.poll_memory(&memory, VARIABLES).unwrap();
        assert_eq!(poll.allocated, [counted(FIRST, &file_stack, 64, 2)]);

        // Variables that cannot be read: no poll.
        let memory = FakeMemory::new();
        assert!(process.poll_memory(&memory, VARIABLES).is_err());
    }
}
