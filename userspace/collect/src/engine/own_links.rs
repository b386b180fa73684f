//! Own links: a light process sharing an image with a heavy one is probed full time
//! through probes of its own, filtered on its pid (docs/design.md, "Own links").

use std::collections::HashMap;

use allocbpf_common::GateState;
use allocbpf_images::image::ImageKey;
use allocbpf_probe::sampler::monotonic_now_ns;

use super::{
    budget_control::{program_of, BudgetController},
    CollectorStats, ImageSet, ProcessTable, Tracked,
};
use crate::kernel::Kernel;

/// Processes given their own links at one budget check at most: each costs the loop a
/// link per program and image (docs/benchmarks.md has what one costs); the
/// others wait for the next check, observed through the shared windows meanwhile.
const OWN_ATTACHES_PER_CHECK: usize = 2;

/// Processes with own links on one image at most. Every trap at a probed entry runs
/// the kernel's filter of each link on it, whatever process trapped: a host of
/// hundreds of light processes, each with its own links on libc, made every call of
/// every one of them walk hundreds of consumers (the 200-process bench,
/// docs/benchmarks.md). Past the cap, light processes are observed through the shared
/// windows, which the estimates account for.
pub(crate) const MAX_OWN_LINKED_PER_IMAGE: usize = 8;

/// A process given its own links is measured again this soon after: one light in its
/// first milliseconds (an assembler reading its input) and heavy after goes back to
/// the windows within this, not a whole check period later.
const OWN_LINKS_RECHECK_NS: u64 = 50_000_000;

/// True if one of `images` already has [`MAX_OWN_LINKED_PER_IMAGE`] processes with own
/// links on it (`own_linked`: their count per image).
fn maps_a_full_image(own_linked: &HashMap<ImageKey, usize>, images: &[ImageKey]) -> bool {
    (images.iter()).any(|key| own_linked.get(key).copied().unwrap_or(0) >= MAX_OWN_LINKED_PER_IMAGE)
}

impl BudgetController {
    /// Gives each light process that maps an image probed part time its own full-time
    /// links, and takes them from a process over its budget (or no longer profiled),
    /// which goes back to the shared windows. At most [`OWN_ATTACHES_PER_CHECK`]
    /// processes get links at a check: new processes first (a short job must not
    /// wait), then the busiest; the others are observed through the windows meanwhile,
    /// and for good once [`MAX_OWN_LINKED_PER_IMAGE`] processes have links on an image
    /// they map.
    pub(super) fn assign_own_links(
        &mut self,
        kernel: &mut dyn Kernel,
        processes: &mut ProcessTable,
        images: &ImageSet,
        stats: &mut CollectorStats,
        now_ns: u64,
    ) {
        let budget = self.options.process_cpu;
        for (&pid, tracked) in processes.tracked.iter_mut() {
            if !tracked.own.attached() {
                continue;
            }
            let heavy = self.over_budget(pid);
            if heavy || !tracked.admitted || tracked.exited {
                tracing::debug!(
                    "pid {pid} ({:?}): own links out (over its budget: {heavy})",
                    tracked.info.comm
                );
                take_own_links(kernel, images, pid, tracked);
                stats.own_link_removals += 1;
            }
        }
        let mut own_linked: HashMap<ImageKey, usize> = HashMap::new();
        for tracked in processes.tracked.values().filter(|t| t.own.attached()) {
            for key in &tracked.images {
                *own_linked.entry(*key).or_default() += 1;
            }
        }
        let next_ns = self.schedule.next_undrawn_ns(now_ns);
        // Candidates as (not measured yet, CPU in probes over the last check, pid):
        // new ones first, then the busiest.
        let mut candidates: Vec<(bool, f64, u32)> = processes
            .tracked
            .iter()
            .filter(|(_, t)| !t.own.attached() && !t.exited && t.admitted && !t.images.is_empty())
            .filter(|(_, t)| !maps_a_full_image(&own_linked, &t.images))
            .filter(|(_, t)| {
                t.images.iter().any(|key| {
                    self.schedule.duty_at(key, now_ns) < 1.0
                        || self.schedule.duty_at(key, next_ns) < 1.0
                })
            })
            .filter_map(|(&pid, t)| {
                // Not known to be over its budget: in its start-up allowance, measured
                // light, or not measured yet and of a program not known heavy (a
                // build's next cc1 is measured through the windows first).
                let allowed = self.allowances.covers(pid);
                match self.costs.get(&pid).filter(|cost| cost.measured) {
                    Some(cost) if cost.full_time_cpu <= budget || allowed => {
                        Some((false, cost.overhead_cpu, pid))
                    }
                    Some(_) => None,
                    None if !allowed && self.programs.known_heavy(&program_of(t), budget) => None,
                    None => Some((true, 0.0, pid)),
                }
            })
            .collect();
        candidates.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.total_cmp(&a.1)));
        for (_, _, pid) in candidates.into_iter().take(OWN_ATTACHES_PER_CHECK) {
            let Some(tracked) = processes.tracked.get_mut(&pid) else {
                continue;
            };
            // Two candidates of one check may fill an image's last place.
            if maps_a_full_image(&own_linked, &tracked.images) {
                continue;
            }
            let started = monotonic_now_ns();
            let mut links = Vec::new();
            let mut failed = None;
            for key in &tracked.images {
                let Some(state) = images.images.get(key).filter(|state| !state.failed) else {
                    continue;
                };
                match kernel.attach_own(&state.image, pid) {
                    Ok(attached) => links.push(attached.links),
                    Err(error) => {
                        failed = Some(error);
                        break;
                    }
                }
            }
            let switched = match failed {
                None if !links.is_empty() => kernel.set_gate(pid, GateState::OwnLinks),
                None => continue,
                Some(error) => Err(error),
            };
            match switched {
                Ok(()) => {
                    tracing::debug!(
                        "pid {pid} ({:?}): own links in, in {} us",
                        tracked.info.comm,
                        (monotonic_now_ns() - started) / 1000
                    );
                    for key in &tracked.images {
                        *own_linked.entry(*key).or_default() += 1;
                    }
                    tracked.own.links = links;
                    tracked.own.since_ns = Some(monotonic_now_ns());
                    stats.own_link_attaches += 1;
                    // Measured light over a few ms (a program's start), it may turn
                    // heavy: measured again soon, not a whole check period on.
                    self.early.ask_at(monotonic_now_ns() + OWN_LINKS_RECHECK_NS);
                }
                Err(error) => {
                    // It may have exited meanwhile: observed through the windows still.
                    tracing::debug!("pid {pid}: no own links: {error}");
                    images.detach_own_in_background(kernel, links);
                    stats.own_link_failures += 1;
                }
            }
        }
    }
}

/// Takes `pid`'s own links away (over its budget, or exited): its gate back to the
/// shared links first, then the links out in the background; its samples of the span
/// it had them are still placed as full time.
pub(super) fn take_own_links(
    kernel: &mut dyn Kernel,
    images: &ImageSet,
    pid: u32,
    tracked: &mut Tracked,
) {
    if tracked.own.links.is_empty() {
        return;
    }
    // Even for a process gone: a later one with its pid must not find its gate
    // counting links that were never its own (it would be blind).
    let state = match tracked.admitted {
        true => GateState::Open,
        false => GateState::Excluded,
    };
    let _ = kernel.set_gate(pid, state);
    let now_ns = monotonic_now_ns();
    if let Some(since) = tracked.own.since_ns.take() {
        tracked.own.last_span = Some((since, now_ns));
    }
    images.detach_own_in_background(kernel, std::mem::take(&mut tracked.own.links));
}
