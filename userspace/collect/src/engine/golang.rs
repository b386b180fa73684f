//! Go processes: their heap profile is the Go runtime's own sampler's, read from their
//! memory (`allocbpf-go`), not probed. A Go executable is examined once per file; each
//! process is polled every [`GO_POLL_INTERVAL`] and at each cut. A poll adds the
//! sampled allocations new since the previous one (each bucket's count, at the rate the
//! process samples at) and replaces the objects in use (as of its last GC cycle).

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use allocbpf_go::{
    buckets::WalkEnd,
    process::{Counted, GoFile, GoProcess, Poll},
};
use allocbpf_images::procfs::MapsEntry;
use allocbpf_profile::{
    aggregate::StackKey,
    frame::{source_locations, Frame, SourceLocation},
};

use super::Collector;

/// The outermost frame of every stack read from the Go runtime's heap profile: in a
/// program that also allocates through malloc (cgo), each stack says which sampler it
/// came from.
pub const GO_SAMPLER_FRAME: &str = "[go runtime heap profile]";

/// How a return address the function table does not know reads.
pub const UNKNOWN_GO_FRAME: &str = "[go: unknown pc]";

/// How often Go processes are polled between cuts (a process that exits between two
/// polls loses what it allocated since the last one).
pub const GO_POLL_INTERVAL: Duration = Duration::from_secs(1);

/// Go executables remembered (by device and inode); past it the cache starts over.
const MAX_GO_FILES: usize = 256;

/// One Go process read.
struct GoReader {
    process: GoProcess,
    /// Its executable's key in [`GoReaders::files`].
    file: (u64, u64),
    /// Its start time (a later process with its pid is not read as this one).
    start_time: Option<u64>,
    /// The frames of each bucket read so far (a bucket's stack never changes).
    frames: HashMap<u64, Vec<Frame>>,
}

/// The Go processes read, and their files.
#[derive(Default)]
pub(crate) struct GoReaders {
    /// Examined files: `None` for one that cannot be read as Go.
    files: HashMap<(u64, u64), Option<GoFile>>,
    /// Processes polled.
    processes: HashMap<u32, GoReader>,
    /// Processes whose runtime does not sample (rate 0), said once.
    not_sampling: std::collections::HashSet<u32>,
    /// How each process's last walk of its bucket list ended, when it did not reach the
    /// list's end (said when it changes).
    walk_ends: HashMap<u32, WalkEnd>,
    /// When they were last polled.
    last_poll: Option<Instant>,
}

impl GoReaders {
    /// Stops reading `pid` (it exited or exec'd).
    pub(crate) fn forget(&mut self, pid: u32) {
        self.processes.remove(&pid);
        self.not_sampling.remove(&pid);
        self.walk_ends.remove(&pid);
    }

    /// True if a poll is due.
    pub(crate) fn poll_due(&self, now: Instant) -> bool {
        !self.processes.is_empty()
            && self
                .last_poll
                .is_none_or(|last| now.duration_since(last) >= GO_POLL_INTERVAL)
    }
}

impl Collector {
    /// Looks at `pid` (mapping `maps`, its images discovered) for a Go executable and,
    /// if it has one allocbpf can read, starts reading its heap profile: the first poll
    /// sets the baseline, so its profiles count what it allocates from now on.
    pub(super) fn look_for_go(&mut self, pid: u32, maps: &[MapsEntry]) {
        if self.go.processes.contains_key(&pid) {
            return;
        }
        let Some(mapping) = self.images.cache.go_mappings(maps).into_iter().next() else {
            return;
        };
        let key = (mapping.device, mapping.inode);
        if self.go.files.len() >= MAX_GO_FILES && !self.go.files.contains_key(&key) {
            // Only files no process is read through go.
            let used: std::collections::HashSet<(u64, u64)> =
                self.go.processes.values().map(|r| r.file).collect();
            self.go.files.retain(|key, _| used.contains(key));
            if self.go.files.len() >= MAX_GO_FILES {
                tracing::warn!("pid {pid}: {MAX_GO_FILES} Go executables read already");
                return;
            }
        }
        let file = self.go.files.entry(key).or_insert_with(|| {
            GoFile::examine(pid, mapping).unwrap_or_else(|error| {
                tracing::warn!("pid {pid}: its Go heap profile cannot be read: {error}");
                None
            })
        });
        let Some(file) = file.as_ref() else {
            return;
        };
        let Some(mut process) = GoProcess::new(pid, file, mapping) else {
            return;
        };
        match process.poll(file) {
            Ok(poll) if poll.rate <= 0 => {
                self.go.not_sampling.insert(pid);
                tracing::warn!("pid {pid}: {}", not_sampling(&file.version.text));
            }
            Ok(poll) => {
                tracing::info!(
                    "pid {pid}: a Go program ({}): its heap profile is read from its \
                     runtime's own sampler, at {} bytes",
                    file.version.text,
                    poll.rate
                );
            }
            Err(error) => {
                tracing::warn!("pid {pid}: its Go heap profile cannot be read: {error}");
                return;
            }
        }
        let version = file.version.text.clone();
        let mut start_time = None;
        if let Some(tracked) = self.processes.tracked.get_mut(&pid) {
            tracked.info.go_version = Some(version);
            start_time = tracked.info.start_time;
        }
        self.go.processes.insert(
            pid,
            GoReader {
                process,
                file: key,
                start_time,
                frames: HashMap::new(),
            },
        );
    }

    /// How `pid`'s Go heap profile is read, if it is: what the start-up line says.
    pub(super) fn go_description(&self, pid: u32) -> Option<String> {
        let reader = self.go.processes.get(&pid)?;
        let file = self.go.files.get(&reader.file)?.as_ref()?;
        Some(match self.go.not_sampling.contains(&pid) {
            true => not_sampling(&file.version.text),
            false => format!(
                "its Go runtime's heap profile ({}, read from its memory)",
                file.version.text
            ),
        })
    }

    /// Polls every Go process read: new sampled allocations go into its aggregate, its
    /// objects in use replace the previous ones.
    pub(super) fn poll_go(&mut self) {
        let started = Instant::now();
        self.go.last_poll = Some(started);
        let pids: Vec<u32> = self.go.processes.keys().copied().collect();
        for pid in pids {
            let Some(reader) = self.go.processes.get_mut(&pid) else {
                continue;
            };
            // The process read must still be the one followed under its pid.
            let same = self
                .processes
                .tracked
                .get(&pid)
                .is_some_and(|t| t.info.start_time == reader.start_time);
            let Some(Some(file)) = self.go.files.get_mut(&reader.file).filter(|_| same) else {
                self.go.processes.remove(&pid);
                continue;
            };
            let poll = match reader.process.poll(file) {
                Ok(poll) => poll,
                Err(error) => {
                    // Gone, most likely: its last profile keeps what was read.
                    tracing::debug!("pid {pid}: Go heap profile not read: {error}");
                    self.go.processes.remove(&pid);
                    continue;
                }
            };
            if poll.rate <= 0 {
                if self.go.not_sampling.insert(pid) {
                    tracing::warn!("pid {pid}: {}", not_sampling(&file.version.text));
                }
                continue;
            }
            self.go.not_sampling.remove(&pid);
            self.stats.go_polls += 1;
            self.stats.go_buckets_read += poll.buckets as u64;
            self.stats.go_bytes_read += poll.bytes_read;
            match poll.end {
                Some(WalkEnd::Complete) | None => {
                    self.go.walk_ends.remove(&pid);
                }
                Some(end) => {
                    if self.go.walk_ends.insert(pid, end) != Some(end) {
                        tracing::warn!(
                            "pid {pid}: its Go bucket list did not end as a list does \
                             ({end:?}): read as far as it goes"
                        );
                    }
                }
            }
            let Some(tracked) = self.processes.tracked.get_mut(&pid) else {
                continue;
            };
            add_poll(&mut tracked.aggregate, pid, file, &mut reader.frames, &poll);
        }
        self.stats.go_poll_ns += started.elapsed().as_nanos() as u64;
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

/// Adds one poll of `pid` to its aggregate; `frames`: each bucket's, as symbolized.
fn add_poll(
    aggregate: &mut allocbpf_profile::aggregate::Aggregate,
    pid: u32,
    file: &mut GoFile,
    frames: &mut HashMap<u64, Vec<Frame>>,
    poll: &Poll,
) {
    let rate = poll.rate as u64;
    let mut key_of = |counted: &Counted| StackKey {
        pid,
        frames: frames
            .entry(counted.bucket)
            .or_insert_with(|| frames_of(file, &counted.stack))
            .clone(),
    };
    for counted in &poll.allocated {
        aggregate.add_counted(key_of(counted), counted.size, rate, counted.count);
    }
    let mut in_use: HashMap<StackKey, Vec<(u64, u64, u64)>> = HashMap::new();
    for counted in &poll.in_use {
        in_use
            .entry(key_of(counted))
            .or_default()
            .push((counted.size, counted.count, rate));
    }
    aggregate.set_runtime_in_use(in_use);
    // Buckets no longer in the list (a forged one, gone) keep no frames.
    if frames.len() > poll.buckets.saturating_mul(2).max(1024) {
        frames.clear();
    }
}

/// The frames of a bucket's stack (return addresses, innermost first), as Go frames:
/// the runtime's own frames at the top (the allocator, `runtime.mallocgc`...) are
/// dropped, as `go tool pprof` does; [`GO_SAMPLER_FRAME`] is the outermost.
fn frames_of(file: &mut GoFile, stack: &[u64]) -> Vec<Frame> {
    let mut locations: Vec<SourceLocation> = stack
        .iter()
        .map(|&pc| match file.location(pc) {
            Some(location) => SourceLocation {
                function: location.function,
                file: location.file.unwrap_or_default(),
                line: location.line.unwrap_or(0),
            },
            // One location for every pc the table does not know: a forged stack
            // cannot fill the session's location table.
            None => SourceLocation {
                function: UNKNOWN_GO_FRAME.to_string(),
                file: String::new(),
                line: 0,
            },
        })
        .collect();
    // A stack of runtime frames only (the runtime's own allocation) keeps them all.
    let runtime = |l: &SourceLocation| {
        l.function.starts_with("runtime.") || l.function.starts_with("internal/runtime/")
    };
    if let Some(first) = locations.iter().position(|l| !runtime(l)) {
        locations.drain(..first);
    }
    locations.push(SourceLocation {
        function: GO_SAMPLER_FRAME.to_string(),
        file: String::new(),
        line: 0,
    });
    let Ok(mut table) = source_locations().write() else {
        return vec![Frame::Lost];
    };
    locations
        .into_iter()
        .map(|location| Frame::Go(table.intern(location)))
        .collect()
}
