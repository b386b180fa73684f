//! A fake kernel side for the engine's tests: it attaches nothing, and records what the
//! engine asked of it; the events are whatever the test queues. The engine's unit tests
//! use it, and so do tests outside this crate (feature `fake-kernel`), such as the
//! runtime interface's contract test with a runtime of its own.

use std::{
    cell::RefCell,
    collections::{HashMap, HashSet, VecDeque},
    io,
    path::Path,
    rc::Rc,
};

use allocbpf_common::{GateState, LiveMode, ProcessGate, Totals};
use allocbpf_images::image::{AllocatorImage, ImageKey};
use allocbpf_probe::{
    events::Event,
    sampler::{ProbeError, SamplerConfig},
};
use allocbpf_profile::report::Counters;

use allocbpf_runtime::{RuntimeMapError, RuntimeMaps};

use super::{
    Attach, Attached, Detaching, Epochs, EventSource, Gates, KernelLoader, LinkSet, LiveState,
    Loaded, ReadFuture, SourceFigures, Upkeep,
};
use crate::error::CollectError;

/// What the fake kernel holds and was asked; shared between the test and the engine.
#[derive(Debug, Default)]
pub struct FakeState {
    /// The config it was loaded with.
    pub config: Option<SamplerConfig>,
    /// Images can be probed part time.
    pub windows_supported: bool,
    /// Attaches fail (with [`ProbeError::Load`]).
    pub refuse_attach: bool,
    /// Gates by pid, with the hits a test puts there.
    pub gates: HashMap<u32, ProcessGate>,
    /// Attached link sets: id → (image, window shift; `None` for a calibration point).
    pub attached: HashMap<u64, (Option<ImageKey>, u8)>,
    /// Every attach, in order: (image, window shift).
    pub attaches: Vec<(ImageKey, u8)>,
    /// Every attach of one process's own links, in order: (image, pid, link set id).
    pub own_attaches: Vec<(ImageKey, u32, u64)>,
    /// Link sets detached, in order (at once or later).
    pub detached: Vec<u64>,
    /// The current epoch.
    pub epoch: u64,
    /// Exact totals per epoch, per pid (a test fills them).
    pub totals: HashMap<u64, HashMap<u32, Totals>>,
    /// Live blocks per pid.
    pub live: HashMap<u32, HashSet<u64>>,
    /// Pids the kernel holds state for.
    pub pids: HashSet<u32>,
    /// Pids it was asked to forget.
    pub forgotten: HashSet<u32>,
    /// The runtimes' per-process map entries, by map and pid.
    pub entries: HashMap<&'static str, HashMap<u32, Vec<u8>>>,
    /// The ring's pressure level.
    pub pressure_level: u32,
    /// Interval tables written.
    pub refreshes: usize,
    next_id: u64,
}

/// The fake, shared with the test that made it.
pub type Shared = Rc<RefCell<FakeState>>;

/// Events queued by the test, and an error to return after them.
#[derive(Debug, Default)]
pub struct FakeQueue {
    /// In order.
    pub events: VecDeque<Event>,
    /// Returned by the read that finds the queue empty, once.
    pub error: Option<io::Error>,
}

/// Loads the fake: each load shares `state` and `queue` with the test.
#[derive(Clone, Default)]
pub struct FakeLoader {
    /// The kernel's state.
    pub state: Shared,
    /// The events.
    pub queue: Rc<RefCell<FakeQueue>>,
}

impl FakeLoader {
    /// A loader whose kernel can (`windows`) or cannot probe images part time.
    pub fn new(windows: bool) -> Self {
        let loader = Self::default();
        loader.state.borrow_mut().windows_supported = windows;
        loader
    }

    /// Queues `events` for the engine.
    pub fn send(&self, events: impl IntoIterator<Item = Event>) {
        self.queue.borrow_mut().events.extend(events);
    }

    /// The attached images' keys, with their window shifts.
    pub fn attached_images(&self) -> Vec<(ImageKey, u8)> {
        let mut images: Vec<(ImageKey, u8)> = self
            .state
            .borrow()
            .attached
            .values()
            .filter_map(|(key, shift)| Some(((*key)?, *shift)))
            .collect();
        images.sort();
        images
    }
}

impl KernelLoader for FakeLoader {
    fn load(&self, config: SamplerConfig) -> Result<Loaded, CollectError> {
        self.state.borrow_mut().config = Some(config);
        Ok(Loaded {
            kernel: Box::new(FakeKernel(self.state.clone())),
            events: Box::new(FakeEvents(self.queue.clone())),
        })
    }
}

struct FakeKernel(Shared);

fn refused() -> ProbeError {
    ProbeError::Load(Box::new(io::Error::other("refused by the fake kernel")))
}

impl FakeKernel {
    fn attach_as(
        &mut self,
        image: &AllocatorImage,
        window_shift: u8,
    ) -> Result<Attached, ProbeError> {
        let mut state = self.0.borrow_mut();
        if state.refuse_attach {
            return Err(refused());
        }
        let id = state.next_id;
        state.next_id += 1;
        state.attached.insert(id, (Some(image.key), window_shift));
        state.attaches.push((image.key, window_shift));
        Ok(Attached {
            live_mode: LiveMode::Off,
            frees: image.frees.len(),
            links: LinkSet::new(id, image.entries.len().max(1)),
        })
    }
}

impl Gates for FakeKernel {
    fn set_gate(&mut self, pid: u32, state: GateState) -> Result<(), ProbeError> {
        let mut fake = self.0.borrow_mut();
        fake.pids.insert(pid);
        fake.gates.entry(pid).or_default().state = state as u32;
        Ok(())
    }

    fn set_coarsening(&mut self, pid: u32, coarsening: u32) -> Result<(), ProbeError> {
        let mut fake = self.0.borrow_mut();
        fake.gates.entry(pid).or_default().coarsening = coarsening;
        Ok(())
    }

    fn gate_hits(&self) -> Result<HashMap<u32, ProcessGate>, ProbeError> {
        Ok(self.0.borrow().gates.clone())
    }

    fn gate_hits_of(&self, pid: u32) -> Option<ProcessGate> {
        self.0.borrow().gates.get(&pid).copied()
    }
}

impl Attach for FakeKernel {
    fn windows_supported(&self) -> bool {
        self.0.borrow().windows_supported
    }

    fn attach(&mut self, image: &AllocatorImage) -> Result<Attached, ProbeError> {
        self.attach_as(image, 0)
    }

    fn attach_in_windows(
        &mut self,
        image: &AllocatorImage,
        window_shift: u8,
    ) -> Result<Attached, ProbeError> {
        self.attach_as(image, window_shift)
    }

    fn attach_own(&mut self, image: &AllocatorImage, pid: u32) -> Result<Attached, ProbeError> {
        let attached = self.attach_as(image, 0)?;
        let id = attached.links.id();
        self.0.borrow_mut().own_attaches.push((image.key, pid, id));
        Ok(attached)
    }

    fn attach_empty_at(&mut self, _: &Path, _: u64, _: u32) -> Result<LinkSet, ProbeError> {
        let mut state = self.0.borrow_mut();
        let id = state.next_id;
        state.next_id += 1;
        state.attached.insert(id, (None, 0));
        Ok(LinkSet::new(id, 1))
    }

    fn detach(&mut self, links: LinkSet) {
        let mut state = self.0.borrow_mut();
        state.attached.remove(&links.id());
        state.detached.push(links.id());
    }

    fn detach_later(&mut self, links: LinkSet) -> Vec<Detaching> {
        self.detach(links);
        Vec::new()
    }

    fn wait_for_running_programs(&self) {}
}

impl Epochs for FakeKernel {
    fn epoch(&self) -> u64 {
        self.0.borrow().epoch
    }

    fn next_epoch(&mut self) -> Result<u64, ProbeError> {
        let mut state = self.0.borrow_mut();
        state.epoch += 1;
        Ok(state.epoch - 1)
    }

    fn counters(&self) -> Result<Counters, ProbeError> {
        Ok(Counters::default())
    }

    fn counters_of(&self, _: u64) -> Result<Counters, ProbeError> {
        Ok(Counters::default())
    }

    fn totals_of(&mut self, epoch: u64) -> Result<HashMap<u32, Totals>, ProbeError> {
        Ok(self
            .0
            .borrow()
            .totals
            .get(&epoch)
            .cloned()
            .unwrap_or_default())
    }
}

impl Upkeep for FakeKernel {
    fn refresh_intervals(&mut self) -> Result<(), ProbeError> {
        self.0.borrow_mut().refreshes += 1;
        Ok(())
    }

    fn collect_exited_threads(&mut self) -> usize {
        0
    }

    fn pressure_level(&self) -> u32 {
        self.0.borrow().pressure_level
    }

    fn flush_logs(&mut self) {}
}

impl LiveState for FakeKernel {
    fn kernel_pids(&self) -> HashSet<u32> {
        self.0.borrow().pids.clone()
    }

    fn live_sample_ids(&self) -> HashMap<u32, HashSet<u64>> {
        self.0.borrow().live.clone()
    }

    fn forget_live_blocks(&mut self, expired: &HashSet<(u32, u64)>) -> usize {
        let mut state = self.0.borrow_mut();
        let mut forgotten = 0;
        for (pid, id) in expired {
            if state.live.get_mut(pid).is_some_and(|ids| ids.remove(id)) {
                forgotten += 1;
            }
        }
        forgotten
    }

    fn forget_processes(&mut self, pids: &HashSet<u32>) {
        let mut state = self.0.borrow_mut();
        for pid in pids {
            state.pids.remove(pid);
            state.gates.remove(pid);
            state.live.remove(pid);
            for entries in state.entries.values_mut() {
                entries.remove(pid);
            }
            state.forgotten.insert(*pid);
        }
    }
}

impl RuntimeMaps for FakeKernel {
    fn set_entry(
        &mut self,
        map: &'static str,
        pid: u32,
        value: &[u8],
    ) -> Result<(), RuntimeMapError> {
        let mut state = self.0.borrow_mut();
        state
            .entries
            .entry(map)
            .or_default()
            .insert(pid, value.to_vec());
        Ok(())
    }

    fn forget_entry(&mut self, map: &'static str, pid: u32) {
        if let Some(entries) = self.0.borrow_mut().entries.get_mut(map) {
            entries.remove(&pid);
        }
    }
}

struct FakeEvents(Rc<RefCell<FakeQueue>>);

impl EventSource for FakeEvents {
    fn read_batch<'a>(&'a mut self, out: &'a mut Vec<Event>) -> ReadFuture<'a> {
        let mut queue = self.0.borrow_mut();
        let result = match queue.events.is_empty() {
            true => queue.error.take().map_or(Ok(()), Err),
            false => Ok(()),
        };
        out.extend(queue.events.drain(..));
        Box::pin(std::future::ready(result))
    }

    fn drain_some(&mut self, out: &mut Vec<Event>) -> bool {
        out.extend(self.0.borrow_mut().events.drain(..));
        false
    }

    fn figures(&self) -> SourceFigures {
        SourceFigures::default()
    }
}
