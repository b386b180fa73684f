//! Discovery off the sample path: a sample of a process the engine has not seen is held
//! here, and its process is looked at (maps, identity, gates, images, runtimes) once the
//! batch under way is handled, or before any other event of that process, so that one
//! new program's first look never holds up the samples of every other process in the
//! batch. Held samples are at most one batch's: the ring-buffer reader bounds those.

use std::collections::HashSet;

use allocbpf_probe::events::RawSample;

use super::{process_table::Owner, Collector, WINDOW_CHECK_EVERY};

/// Samples of processes first seen in the batch under way, in arrival order.
#[derive(Default)]
pub(super) struct FirstSight {
    held: Vec<RawSample>,
    pids: HashSet<u32>,
}

impl FirstSight {
    /// True if samples of `pid` wait for its first look.
    pub(super) fn holds(&self, pid: u32) -> bool {
        self.pids.contains(&pid)
    }
}

impl Collector {
    /// Holds `sample`, of a process not seen yet, for its first look.
    pub(super) fn hold_for_first_sight(&mut self, sample: RawSample) {
        self.intake.first_sight.pids.insert(sample.pid);
        self.intake.first_sight.held.push(sample);
    }

    /// Looks at the processes whose samples are held (only `pid`'s when given), then
    /// adds their samples in the order they came.
    pub(super) fn look_at_first_seen(&mut self, only: Option<u32>) {
        let sight = &mut self.intake.first_sight;
        if sight.held.is_empty() || only.is_some_and(|pid| !sight.holds(pid)) {
            return;
        }
        let held = match only {
            Some(pid) => {
                sight.pids.remove(&pid);
                let (theirs, others) = std::mem::take(&mut sight.held)
                    .into_iter()
                    .partition(|sample| sample.pid == pid);
                sight.held = others;
                theirs
            }
            None => {
                sight.pids.clear();
                std::mem::take(&mut sight.held)
            }
        };
        let mut looked = HashSet::new();
        for (index, sample) in held.into_iter().enumerate() {
            let first = looked.insert(sample.pid);
            if first {
                self.observe(sample.pid);
            }
            // A new program's first look and first stack (its unwind tables, its
            // runtime) take a large program a good part of a second, and a long run of
            // held samples as long as a batch: a window change due meanwhile comes
            // between them, as it does between a batch's events.
            if (first || index % WINDOW_CHECK_EVERY == WINDOW_CHECK_EVERY - 1) && self.window_due()
            {
                self.windows_tick();
            }
            self.add_sample(sample, Owner::Tracked);
        }
    }
}
