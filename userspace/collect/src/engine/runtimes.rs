//! The language runtimes as the engine drives them, through the frame resolver that
//! holds them: each admitted process handed to all of them, their polls added to the
//! processes' aggregates, and every process the engine forgets forgotten by all of
//! them. Nothing here names a runtime (`crate::runtimes` does).

use std::{collections::HashMap, time::Instant};

use allocbpf_images::procfs::MapsEntry;
use allocbpf_profile::aggregate::StackKey;
use allocbpf_runtime::{NoMaps, ProcessPoll, ProcessView, RuntimeMaps};

use super::Collector;

impl Collector {
    /// Hands `pid` (mapping `maps`) to every runtime: what those that claim it found
    /// labels its profiles.
    pub(super) fn look_at_runtimes(&mut self, pid: u32, maps: &[MapsEntry]) {
        let start_time = (self.processes.tracked.get(&pid)).and_then(|t| t.info.start_time);
        let view = ProcessView {
            pid,
            start_time,
            maps,
            files: &self.images.cache,
        };
        let mut no_maps = NoMaps;
        let kernel_maps: &mut dyn RuntimeMaps = match self.kernel.as_deref_mut() {
            Some(kernel) => kernel,
            None => &mut no_maps,
        };
        let found = self.stacks.look_at(&view, kernel_maps);
        if let Some(tracked) = self.processes.tracked.get_mut(&pid) {
            tracked.info.runtimes.extend(found);
        }
    }

    /// Polls the runtimes whose poll is due (all of them with `force`, at a cut): new
    /// sampled allocations go into their processes' aggregates, objects in use replace
    /// the previous ones.
    pub(super) fn poll_runtimes(&mut self, force: bool) {
        let tracked = &self.processes.tracked;
        let is_current = |pid: u32, start| {
            tracked
                .get(&pid)
                .is_some_and(|t| t.info.start_time == start)
        };
        let polls = self.stacks.poll(Instant::now(), force, &is_current);
        for (name, polled) in polls {
            self.stats
                .runtime_reads
                .entry(name)
                .or_default()
                .add(polled.figures);
            for poll in polled.processes {
                self.add_poll(poll);
            }
        }
    }

    /// Adds one process's poll to its aggregate.
    fn add_poll(&mut self, poll: ProcessPoll) {
        let pid = poll.pid;
        let Some(tracked) = self.processes.tracked.get_mut(&pid) else {
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
            in_use
                .entry(key)
                .or_default()
                .push((counted.size, counted.count, counted.rate));
        }
        aggregate.set_runtime_in_use(in_use);
    }

    /// Forgets what the frame resolver and every runtime hold of `pid` (it exited,
    /// exec'd, or its pid names another process now), and the kernel maps they filled.
    pub(super) fn forget_process(&mut self, pid: u32) {
        let mut no_maps = NoMaps;
        let kernel_maps: &mut dyn RuntimeMaps = match self.kernel.as_deref_mut() {
            Some(kernel) => kernel,
            None => &mut no_maps,
        };
        self.stacks.forget(pid, kernel_maps);
    }
}
