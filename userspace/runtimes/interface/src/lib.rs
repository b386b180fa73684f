//! The one interface every language runtime implements.
//!
//! A runtime (CPython, Go, the JVM, Node.js) is a crate of its own under
//! `userspace/runtimes/` that knows how to see its processes from outside. The engine
//! holds a list of [`Runtime`]s and names none: it hands each one every process it
//! admits ([`Runtime::look_at`]), asks it to poll what its processes' own samplers
//! recorded ([`Runtime::poll`]), lets it rewrite a sample's native frames
//! ([`Runtime::merge_frames`]), and tells it once when a process exits, exec's or its
//! pid is reused ([`Runtime::forget`]).
//!
//! Every frame a runtime makes is interned in the one location table the frame
//! resolver owns ([`SourceLocations`]), passed in by the caller: no runtime keeps a
//! table of its own and none is process-wide.
//!
//! Nothing here names a language: a runtime's kernel map entry and its samples'
//! captures are bytes only it lays out, and its frames are [`Frame::Runtime`]s whose
//! locations say how they read. [`toolkit`] is what every runtime needs to read other
//! processes (memory, bounded caches, per-process state, copied stacks).
#![deny(missing_docs)]

pub mod toolkit;

use std::time::Instant;

use allocbpf_common::AllocFn;
use allocbpf_images::{discover::ImageCache, procfs::MapsEntry};
use allocbpf_profile::frame::{Frame, SourceLocations};

/// A process as the engine hands it to the runtimes: read once, shared by all.
pub struct ProcessView<'a> {
    /// Its pid.
    pub pid: u32,
    /// Its start time (a later process with its pid has another).
    pub start_time: Option<u64>,
    /// Its memory map, as read for this look.
    pub maps: &'a [MapsEntry],
    /// What is known of the files it maps (examined once per session).
    pub files: &'a ImageCache,
}

/// What a runtime found in a process it claims.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Found {
    /// The runtime's [`Runtime::name`].
    pub runtime: &'static str,
    /// The labels its profiles carry (`python_version`, `go_version`...), in order.
    pub labels: Vec<(&'static str, String)>,
    /// A source of samples of its own, besides the probes (the Go runtime's heap
    /// profile): how it is read, as the start-up line says it. `None` when the
    /// runtime only adds frames to the probes' samples.
    pub source: Option<String>,
}

/// A kernel map write failed.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct RuntimeMapError(pub String);

/// The kernel maps runtimes fill in: what the eBPF program must walk or read in a
/// process at its samples. Each runtime that needs one names its own per-process map
/// (a hash map keyed by pid, defined by its eBPF part) and writes its entry as bytes
/// laid out as that part reads them; the kernel seam implements it, knowing no map.
pub trait RuntimeMaps {
    /// Writes `pid`'s entry of the per-process map `map` (its value's bytes, exactly
    /// the map's value size).
    fn set_entry(
        &mut self,
        map: &'static str,
        pid: u32,
        value: &[u8],
    ) -> Result<(), RuntimeMapError>;
    /// Removes `pid`'s entry of `map`, if it has one.
    fn forget_entry(&mut self, map: &'static str, pid: u32);
}

/// No kernel (after stop): nothing to write, nothing to forget.
pub struct NoMaps;

impl RuntimeMaps for NoMaps {
    fn set_entry(
        &mut self,
        _map: &'static str,
        _pid: u32,
        _value: &[u8],
    ) -> Result<(), RuntimeMapError> {
        Err(RuntimeMapError("the probes are detached".to_string()))
    }

    fn forget_entry(&mut self, _map: &'static str, _pid: u32) {}
}

/// One sample's stack as the kernel sent it, for [`Runtime::merge_frames`].
pub struct SampleStack<'a> {
    /// The process sampled.
    pub pid: u32,
    /// The allocation function probed, if known.
    pub function: Option<AllocFn>,
    /// The return addresses the native frames were made from, innermost first.
    pub addresses: &'a [u64],
    /// The native stack as copied (auto and dwarf unwinding; empty with frame
    /// pointers walked in the kernel), for runtimes whose frames live on it (V8's).
    pub native: Option<NativeStack<'a>>,
    /// What a runtime's eBPF part captured at the sample, if anything: only that
    /// runtime reads it.
    pub capture: Option<Capture<'a>>,
}

/// A sample's user stack as the eBPF program copied it at the probe.
#[derive(Clone, Copy, Debug)]
pub struct NativeStack<'a> {
    /// `ip`, `sp` and `bp` at the probe.
    pub regs: [u64; 3],
    /// The stack from `sp` up.
    pub stack: &'a [u8],
}

/// The bytes a runtime's eBPF part appended to a sample: opaque to everything but the
/// runtime whose flag it carries.
#[derive(Clone, Copy, Debug)]
pub struct Capture<'a> {
    /// The `SampleEvent::flags` bit that marks this runtime's capture.
    pub flag: u32,
    /// The capture as the kernel sent it.
    pub bytes: &'a [u8],
}

impl<'a> SampleStack<'a> {
    /// The capture's bytes when it carries `flag` (a runtime's own).
    pub fn capture_of(&self, flag: u32) -> Option<&'a [u8]> {
        self.capture
            .filter(|capture| capture.flag == flag)
            .map(|capture| capture.bytes)
    }
}

/// Allocations a runtime's own sampler counted at one stack and size.
#[derive(Clone, Debug, PartialEq)]
pub struct Counted {
    /// The stack, innermost first, interned in the caller's [`SourceLocations`].
    pub frames: Vec<Frame>,
    /// Bytes of each allocation.
    pub size: u64,
    /// Allocations the sampler took.
    pub count: u64,
    /// The sampler's mean interval in bytes (a Poisson process over bytes).
    pub rate: u64,
}

/// One process polled.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProcessPoll {
    /// The process.
    pub pid: u32,
    /// Sampled allocations new since its previous poll.
    pub allocated: Vec<Counted>,
    /// Sampled objects in use now: they replace what the previous poll said.
    pub in_use: Vec<Counted>,
}

/// What polling cost, summed over processes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PollFigures {
    /// Processes polled.
    pub polls: u64,
    /// Sample records (buckets) read.
    pub records: u64,
    /// Bytes of process memory read.
    pub bytes: u64,
    /// Nanoseconds spent.
    pub ns: u64,
}

impl PollFigures {
    /// Adds `other` to these.
    pub fn add(&mut self, other: PollFigures) {
        self.polls += other.polls;
        self.records += other.records;
        self.bytes += other.bytes;
        self.ns += other.ns;
    }
}

/// A poll of every process a runtime reads.
#[derive(Debug, Default)]
pub struct Polled {
    /// Each process read.
    pub processes: Vec<ProcessPoll>,
    /// What it cost.
    pub figures: PollFigures,
}

/// Why a process is forgotten ([`Runtime::forget`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Departure {
    /// It exec'd another program (same pid, same process).
    Exec,
    /// Its main thread exited; threads that outlive it may still be sampled until the
    /// next cut releases the kernel's entries of the pid.
    Exit,
    /// Its pid now names another process.
    Reused,
    /// It left the engine at a cut (its kernel entries go with it).
    Released,
}

/// Tells whether the process a runtime reads under `pid` (started at `start_time`) is
/// still the one the engine follows.
pub type IsCurrent<'a> = &'a dyn Fn(u32, Option<u64>) -> bool;

/// A language runtime seen from outside.
pub trait Runtime {
    /// Its name, for logs and figures (`python`, `go`).
    fn name(&self) -> &'static str;

    /// Looks at a process the engine admits; `Some` when it is one of this runtime's
    /// and it will be profiled through it. What it cannot do (an unknown version, a
    /// hostile file) it says in the log and answers `None`: the process is still
    /// profiled natively.
    fn look_at(&mut self, process: &ProcessView<'_>, maps: &mut dyn RuntimeMaps) -> Option<Found>;

    /// True when `pid` should be looked at again now (a runtime not yet initialised
    /// when first seen).
    fn look_again_due(&self, _pid: u32, _now: Instant) -> bool {
        false
    }

    /// True when [`Runtime::poll`] has something to do.
    fn poll_due(&self, _now: Instant) -> bool {
        false
    }

    /// Reads what the processes' own samplers recorded since the previous poll.
    /// `is_current` says whether a pid is still the process that was claimed.
    fn poll(&mut self, _is_current: IsCurrent<'_>, _locations: &mut SourceLocations) -> Polled {
        Polled::default()
    }

    /// `native` (made from `sample.addresses`) with this runtime's frames merged in;
    /// returned unchanged for a process that is not this runtime's.
    fn merge_frames(
        &mut self,
        _sample: &SampleStack<'_>,
        native: Vec<Frame>,
        _locations: &mut SourceLocations,
    ) -> Vec<Frame> {
        native
    }

    /// Names every source location id held in frames this runtime made earlier and
    /// keeps to hand out again (a cache of interned [`Frame::Runtime`]s). At each cut,
    /// the locations no stack refers to and no runtime names here are released and
    /// their ids reused: **a runtime that keeps interned frames between calls must name
    /// them**, or they would name other locations. One that interns at each call (from
    /// names it caches) keeps none: the default.
    fn held_locations(&self, _mark: &mut dyn FnMut(u32)) {}

    /// What a sample of one of this runtime's chunk probes stands for: `Some(bytes)` of
    /// the object that took the chunk (0: not known), for a sample whose probe saw a
    /// chunk of the runtime's heap rather than one object; `None` for any other
    /// sample, which stands for itself.
    fn attributed_object(&self, _sample: &SampleStack<'_>) -> Option<u64> {
        None
    }

    /// Forgets `pid`, in its own state and, as `why` requires, in the kernel's maps.
    fn forget(&mut self, pid: u32, why: Departure, maps: &mut dyn RuntimeMaps);

    /// Opens of mapped files this runtime could not make for want of descriptors so
    /// far.
    fn descriptor_errors(&self) -> u64 {
        0
    }
}

/// Marks the location of every [`Frame::Runtime`] in `cached` (lists of frames a
/// runtime keeps), for [`Runtime::held_locations`].
pub fn mark_runtime_frames<'a>(
    cached: impl Iterator<Item = &'a Vec<Frame>>,
    mark: &mut dyn FnMut(u32),
) {
    for frame in cached.flatten() {
        if let Frame::Runtime(id) = frame {
            mark(*id);
        }
    }
}
