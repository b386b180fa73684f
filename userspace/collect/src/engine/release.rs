//! Letting go of images and files no running process uses any more: their probes,
//! their open descriptors and the facts cached about them. What the agent holds is
//! bounded by the processes running now, not by every program the host ever ran.

use std::collections::HashSet;

use super::{Collector, ImageKey};
use allocbpf_images::procfs;
use allocbpf_profile::frame::Frame;

impl Collector {
    /// Called at each cut, after exited processes are dropped: detaches the images no
    /// tracked process maps, and forgets the cached facts (and descriptors) of every
    /// file no tracked process mapped when it was last examined.
    pub(super) fn release_unused_images(&mut self) {
        let mut listed: HashSet<ImageKey> = self
            .processes
            .tracked
            .values()
            .flat_map(|tracked| tracked.mapped.iter().copied())
            .collect();
        let mut unused: HashSet<ImageKey> = self
            .images
            .images
            .keys()
            .filter(|key| !listed.contains(key))
            .copied()
            .collect();
        // A process may have mapped an image since it was examined (dlopen): what a
        // live tracked process maps now stays attached. Only read when an image is
        // about to go, which is rare (its last process exited).
        let pids: Vec<u32> = self.processes.tracked.keys().copied().collect();
        for pid in pids {
            if unused.is_empty() {
                break;
            }
            let maps = procfs::read_maps_counting_cuts(pid, &mut self.processes.maps_cut);
            let mut now_mapped = Vec::new();
            for key in maps.iter().map(ImageKey::of) {
                if unused.remove(&key) {
                    listed.insert(key);
                    now_mapped.push(key);
                }
            }
            if let Some(tracked) = self.processes.tracked.get_mut(&pid) {
                tracked.mapped.extend(now_mapped);
            }
        }
        for key in unused {
            let Some(state) = self.images.images.remove(&key) else {
                continue;
            };
            if let Some(budget) = self.budget.as_mut() {
                budget.schedule.forget(&key);
            }
            if let Some(links) = state.links {
                self.kernel().detach(links);
                self.stats.images_attached -= 1;
            }
            self.stats.images_released += 1;
            tracing::info!(
                "detached {} ({key}): no process maps it any more",
                state.image.path_in_target.display()
            );
        }
        self.images.cache.retain(|key| listed.contains(key));
    }

    /// Called at each cut, after the new interval started (stacks that hold neither
    /// samples nor live blocks are gone): releases the modules no remaining stack
    /// refers to (file and entry), and the runtimes' source locations none refers to
    /// (their ids reused). A running process's module is interned again, with its file,
    /// at its next sample, as are its locations.
    pub(super) fn release_unreferenced(&mut self) {
        let frames = || {
            (self.processes.tracked.values())
                .flat_map(|tracked| tracked.aggregate.keys())
                .flat_map(|key| key.frames.iter())
        };
        let modules: HashSet<u32> = frames().filter_map(Frame::module).collect();
        let locations: HashSet<u32> = frames()
            .filter_map(|frame| match frame {
                Frame::Runtime(id) => Some(*id),
                _ => None,
            })
            .collect();
        let closed = self
            .stacks
            .normalizer
            .release_module_files(|id| modules.contains(&id));
        self.stats.locations_released +=
            self.stacks.release_locations(|id| locations.contains(&id)) as u64;
        self.stats.locations = self.stacks.locations_held() as u64;
        self.stats.module_files_closed += closed as u64;
        self.stats.module_files_open = self.stacks.normalizer.modules.open_files() as u64;
        self.stats.module_entries = self.stacks.normalizer.modules.len() as u64;
    }
}
