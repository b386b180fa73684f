//! The engine's seam to the kernel: the narrow interface through which the
//! [`Collector`](crate::engine::Collector) drives the probes and receives their events.
//!
//! The engine owns these traits. [`EbpfObject`] loads the real side: the eBPF sampler
//! (`allocbpf_probe`) behind [`Kernel`] and its ring-buffer reader as the
//! [`EventSource`]; the engine's unit tests load a fake kernel (`fake.rs`), so event
//! handling, cuts, budget control and image release are checked without root and
//! without the BPF toolchain.
//!
//! - [`Kernel`]: every concern below, one trait each: [`Gates`], [`Attach`],
//!   [`Epochs`] (totals and counters), [`LiveState`], [`Upkeep`] and the runtimes'
//!   [`RuntimeMaps`];
//! - [`EventSource`]: the events, fed from a queue (the ring-buffer reader's, or a
//!   test's);
//! - [`KernelLoader`]: loads both for a [`SamplerConfig`].

use std::{
    collections::{HashMap, HashSet},
    future::Future,
    io,
    path::Path,
    pin::Pin,
};

use allocbpf_common::{GateState, LiveMode, ProcessGate, Totals};
use allocbpf_images::image::AllocatorImage;
use allocbpf_probe::{
    events::Event,
    sampler::{ProbeError, SamplerConfig},
};
use allocbpf_profile::report::Counters;
pub use allocbpf_runtime::RuntimeMaps;

use crate::error::CollectError;

mod ebpf;
#[cfg(any(test, feature = "fake-kernel"))]
pub mod fake;

pub use self::ebpf::EbpfObject;

/// The probes attached to one image (or one calibration point), held by the kernel
/// side: the engine keeps this token and hands it back to detach them.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct LinkSet {
    /// The kernel side's name for them.
    id: u64,
    /// Probes behind them.
    probes: usize,
}

impl LinkSet {
    /// A token for the links the kernel side keeps under `id`, with `probes` probes.
    pub fn new(id: u64, probes: usize) -> Self {
        Self { id, probes }
    }

    /// The kernel side's name for them.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Number of probes attached.
    pub fn len(&self) -> usize {
        self.probes
    }

    /// True if nothing is attached.
    pub fn is_empty(&self) -> bool {
        self.probes == 0
    }
}

/// What [`Kernel::attach`] attached to one image.
#[derive(Debug)]
pub struct Attached {
    /// With live tracking: how returns are observed...
    pub live_mode: LiveMode,
    /// ...and how many deallocation entries are probed.
    pub frees: usize,
    /// The links, for [`Kernel::detach`].
    pub links: LinkSet,
}

/// One link on its way out ([`Kernel::detach_later`]): dropping it detaches it, which
/// waits for the kernel's grace period, so the engine drops it on another thread.
pub type Detaching = Box<dyn Send>;

/// Which processes are sampled: each process's gate, and the probe hits it counts.
pub trait Gates {
    /// Opens or closes `pid`'s gate (host scope: which processes are sampled).
    fn set_gate(&mut self, pid: u32, state: GateState) -> Result<(), ProbeError>;
    /// Raises `pid`'s sampling interval `2^coarsening` times (0: its own rate).
    fn set_coarsening(&mut self, pid: u32, coarsening: u32) -> Result<(), ProbeError>;
    /// Every process's gate with its probe hits, summed over CPUs.
    fn gate_hits(&self) -> Result<HashMap<u32, ProcessGate>, ProbeError>;
    /// One process's gate, if it has one.
    fn gate_hits_of(&self, pid: u32) -> Option<ProcessGate>;
}

/// Probes in and out: an image's full time, in windows or for one process, and the
/// calibration's empty program.
pub trait Attach {
    /// True if images can be probed part time (the overhead budget's windows).
    fn windows_supported(&self) -> bool;
    /// Attaches the probes of `image`, sampling at the configured rate.
    fn attach(&mut self, image: &AllocatorImage) -> Result<Attached, ProbeError>;
    /// Attaches the probes of `image` for observation windows, sampling
    /// `2^window_shift` times denser than the configured rate.
    fn attach_in_windows(
        &mut self,
        image: &AllocatorImage,
        window_shift: u8,
    ) -> Result<Attached, ProbeError>;
    /// Attaches the probes of `image` for `pid` only, full time, as its own links
    /// (`GateState::OwnLinks` then makes them the ones that count for it).
    fn attach_own(&mut self, image: &AllocatorImage, pid: u32) -> Result<Attached, ProbeError>;
    /// Attaches the empty program at `offset` in `path` for `pid` (the calibration of a
    /// probe hit's cost).
    fn attach_empty_at(
        &mut self,
        path: &Path,
        offset: u64,
        pid: u32,
    ) -> Result<LinkSet, ProbeError>;
    /// Detaches `links` now (waits for the kernel's grace period).
    fn detach(&mut self, links: LinkSet);
    /// Takes `links` out without detaching them: each part detaches when dropped.
    fn detach_later(&mut self, links: LinkSet) -> Vec<Detaching>;
    /// Returns once every probe run that started before the call has finished.
    fn wait_for_running_programs(&self);
}

/// What the kernel counted, by epoch: the exact totals a cut reads.
pub trait Epochs {
    /// The epoch the kernel counts into now.
    fn epoch(&self) -> u64;
    /// Starts a new epoch; the one that ended.
    fn next_epoch(&mut self) -> Result<u64, ProbeError>;
    /// The kernel's counters now.
    fn counters(&self) -> Result<Counters, ProbeError>;
    /// The kernel's counters of `epoch`.
    fn counters_of(&self, epoch: u64) -> Result<Counters, ProbeError>;
    /// Exact totals per process of `epoch`.
    fn totals_of(&mut self, epoch: u64) -> Result<HashMap<u32, Totals>, ProbeError>;
}

/// The kernel side's state per process and per sampled block, and its release.
pub trait LiveState {
    /// Every pid the kernel holds state for.
    fn kernel_pids(&self) -> HashSet<u32>;
    /// Sampled blocks still live in the kernel's table, by pid.
    fn live_sample_ids(&self) -> HashMap<u32, HashSet<u64>>;
    /// Forgets the live blocks `expired` ((pid, sample id)); how many were there.
    fn forget_live_blocks(&mut self, expired: &HashSet<(u32, u64)>) -> usize;
    /// Forgets everything the kernel holds for `pids`.
    fn forget_processes(&mut self, pids: &HashSet<u32>);
}

/// Upkeep the engine's housekeeping does.
pub trait Upkeep {
    /// Writes a fresh table of exponential intervals.
    fn refresh_intervals(&mut self) -> Result<(), ProbeError>;
    /// Frees the thread tables' entries of exited threads; how many.
    fn collect_exited_threads(&mut self) -> usize;
    /// The ring's pressure level now (0: none).
    fn pressure_level(&self) -> u32;
    /// Forwards the eBPF side's log records.
    fn flush_logs(&mut self);
}

/// What the engine asks of the kernel side: each concern is a trait of its own (the
/// runtime maps are the runtimes' interface, [`RuntimeMaps`]); a part of the engine
/// that needs one concern takes that trait.
pub trait Kernel: Gates + Attach + Epochs + LiveState + Upkeep + RuntimeMaps {}

impl<T: Gates + Attach + Epochs + LiveState + Upkeep + RuntimeMaps + ?Sized> Kernel for T {}

/// How the ring buffer's reader is doing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SourceFigures {
    /// Records too short to decode (a version mismatch; should stay 0).
    pub malformed: u64,
    /// The most kernel-ring bytes found waiting at one read.
    pub ring_peak_bytes: u64,
    /// The most record bytes queued for the engine at once.
    pub queue_peak_bytes: u64,
}

/// A future borrowed from its source.
pub type ReadFuture<'a> = Pin<Box<dyn Future<Output = io::Result<()>> + 'a>>;

/// Where the engine's events come from, in the order the kernel sent them.
pub trait EventSource {
    /// Waits a little for events, then appends a bounded batch of them to `out`
    /// (possibly none). An error is returned once, after the events before it.
    fn read_batch<'a>(&'a mut self, out: &'a mut Vec<Event>) -> ReadFuture<'a>;
    /// One bounded step of a drain of everything sent so far; false once it is out.
    fn drain_some(&mut self, out: &mut Vec<Event>) -> bool;
    /// The reader's figures.
    fn figures(&self) -> SourceFigures;
}

/// The kernel side as loaded, and its events.
pub struct Loaded {
    /// The probes' control.
    pub kernel: Box<dyn Kernel>,
    /// Their events.
    pub events: Box<dyn EventSource>,
}

/// Loads the kernel side for a collection.
pub trait KernelLoader {
    /// Loads it configured for `config`; nothing is attached yet.
    fn load(&self, config: SamplerConfig) -> Result<Loaded, CollectError>;
}
