//! From a sample's raw stack to named frames, in one place: unwind the copied stack
//! (auto and dwarf modes) or take the kernel's frame-pointer walk, normalize each
//! address to module + offset while the process's maps are still readable, and let
//! each language runtime merge its frames in. The resolver owns the session's table of
//! source locations: every runtime's frames are interned there, and the symbolizer
//! names them from it.

use std::time::Instant;

use allocbpf_probe::events::RawSample;
use allocbpf_profile::frame::{Frame, SourceLocations};
use allocbpf_runtime::{
    Capture, Departure, Found, IsCurrent, NativeStack, Polled, ProcessView, Runtime, RuntimeMaps,
    SampleStack,
};

use crate::normalize::AddressNormalizer;
use crate::symbolize::{FrameSymbolizer, ModuleSymbolizer};
use crate::unwind::{Fallback, StackUnwinder};

/// Unwinds, normalizes and names the samples of any number of processes.
pub struct StackResolver {
    /// Normalizes addresses; its module table is what frames refer to.
    pub normalizer: AddressNormalizer,
    /// Unwinds copied stacks (auto/dwarf); `None` with frame pointers.
    pub unwinder: Option<StackUnwinder>,
    /// Where every runtime frame ([`Frame::Runtime`]) points.
    locations: SourceLocations,
    /// The language runtimes, each with the processes it claimed.
    runtimes: Vec<Box<dyn Runtime>>,
}

impl StackResolver {
    /// A resolver for `mode`, in a session that discovers entries with `prefixes`
    /// (renamed allocators' prefixes), merging in the frames of `runtimes`.
    pub fn new(mode: UnwindMode, prefixes: &[String], runtimes: Vec<Box<dyn Runtime>>) -> Self {
        let prefixes = prefixes.to_vec();
        Self {
            normalizer: AddressNormalizer::new(),
            unwinder: match mode {
                UnwindMode::Fp => None,
                UnwindMode::Auto => Some(StackUnwinder::new(Fallback::FramePointers, prefixes)),
                UnwindMode::Dwarf => Some(StackUnwinder::new(Fallback::Stop, prefixes)),
            },
            locations: SourceLocations::default(),
            runtimes,
        }
    }

    /// Reads and caches `pid`'s maps now, while it surely lives.
    pub fn prime(&mut self, pid: u32) {
        self.normalizer.prime(pid);
        if let Some(unwinder) = self.unwinder.as_mut() {
            unwinder.prime(pid);
        }
    }

    /// Drops what is cached about `pid` (it exited, it exec'd a new program, or its pid
    /// names another process now), here, in every runtime, and in the kernel maps the
    /// runtimes filled for it as `why` requires.
    pub fn forget(&mut self, pid: u32, why: Departure, maps: &mut dyn RuntimeMaps) {
        self.normalizer.forget(pid);
        if let Some(unwinder) = self.unwinder.as_mut() {
            unwinder.forget(pid);
        }
        for runtime in &mut self.runtimes {
            runtime.forget(pid, why, maps);
        }
    }

    /// Hands `process` to every runtime, or with `again_at` only to those that asked to
    /// look at it again then ([`Runtime::look_again_due`]): what those that claim it
    /// found, in the order the runtimes were listed.
    pub fn look_at(
        &mut self,
        process: &ProcessView<'_>,
        maps: &mut dyn RuntimeMaps,
        again_at: Option<Instant>,
    ) -> Vec<Found> {
        let asked = |runtime: &dyn Runtime| {
            again_at.is_none_or(|now| runtime.look_again_due(process.pid, now))
        };
        (self.runtimes.iter_mut())
            .filter(|runtime| asked(runtime.as_ref()))
            .filter_map(|runtime| runtime.look_at(process, maps))
            .collect()
    }

    /// True when a runtime wants to look at `pid` again now.
    pub fn look_again_due(&self, pid: u32, now: Instant) -> bool {
        self.runtimes.iter().any(|r| r.look_again_due(pid, now))
    }

    /// Where runtime `name` stands in the list (runtimes' labels go in that order).
    pub fn runtime_rank(&self, name: &str) -> usize {
        (self.runtimes.iter())
            .position(|runtime| runtime.name() == name)
            .unwrap_or(usize::MAX)
    }

    /// True when a runtime has a poll due.
    pub fn poll_due(&self, now: Instant) -> bool {
        self.runtimes.iter().any(|r| r.poll_due(now))
    }

    /// Polls every runtime with a poll due (all of them with `force`): each one's name
    /// and what it read.
    pub fn poll(
        &mut self,
        now: Instant,
        force: bool,
        is_current: IsCurrent<'_>,
    ) -> Vec<(&'static str, Polled)> {
        let locations = &mut self.locations;
        let mut polls = Vec::new();
        for runtime in &mut self.runtimes {
            if force || runtime.poll_due(now) {
                polls.push((runtime.name(), runtime.poll(is_current, locations)));
                // A runtime charges each process it reads (`charge_to`); none after.
                locations.charge_to(None);
            }
        }
        polls
    }

    /// The sample's frames, innermost first.
    pub fn resolve(&mut self, sample: &RawSample) -> Vec<Frame> {
        let unwound;
        // A sample without a copied stack (frame pointers walked in the kernel, or a
        // runtime's capture in its place) keeps the kernel's frames.
        let stack = match self.unwinder.as_mut() {
            Some(unwinder) if !sample.user_stack.is_empty() => {
                let mut from_tables = unwinder.unwind(sample.pid, sample.regs, &sample.user_stack);
                // At an inlined site the sampled function is a frame of its own (the
                // unwinder starts with its caller).
                if sample.inlined && !from_tables.is_empty() {
                    from_tables.splice(0..0, sample.stack.first().copied());
                }
                unwound = from_tables;
                if unwound.is_empty() {
                    // Nothing unwound: keep the immediate caller read at [sp].
                    &sample.stack
                } else {
                    &unwound
                }
            }
            _ => &sample.stack,
        };
        let mut frames = self.normalizer.normalize(sample.pid, stack);
        let walked = sample_stack(sample, stack);
        // Locations its frames add are this process's (its share of the table).
        self.locations.charge_to(Some(sample.pid));
        for runtime in &mut self.runtimes {
            frames = runtime.merge_frames(&walked, frames, &mut self.locations);
        }
        self.locations.charge_to(None);
        frames
    }

    /// Releases the source locations `referenced` says no stack refers to (at a cut);
    /// returns how many.
    pub fn release_locations(&mut self, referenced: impl Fn(u32) -> bool) -> usize {
        // Frames the runtimes keep to hand out again hold their locations too.
        let mut held = std::collections::HashSet::new();
        for runtime in &self.runtimes {
            runtime.held_locations(&mut |id| {
                held.insert(id);
            });
        }
        self.locations
            .release(|id| referenced(id) || held.contains(&id))
    }

    /// The one frame that stands for a stack merged away (`name` says why).
    pub fn sentinel_frame(&mut self, name: &str) -> Frame {
        Frame::Runtime(self.locations.sentinel(name))
    }

    /// Source locations held now.
    pub fn locations_held(&self) -> usize {
        self.locations.len()
    }

    /// What `sample` stands for when a runtime's probe saw a chunk of its heap rather
    /// than one object ([`Runtime::attributed_object`]): the bytes of the object that
    /// took the chunk (0: not known); `None` for a sample that stands for itself.
    pub fn attributed_object(&self, sample: &RawSample) -> Option<u64> {
        let walked = sample_stack(sample, &sample.stack);
        (self.runtimes.iter()).find_map(|runtime| runtime.attributed_object(&walked))
    }

    /// `symbolizer`, naming the frames this resolver made: native ones from their
    /// modules' files, runtime ones from the location table.
    pub fn symbolizer<'a>(&'a self, symbolizer: &'a mut FrameSymbolizer) -> ModuleSymbolizer<'a> {
        symbolizer.for_frames(&self.normalizer.modules, &self.locations)
    }

    /// Opens of mapped files that failed for want of descriptors so far (normalizing,
    /// unwinding, the runtimes).
    pub fn descriptor_errors(&self) -> u64 {
        let unwinding = self.unwinder.as_ref().map_or(0, |u| u.descriptor_errors);
        let runtimes: u64 = self.runtimes.iter().map(|r| r.descriptor_errors()).sum();
        self.normalizer.descriptor_errors() + unwinding + runtimes
    }

    /// Process maps read that were cut at their size cap so far (normalizing and
    /// unwinding).
    pub fn maps_cut(&self) -> u64 {
        let unwinding = self.unwinder.as_ref().map_or(0, |u| u.maps_cut);
        self.normalizer.maps_cut() + unwinding
    }
}

/// `sample` as the runtimes see it, with `addresses` as its native frames' addresses.
fn sample_stack<'a>(sample: &'a RawSample, addresses: &'a [u64]) -> SampleStack<'a> {
    SampleStack {
        pid: sample.pid,
        function: sample.function,
        addresses,
        native: (!sample.user_stack.is_empty()).then_some(NativeStack {
            regs: sample.regs,
            stack: &sample.user_stack,
        }),
        capture: sample.capture.as_ref().map(|capture| Capture {
            flag: capture.flag,
            bytes: &capture.bytes,
        }),
    }
}

/// How user stacks are unwound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnwindMode {
    /// Unwind tables where a module has them, frame pointers elsewhere.
    Auto,
    /// Unwind tables only.
    Dwarf,
    /// Frame pointers, in the kernel.
    Fp,
}

impl UnwindMode {
    /// Bytes of user stack each sample copies in this mode, of `stack_bytes` wanted (0
    /// when frame pointers are walked in the kernel).
    pub fn stack_copy_bytes(self, stack_bytes: u32) -> u32 {
        match self {
            UnwindMode::Fp => 0,
            UnwindMode::Auto | UnwindMode::Dwarf => stack_bytes,
        }
    }
}
