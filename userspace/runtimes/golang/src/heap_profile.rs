//! Go as a [`Runtime`]: a Go process's heap profile is its runtime's own sampler's,
//! read from its memory, not probed. A Go executable is examined once per file; each
//! process is polled every [`GO_POLL_INTERVAL`] and at each cut. A poll adds the
//! sampled allocations new since the previous one (each bucket's count, at the rate the
//! process samples at) and replaces the objects in use (as of its last GC cycle).

use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

use allocbpf_profile::frame::{Frame, LocationStyle, SourceLocation, SourceLocations};
use allocbpf_runtime::{
    mark_runtime_frames,
    toolkit::{cache::ENTRY_OVERHEAD, ByteCache, ProcessStates, RetryPolicy},
    Counted, Departure, Found, IsCurrent, PollFigures, Polled, ProcessPoll, ProcessView, Runtime,
    RuntimeMaps,
};

use crate::{
    buckets::WalkEnd,
    process::{self, GoError, GoFile, GoProcess, Poll},
};

/// This runtime's [`Runtime::name`].
pub const NAME: &str = "go";

/// The outermost frame of every stack read from the Go runtime's heap profile: in a
/// program that also allocates through malloc (cgo), each stack says which sampler it
/// came from.
pub const GO_SAMPLER_FRAME: &str = "[go runtime heap profile]";

/// How a return address the function table does not know reads.
pub const UNKNOWN_GO_FRAME: &str = "[go: unknown pc]";

/// How often Go processes are polled between cuts (a process that exits between two
/// polls loses what it allocated since the last one).
pub const GO_POLL_INTERVAL: Duration = Duration::from_secs(1);

/// Go executables remembered (by device and inode); past it those no process is read
/// through go, and a file beyond it is not read.
const MAX_GO_FILES: usize = 256;

/// A Go process is never looked at again: what reading it needs is in its executable
/// and its memory from its start, so a look that fails would fail again.
const NO_RETRY: RetryPolicy = RetryPolicy {
    every: GO_POLL_INTERVAL,
    times: 0,
};

/// What a realistic bucket's frames cost in the cache: the entry, a stack as deep as
/// the runtime records by default before Go 1.23 (32 frames; deeper ones are rarer),
/// and the cache's own bookkeeping.
const TYPICAL_FRAMES_BYTES: usize =
    size_of::<Vec<Frame>>() + 32 * size_of::<Frame>() + ENTRY_OVERHEAD;

/// Bytes of buckets' frames kept per process at least: as many realistic ones as the
/// buckets of a large service's heap profile (16,384: sizes times allocation sites).
const MIN_FRAMES_BYTES: usize = 16_384 * TYPICAL_FRAMES_BYTES;

/// Bytes of buckets' frames kept per process at most, whatever a poll lists: a forged
/// list of deep buckets costs lookups of their frames again, never more memory.
const MAX_FRAMES_BYTES: usize = 64 << 20;

/// The bound of a process's frames cache for a poll that lists `poll`'s buckets: twice
/// what their frames take (a poll names every bucket it lists, in order, the worst
/// case for a cache that evicts the least recently used: a bound below what one poll
/// needs would miss every time), within [`MIN_FRAMES_BYTES`] and [`MAX_FRAMES_BYTES`].
fn frames_bound(poll: &Poll) -> usize {
    let needed: usize = (poll.allocated.iter().chain(&poll.in_use))
        .map(|bucket| {
            ENTRY_OVERHEAD + size_of::<Vec<Frame>>() + bucket.stack.len() * size_of::<Frame>()
        })
        .sum();
    needed
        .saturating_mul(2)
        .clamp(MIN_FRAMES_BYTES, MAX_FRAMES_BYTES)
}

/// One Go process read.
struct GoReader {
    process: GoProcess,
    /// Its executable's key in [`GoRuntime::files`].
    file: (u64, u64),
    /// Its start time (a later process with its pid is not read as this one).
    start_time: Option<u64>,
    /// The frames of each bucket read so far (a bucket's stack never changes).
    frames: ByteCache<u64, Vec<Frame>>,
}

/// The Go processes read, and their files.
pub struct GoRuntime {
    /// Examined files: `None` for one that cannot be read as Go.
    files: HashMap<(u64, u64), Option<GoFile>>,
    /// Processes polled (no kernel map: a Go process's profile is read, not walked).
    processes: ProcessStates<GoReader>,
    /// Processes whose runtime does not sample (rate 0), said once.
    not_sampling: HashSet<u32>,
    /// How each process's last walk of its bucket list ended, when it did not reach the
    /// list's end (said when it changes).
    walk_ends: HashMap<u32, WalkEnd>,
    /// When they were last polled.
    last_poll: Option<Instant>,
    /// Opens of executables that failed for want of descriptors so far.
    descriptor_errors: u64,
}

impl Default for GoRuntime {
    fn default() -> Self {
        Self {
            files: HashMap::new(),
            processes: ProcessStates::new(NO_RETRY, None),
            not_sampling: HashSet::new(),
            walk_ends: HashMap::new(),
            last_poll: None,
            descriptor_errors: 0,
        }
    }
}

impl Runtime for GoRuntime {
    fn name(&self) -> &'static str {
        NAME
    }

    fn held_locations(&self, mark: &mut dyn FnMut(u32)) {
        let cached = (self.processes.states()).flat_map(|reader| reader.frames.values());
        mark_runtime_frames(cached, mark);
    }

    /// A Go executable allocbpf can read: its heap profile is read from now on (the
    /// first poll sets the baseline, so its profiles count what it allocates from
    /// now).
    fn look_at(&mut self, process: &ProcessView<'_>, _maps: &mut dyn RuntimeMaps) -> Option<Found> {
        let pid = process.pid;
        if self.processes.knows(pid) {
            return None;
        }
        let mapping = process.files.go_mappings(process.maps).into_iter().next()?;
        let key = (mapping.device, mapping.inode);
        if self.files.len() >= MAX_GO_FILES && !self.files.contains_key(&key) {
            // Only files no process is read through go.
            let used: HashSet<(u64, u64)> =
                (self.processes.iter_mut()).map(|(_, r)| r.file).collect();
            self.files.retain(|key, _| used.contains(key));
            if self.files.len() >= MAX_GO_FILES {
                tracing::warn!("pid {pid}: {MAX_GO_FILES} Go executables read already");
                return None;
            }
        }
        let descriptor_errors = &mut self.descriptor_errors;
        let file = self.files.entry(key).or_insert_with(|| {
            GoFile::examine(pid, mapping).unwrap_or_else(|error| {
                if let GoError::Unreadable {
                    out_of_descriptors: true,
                    ..
                } = error
                {
                    *descriptor_errors += 1;
                }
                tracing::warn!("pid {pid}: its Go heap profile cannot be read: {error}");
                None
            })
        });
        let file = file.as_ref()?;
        let mut reader = GoProcess::new(pid, file, mapping)?;
        let version = file.version.text.clone();
        let source = match reader.poll(file) {
            Ok(poll) if poll.rate <= 0 => {
                self.not_sampling.insert(pid);
                let said = not_sampling(&version);
                tracing::warn!("pid {pid}: {said}");
                said
            }
            Ok(poll) => {
                tracing::info!(
                    "pid {pid}: a Go program ({version}): its heap profile is read from its \
                     runtime's own sampler, at {} bytes",
                    poll.rate
                );
                format!("its Go runtime's heap profile ({version}, read from its memory)")
            }
            Err(error) => {
                tracing::warn!("pid {pid}: its Go heap profile cannot be read: {error}");
                return None;
            }
        };
        self.processes.insert(
            pid,
            GoReader {
                process: reader,
                file: key,
                start_time: process.start_time,
                frames: ByteCache::new(MIN_FRAMES_BYTES),
            },
        );
        // Its profiles hold the Go runtime's own samples (their stacks end in
        // `[go runtime heap profile]`); any others are allocbpf's probes'.
        let labels = vec![
            ("go_version", version),
            ("sampler", "go_runtime".to_string()),
        ];
        Some(Found {
            runtime: NAME,
            labels,
            source: Some(source),
        })
    }

    fn poll_due(&self, now: Instant) -> bool {
        !self.processes.is_empty()
            && self
                .last_poll
                .is_none_or(|last| now.duration_since(last) >= GO_POLL_INTERVAL)
    }

    /// New sampled allocations, and the objects in use that replace the previous ones.
    fn poll(&mut self, is_current: IsCurrent<'_>, locations: &mut SourceLocations) -> Polled {
        let started = Instant::now();
        self.last_poll = Some(started);
        let mut polled = Polled::default();
        for pid in self.processes.pids() {
            let Some(reader) = self.processes.get_mut(pid) else {
                continue;
            };
            // The process read must still be the one followed under its pid.
            let same = is_current(pid, reader.start_time);
            let Some(Some(file)) = self.files.get_mut(&reader.file).filter(|_| same) else {
                self.processes.remove(pid);
                continue;
            };
            let poll = match reader.process.poll(file) {
                Ok(poll) => poll,
                Err(error) => {
                    // Gone, most likely: its last profile keeps what was read.
                    tracing::debug!("pid {pid}: Go heap profile not read: {error}");
                    self.processes.remove(pid);
                    continue;
                }
            };
            if poll.rate <= 0 {
                if self.not_sampling.insert(pid) {
                    tracing::warn!("pid {pid}: {}", not_sampling(&file.version.text));
                }
                continue;
            }
            self.not_sampling.remove(&pid);
            polled.figures.add(PollFigures {
                polls: 1,
                records: poll.buckets as u64,
                bytes: poll.bytes_read,
                ns: 0,
            });
            match poll.end {
                Some(WalkEnd::Complete) | None => {
                    self.walk_ends.remove(&pid);
                }
                Some(end) => {
                    if self.walk_ends.insert(pid, end) != Some(end) {
                        tracing::warn!(
                            "pid {pid}: its Go bucket list did not end as a list does \
                             ({end:?}): read as far as it goes"
                        );
                    }
                }
            }
            let frames = &mut reader.frames;
            polled
                .processes
                .push(process_poll(pid, file, frames, &poll, locations));
        }
        polled.figures.ns = started.elapsed().as_nanos() as u64;
        polled
    }

    /// Its memory is gone, or another program's: what its last poll read is what it
    /// has.
    fn forget(&mut self, pid: u32, why: Departure, maps: &mut dyn RuntimeMaps) {
        self.processes.forget(pid, why, maps);
        self.not_sampling.remove(&pid);
        self.walk_ends.remove(&pid);
    }

    fn descriptor_errors(&self) -> u64 {
        self.descriptor_errors
    }
}

/// Why a Go program has no heap profile.
fn not_sampling(version: &str) -> String {
    format!(
        "a Go program ({version}) whose runtime does not sample allocations \
         (runtime.MemProfileRate is 0: set so by the program, or by the linker when \
         nothing in it reads the profile): no Go heap profile"
    )
}

/// One poll of `pid` as counted stacks; `frames`: each bucket's, as named before.
fn process_poll(
    pid: u32,
    file: &mut GoFile,
    frames: &mut ByteCache<u64, Vec<Frame>>,
    poll: &Poll,
    locations: &mut SourceLocations,
) -> ProcessPoll {
    let rate = poll.rate as u64;
    // Locations its buckets add are this process's (its share of the table).
    locations.charge_to(Some(pid));
    frames.set_max_bytes(frames_bound(poll));
    let mut counted = |bucket: &process::Counted| {
        let named = match frames.get(&bucket.bucket) {
            Some(named) => named.clone(),
            None => {
                let named = frames_of(file, &bucket.stack, locations);
                let bytes = size_of::<Vec<Frame>>() + named.len() * size_of::<Frame>();
                frames.insert(bucket.bucket, named.clone(), bytes);
                named
            }
        };
        Counted {
            frames: named,
            size: bucket.size,
            count: bucket.count,
            rate,
        }
    };
    let allocated = poll.allocated.iter().map(&mut counted).collect();
    let in_use = poll.in_use.iter().map(&mut counted).collect();
    ProcessPoll {
        pid,
        allocated,
        in_use,
    }
}

/// The frames of a bucket's stack (return addresses, innermost first), as Go frames:
/// the runtime's own frames at the top (the allocator, `runtime.mallocgc`...) are
/// dropped, as `go tool pprof` does; [`GO_SAMPLER_FRAME`] is the outermost.
fn frames_of(file: &mut GoFile, stack: &[u64], locations: &mut SourceLocations) -> Vec<Frame> {
    let mut found: Vec<SourceLocation> = stack
        .iter()
        .map(|&pc| match file.location(pc) {
            Some(location) => SourceLocation {
                function: location.function,
                file: location.file.unwrap_or_default(),
                line: location.line.unwrap_or(0),
                style: LocationStyle::ByName,
            },
            // One location for every pc the table does not know: a forged stack
            // cannot fill the session's location table.
            None => SourceLocation {
                function: UNKNOWN_GO_FRAME.to_string(),
                file: String::new(),
                line: 0,
                style: LocationStyle::ByName,
            },
        })
        .collect();
    // A stack of runtime frames only (the runtime's own allocation) keeps them all.
    let runtime = |l: &SourceLocation| {
        l.function.starts_with("runtime.") || l.function.starts_with("internal/runtime/")
    };
    if let Some(first) = found.iter().position(|l| !runtime(l)) {
        found.drain(..first);
    }
    found.push(SourceLocation {
        function: GO_SAMPLER_FRAME.to_string(),
        file: String::new(),
        line: 0,
        style: LocationStyle::ByName,
    });
    found
        .into_iter()
        .map(|location| Frame::Runtime(locations.intern(location)))
        .collect()
}

#[cfg(test)]
mod tests {
    use allocbpf_runtime::RuntimeMapError;

    use super::*;

    /// Fails the test at any kernel map call: a Go process has no entry.
    struct NoEntries;

    impl RuntimeMaps for NoEntries {
        fn set_entry(
            &mut self,
            map: &'static str,
            _: u32,
            _: &[u8],
        ) -> Result<(), RuntimeMapError> {
            panic!("{map} written");
        }

        fn forget_entry(&mut self, map: &'static str, _: u32) {
            panic!("{map} forgotten");
        }
    }

    #[test]
    fn forgetting_a_process_touches_no_kernel_map() {
        let mut runtime = GoRuntime::default();
        runtime.not_sampling.insert(2);
        runtime.walk_ends.insert(2, WalkEnd::Cycle);
        for why in [
            Departure::Exit,
            Departure::Exec,
            Departure::Reused,
            Departure::Released,
        ] {
            runtime.forget(2, why, &mut NoEntries);
        }
        assert!(runtime.not_sampling.is_empty() && runtime.walk_ends.is_empty());
        assert!(!runtime.poll_due(Instant::now()), "no process to poll");
    }
}
