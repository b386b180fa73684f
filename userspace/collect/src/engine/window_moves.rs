//! The budget's windows in the engine: moving an image's probes in and out as its
//! windows open and close ([`BudgetController::windows_tick`]), and the pace readings
//! taken at each move (docs/statistics.md, "Pace").

use allocbpf_images::image::ImageKey;
use allocbpf_probe::sampler::monotonic_now_ns;
use allocbpf_profile::estimate::pace::ProbeState;

use super::{
    budget_control::{read_pace, BudgetController},
    thread_cpu_ns, CollectorStats, ImageSet, ProcessTable,
};
use crate::{
    budget::{windows::window_shift, Hits},
    kernel::{Gates, Kernel},
};

/// Processes whose gates a window move reads one lookup each at most; beyond, all
/// gates are read at once (a batched read costs about as much as a few lookups).
const GATES_READ_ONE_BY_ONE: usize = 8;

impl BudgetController {
    /// Reads the pace meter of every process mapping `key`, whose probes just went in
    /// or out (`attaching`: are about to go in).
    fn read_pace_of_image(
        &self,
        kernel: &dyn Gates,
        processes: &mut ProcessTable,
        images: &ImageSet,
        key: &ImageKey,
        attaching: bool,
    ) {
        // Profiled processes only: the others' estimates are never made.
        let read = |tracked: &super::process_table::Tracked| {
            tracked.admitted
                && !tracked.exited
                && !tracked.own.attached()
                && tracked.images.contains(key)
        };
        let count = processes.tracked.values().filter(|t| read(t)).count();
        // Many processes (every one mapping libc): their gates in one batched read,
        // not a lookup each.
        let all = (count > GATES_READ_ONE_BY_ONE)
            .then(|| kernel.gate_hits().ok())
            .flatten();
        let changing = attaching.then_some(ProbeState::Changing);
        for (&pid, tracked) in processes.tracked.iter_mut() {
            if !read(tracked) {
                continue;
            }
            let gate = match &all {
                Some(all) => all.get(&pid).copied(),
                None => kernel.gate_hits_of(pid),
            };
            if let Some(gate) = gate {
                read_pace(&self.cost, pid, tracked, Hits::from(gate), images, changing);
            }
        }
    }

    /// Moves probes in and out as windows open and close; returns when to look again
    /// (CLOCK_MONOTONIC ns).
    pub fn windows_tick(
        &mut self,
        kernel: &mut dyn Kernel,
        processes: &mut ProcessTable,
        images: &mut ImageSet,
        stats: &mut CollectorStats,
    ) -> u64 {
        let now_ns = monotonic_now_ns();
        self.schedule.draw_phases(now_ns);
        let keys: Vec<ImageKey> = images
            .images
            .iter()
            .filter(|(_, state)| !state.failed)
            .map(|(key, _)| *key)
            .collect();
        let mut next = u64::MAX;
        for key in keys {
            let plan = self.schedule.attach_plan(&key, now_ns);
            next = next.min(plan.next_change_ns);
            let shift = window_shift(self.schedule.duty_at(&key, now_ns));
            let mut attached = images.images.get(&key).is_some_and(|s| s.links.is_some());
            let attached_shift = images.images.get(&key).map(|s| s.window_shift);
            if plan.attached && attached && attached_shift != Some(shift) {
                // Its duty moved its window shift (full time again, or a new fraction):
                // out, and in again below with the new one. Rare: duties change at
                // budget checks, and only a change across a power of two moves it.
                images.detach_in_background(kernel, stats, &key);
                attached = false;
            }
            if plan.attached && !attached {
                let (before, cpu_before) = (monotonic_now_ns(), thread_cpu_ns());
                // The attach takes milliseconds, its breakpoints going in along the way.
                self.read_pace_of_image(kernel, processes, images, &key, true);
                if images.reattach(kernel, stats, &key, shift) {
                    stats.window_attaches += 1;
                    let done = monotonic_now_ns();
                    self.read_pace_of_image(kernel, processes, images, &key, false);
                    let cpu = thread_cpu_ns().saturating_sub(cpu_before);
                    self.schedule.attached_in(key, done - before, cpu);
                    tracing::debug!("{key}: probes in, in {} us", (done - before) / 1000);
                    // A window that opened before the probes were in (its samples until
                    // then are not placed: `ImageSet::covered`).
                    let opened_before = [before, done]
                        .into_iter()
                        .find_map(|t| self.schedule.open_piece(&key, t))
                        .is_some_and(|(open, _)| open < done);
                    if opened_before {
                        stats.window_blind_spots += 1;
                    }
                }
            } else if !plan.attached && attached {
                images.detach_in_background(kernel, stats, &key);
                self.read_pace_of_image(kernel, processes, images, &key, false);
                tracing::debug!("{key}: probes out");
                stats.window_detaches += 1;
                // Frees are not seen until the next window: the live blocks of every
                // process mapping it leave the in-use set.
                for tracked in processes.tracked.values_mut() {
                    // Its own links still see its frees.
                    if tracked.images.contains(&key) && !tracked.own.attached() {
                        let expired = tracked.aggregate.expire_live(now_ns);
                        stats.window_expired_blocks += expired.len() as u64;
                        tracked.expired_blocks.extend(expired);
                    }
                }
            }
        }
        next
    }
}
