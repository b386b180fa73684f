//! The real kernel side: the eBPF sampler and its ring-buffer reader.

use std::{
    collections::{HashMap, HashSet},
    path::Path,
};

use allocbpf_common::{GateState, ProcessGate, Totals};
use allocbpf_images::image::AllocatorImage;
use allocbpf_probe::{
    events::{Event, EventReader},
    sampler::{self, ImageLinks, ProbeError, Sampler, SamplerConfig},
};
use allocbpf_profile::report::Counters;

use allocbpf_runtime::{RuntimeMapError, RuntimeMaps};

use super::{
    Attach, Attached, Detaching, Epochs, EventSource, Gates, KernelLoader, LinkSet, LiveState,
    Loaded, ReadFuture, SourceFigures, Upkeep,
};
use crate::error::CollectError;

/// The eBPF program built from `ebpf/allocbpf-ebpf`, as the binary embeds it (8-byte
/// aligned: `aya::include_bytes_aligned!`). Loading it gives the real kernel side.
#[derive(Clone, Copy, Debug)]
pub struct EbpfObject(pub &'static [u8]);

impl KernelLoader for EbpfObject {
    fn load(&self, config: SamplerConfig) -> Result<Loaded, CollectError> {
        if self.0.is_empty() {
            return Err(CollectError::NoProgram);
        }
        let mut sampler = Sampler::load(self.0, config)?;
        let reader = EventReader::new(sampler.take_events()?).map_err(CollectError::RingBuffer)?;
        Ok(Loaded {
            kernel: Box::new(EbpfKernel {
                sampler,
                held: HashMap::new(),
                next_id: 0,
            }),
            events: Box::new(reader),
        })
    }
}

/// Links the sampler attached, under the id of their [`LinkSet`].
enum Held {
    /// An image's probes.
    Image(ImageLinks),
    /// The calibration's empty program at one point.
    Empty(sampler::EmptyLink),
}

/// The sampler, with the links it attached kept under the ids the engine holds.
struct EbpfKernel {
    sampler: Sampler,
    held: HashMap<u64, Held>,
    next_id: u64,
}

impl EbpfKernel {
    fn hold(&mut self, held: Held, probes: usize) -> LinkSet {
        let id = self.next_id;
        self.next_id += 1;
        self.held.insert(id, held);
        LinkSet::new(id, probes)
    }

    fn held(&mut self, attached: sampler::Attached) -> Attached {
        let probes = attached.links.len();
        Attached {
            live_mode: attached.live_mode,
            frees: attached.frees,
            links: self.hold(Held::Image(attached.links), probes),
        }
    }
}

impl Gates for EbpfKernel {
    fn set_gate(&mut self, pid: u32, state: GateState) -> Result<(), ProbeError> {
        self.sampler.set_gate(pid, state)
    }

    fn set_coarsening(&mut self, pid: u32, coarsening: u32) -> Result<(), ProbeError> {
        self.sampler.set_coarsening(pid, coarsening)
    }

    fn gate_hits(&self) -> Result<HashMap<u32, ProcessGate>, ProbeError> {
        self.sampler.gate_hits()
    }

    fn gate_hits_of(&self, pid: u32) -> Option<ProcessGate> {
        self.sampler.gate_hits_of(pid)
    }
}

impl Attach for EbpfKernel {
    fn windows_supported(&self) -> bool {
        self.sampler.windows_supported()
    }

    fn attach(&mut self, image: &AllocatorImage) -> Result<Attached, ProbeError> {
        let attached = self.sampler.attach(image)?;
        Ok(self.held(attached))
    }

    fn attach_in_windows(
        &mut self,
        image: &AllocatorImage,
        window_shift: u8,
    ) -> Result<Attached, ProbeError> {
        let attached = self.sampler.attach_in_windows(image, window_shift)?;
        Ok(self.held(attached))
    }

    fn attach_own(&mut self, image: &AllocatorImage, pid: u32) -> Result<Attached, ProbeError> {
        let attached = self.sampler.attach_own(image, pid)?;
        Ok(self.held(attached))
    }

    fn attach_empty_at(
        &mut self,
        path: &Path,
        offset: u64,
        pid: u32,
    ) -> Result<LinkSet, ProbeError> {
        let link = self.sampler.attach_empty_at(path, offset, pid)?;
        Ok(self.hold(Held::Empty(link), 1))
    }

    fn detach(&mut self, links: LinkSet) {
        match self.held.remove(&links.id()) {
            Some(Held::Image(links)) => self.sampler.detach(links),
            Some(Held::Empty(link)) => self.sampler.detach_empty(link),
            None => {}
        }
    }

    fn detach_later(&mut self, links: LinkSet) -> Vec<Detaching> {
        match self.held.remove(&links.id()) {
            Some(Held::Image(links)) => self
                .sampler
                .take_links(links)
                .split()
                .into_iter()
                .map(|part| Box::new(part) as Detaching)
                .collect(),
            Some(Held::Empty(link)) => {
                self.sampler.detach_empty(link);
                Vec::new()
            }
            None => Vec::new(),
        }
    }

    fn wait_for_running_programs(&self) {
        sampler::wait_for_running_programs();
    }
}

impl Epochs for EbpfKernel {
    fn epoch(&self) -> u64 {
        self.sampler.epoch()
    }

    fn next_epoch(&mut self) -> Result<u64, ProbeError> {
        self.sampler.next_epoch()
    }

    fn counters(&self) -> Result<Counters, ProbeError> {
        self.sampler.counters()
    }

    fn counters_of(&self, epoch: u64) -> Result<Counters, ProbeError> {
        self.sampler.counters_of(epoch)
    }

    fn totals_of(&mut self, epoch: u64) -> Result<HashMap<u32, Totals>, ProbeError> {
        self.sampler.totals_of(epoch)
    }
}

impl Upkeep for EbpfKernel {
    fn refresh_intervals(&mut self) -> Result<(), ProbeError> {
        self.sampler.refresh_intervals()
    }

    fn collect_exited_threads(&mut self) -> usize {
        self.sampler.collect_exited_threads()
    }

    fn pressure_level(&self) -> u32 {
        self.sampler.pressure_level()
    }

    fn flush_logs(&mut self) {
        self.sampler.flush_logs();
    }
}

impl LiveState for EbpfKernel {
    fn kernel_pids(&self) -> HashSet<u32> {
        self.sampler.kernel_pids()
    }

    fn live_sample_ids(&self) -> HashMap<u32, HashSet<u64>> {
        self.sampler.live_sample_ids()
    }

    fn forget_live_blocks(&mut self, expired: &HashSet<(u32, u64)>) -> usize {
        self.sampler.forget_live_blocks(expired)
    }

    fn forget_processes(&mut self, pids: &HashSet<u32>) {
        self.sampler.forget_processes(pids);
    }
}

impl RuntimeMaps for EbpfKernel {
    fn set_entry(
        &mut self,
        map: &'static str,
        pid: u32,
        value: &[u8],
    ) -> Result<(), RuntimeMapError> {
        (self.sampler.set_entry(map, pid, value))
            .map_err(|error| RuntimeMapError(error.to_string()))
    }

    fn forget_entry(&mut self, map: &'static str, pid: u32) {
        self.sampler.forget_entry(map, pid);
    }
}

impl EventSource for EventReader {
    fn read_batch<'a>(&'a mut self, out: &'a mut Vec<Event>) -> ReadFuture<'a> {
        Box::pin(EventReader::read_batch(self, out))
    }

    fn drain_some(&mut self, out: &mut Vec<Event>) -> bool {
        EventReader::drain_some(self, out)
    }

    fn figures(&self) -> SourceFigures {
        use std::sync::atomic::Ordering::Relaxed;
        SourceFigures {
            malformed: self.malformed,
            ring_peak_bytes: self.stats.ring_peak_bytes.load(Relaxed),
            queue_peak_bytes: self.stats.queue_peak_bytes.load(Relaxed),
        }
    }
}
