//! Applies the budget: reads the kernel's probe hits, asks [`Budget`] what to do, and
//! closes gates or detaches images accordingly.

use std::{collections::HashMap, time::Instant};

use allocbpf_common::GateState;
use allocbpf_probe::sampler::Sampler;

use super::{Budget, BudgetAction, Hits};
use crate::engine::{CollectorStats, ImageSet, ProcessTable};

/// The budget with its check clock.
pub(crate) struct BudgetController {
    /// The arithmetic and back-off state.
    pub budget: Budget,
    last_check: Instant,
}

impl BudgetController {
    /// A controller for `budget`, first checking one period after `started`.
    pub fn new(budget: Budget, started: Instant) -> Self {
        Self {
            budget,
            last_check: started,
        }
    }

    /// Checks every process's hits if a period has passed, and applies the actions.
    pub fn tick(
        &mut self,
        now: Instant,
        sampler: &mut Sampler,
        processes: &ProcessTable,
        images: &mut ImageSet,
        stats: &mut CollectorStats,
    ) {
        if now.duration_since(self.last_check) < self.budget.options.check_every {
            return;
        }
        self.last_check = now;
        let hits = match sampler.gate_hits() {
            Ok(hits) => hits,
            Err(error) => {
                tracing::warn!("probe hits unavailable: {error}");
                return;
            }
        };
        let hits: HashMap<u32, Hits> = hits
            .into_iter()
            .filter(|(pid, _)| !processes.ignored.contains(pid))
            .map(|(pid, (all, stepped, _))| (pid, Hits { all, stepped }))
            .collect();
        let actions = self.budget.check(&hits, now);
        stats.budget_backoffs = self.budget.backoffs;
        stats.budget_detachments = self.budget.detachments;
        stats.budget_paused = self.budget.paused() as u64;
        for action in actions {
            apply(action, now, sampler, processes, images, stats);
        }
    }
}

fn apply(
    action: BudgetAction,
    now: Instant,
    sampler: &mut Sampler,
    processes: &ProcessTable,
    images: &mut ImageSet,
    stats: &mut CollectorStats,
) {
    match action {
        BudgetAction::Pause {
            pid,
            fraction,
            backoff,
        } => {
            tracing::warn!(
                "pid {pid} ({}) is over its overhead budget: ~{:.1}% of a CPU in probes; sampling paused for {}s",
                processes.comm(pid),
                fraction * 100.0,
                backoff.as_secs()
            );
            let _ = sampler.set_gate(pid, GateState::Paused);
        }
        BudgetAction::DetachImages {
            pid,
            fraction,
            backoff,
        } => {
            let keys = processes
                .tracked
                .get(&pid)
                .map(|t| t.images.clone())
                .unwrap_or_default();
            tracing::warn!(
                "pid {pid} ({}) still spends ~{:.1}% of a CPU in probe traps while paused: detaching {} image(s) it uses, for every process, for {}s",
                processes.comm(pid),
                fraction * 100.0,
                keys.len(),
                backoff.as_secs()
            );
            for key in keys {
                images.detach_until(sampler, stats, &key, now + backoff);
            }
        }
        BudgetAction::Resume { pid } => {
            let admitted = processes.tracked.get(&pid).is_some_and(|t| t.admitted);
            tracing::info!("pid {pid} ({}): back-off over", processes.comm(pid));
            if admitted {
                let _ = sampler.set_gate(pid, GateState::Open);
            }
        }
    }
}
