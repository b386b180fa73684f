//! The language runtimes as the engine drives them, through the frame resolver that
//! holds them: each admitted process handed to all of them, their polls added to the
//! processes' aggregates, and every process the engine forgets forgotten by all of
//! them. Nothing here names a runtime (`crate::runtimes` does).

use std::{collections::HashMap, time::Instant};

use allocbpf_images::procfs::{self, MapsEntry};
use allocbpf_profile::aggregate::StackKey;
use allocbpf_runtime::{
    Departure, Found, NoMaps, PollFigures, ProcessPoll, ProcessView, RuntimeMaps,
};

use super::{
    map_shares::{MapShares, SharedMaps},
    Collector,
};
use crate::identity;
use crate::kernel::Kernel;

impl Collector {
    /// Hands `pid` (mapping `maps`) to every runtime (`again`: only to those that asked
    /// to look again now): what those that claim it found labels its profiles.
    pub(super) fn look_at_runtimes(&mut self, pid: u32, maps: &[MapsEntry], again: bool) {
        let start_time = (self.processes.tracked.get(&pid)).and_then(|t| t.info.start_time);
        let view = ProcessView {
            pid,
            start_time,
            maps,
            files: &self.images.cache,
        };
        let mut no_maps = NoMaps;
        let mut kernel_maps = kernel_maps(
            self.kernel.as_deref_mut(),
            &mut no_maps,
            &mut self.map_shares,
        );
        let again_at = again.then(Instant::now);
        let found = self.stacks.look_at(&view, &mut kernel_maps, again_at);
        self.stats.runtime_entries_refused = self.map_shares.refused;
        if let Some(tracked) = self.processes.tracked.get_mut(&pid) {
            let known = &mut tracked.info.runtimes;
            for found in found {
                known.retain(|k: &Found| k.runtime != found.runtime);
                known.push(found);
            }
            // Labels in the runtimes' order, whichever looked first.
            known.sort_by_key(|k| self.stacks.runtime_rank(k.runtime));
        }
    }

    /// Looks again, through the runtimes that asked, at the followed processes they
    /// looked at too early (an interpreter still initialising): on the housekeeping
    /// tick, never in the path of a sample.
    pub(super) fn look_again_due(&mut self, now: Instant) {
        // Only the process that asked: a pid reused since is another one, looked at
        // when it samples.
        let due: Vec<u32> = (self.processes.tracked.iter())
            .filter(|(&pid, _)| self.stacks.look_again_due(pid, now))
            .filter(|(&pid, tracked)| identity::start_time(pid) == tracked.info.start_time)
            .map(|(&pid, _)| pid)
            .collect();
        for pid in due {
            let maps = procfs::read_maps_counting_cuts(pid, &mut self.processes.maps_cut);
            self.look_at_runtimes(pid, &maps, true);
        }
    }

    /// Polls the runtimes whose poll is due (all of them with `force`, at a cut): new
    /// sampled allocations go into their processes' aggregates, objects in use replace
    /// the previous ones. A runtime's time counts its poll and the adding.
    pub(super) fn poll_runtimes(&mut self, force: bool) {
        let tracked = &self.processes.tracked;
        let is_current = |pid: u32, start| {
            tracked
                .get(&pid)
                .is_some_and(|t| t.info.start_time == start)
        };
        let polls = self.stacks.poll(Instant::now(), force, &is_current);
        for (name, polled) in polls {
            // A runtime with nothing to read (no own sampler) counts nothing.
            let nothing = polled.processes.is_empty() && polled.figures == PollFigures::default();
            if nothing && !self.stats.runtime_reads.contains_key(name) {
                continue;
            }
            let adding = Instant::now();
            for poll in polled.processes {
                add_poll(&mut self.processes.tracked, poll);
            }
            let mut figures = polled.figures;
            figures.ns += adding.elapsed().as_nanos() as u64;
            self.stats
                .runtime_reads
                .entry(name)
                .or_default()
                .add(figures);
        }
    }

    /// Forgets what the frame resolver and every runtime hold of `pid`, and the kernel
    /// maps they filled as `why` requires.
    pub(super) fn forget_process(&mut self, pid: u32, why: Departure) {
        // Its memory is read again only by readers made for its next image.
        allocbpf_images::memory::mappings::forget(pid);
        let mut no_maps = NoMaps;
        let mut kernel_maps = kernel_maps(
            self.kernel.as_deref_mut(),
            &mut no_maps,
            &mut self.map_shares,
        );
        self.stacks.forget(pid, why, &mut kernel_maps);
    }

    /// Refreshes the counts kept by the parts that read other processes' files.
    pub(super) fn refresh_file_counts(&mut self) {
        self.stats.maps_truncated = self.processes.maps_cut + self.stacks.maps_cut();
        self.stats.descriptor_errors = self.images.cache.descriptor_errors()
            + self.stacks.descriptor_errors()
            + self.processes.build_ids.descriptor_errors();
    }
}

/// The kernel's runtime maps, or `no_maps` once the kernel is gone (after stop), each
/// user held to its share of them (`shares`).
fn kernel_maps<'a>(
    kernel: Option<&'a mut (dyn Kernel + 'static)>,
    no_maps: &'a mut NoMaps,
    shares: &'a mut MapShares,
) -> SharedMaps<'a> {
    let inner: &mut dyn RuntimeMaps = match kernel {
        Some(kernel) => kernel,
        None => no_maps,
    };
    SharedMaps {
        inner,
        shares,
        owner_of: procfs::process_owner,
    }
}

/// Adds one process's poll to its aggregate, if it is still followed.
fn add_poll(tracked: &mut HashMap<u32, super::Tracked>, poll: ProcessPoll) {
    let pid = poll.pid;
    let Some(tracked) = tracked.get_mut(&pid) else {
        return;
    };
    let aggregate = &mut tracked.aggregate;
    for counted in poll.allocated {
        let key = StackKey {
            pid,
            frames: counted.frames,
        };
        aggregate.add_counted(key, counted.size, counted.rate, counted.count);
    }
    let mut in_use: HashMap<StackKey, Vec<(u64, u64, u64)>> = HashMap::new();
    for counted in poll.in_use {
        let key = StackKey {
            pid,
            frames: counted.frames,
        };
        let values = (counted.size, counted.count, counted.rate);
        in_use.entry(key).or_default().push(values);
    }
    aggregate.set_runtime_in_use(in_use);
}
