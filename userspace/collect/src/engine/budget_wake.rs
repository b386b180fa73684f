//! The collector's side of the overhead budget: when its loop wakes for windows and
//! early checks, and the budget's figures for metrics.

use std::time::{Duration, Instant};

use allocbpf_probe::sampler::monotonic_now_ns;

use super::{budget_control::ProcessCostFigures, BudgetFigures, Collector};

impl Collector {
    /// Brings the loop's next wake-up forward to the budget's early check, if asked for.
    pub(super) fn wake_for_early_check(&mut self) {
        let early = self.budget.as_ref().and_then(|b| b.early_check_ns());
        self.chores.next_window_change_ns = self
            .chores
            .next_window_change_ns
            .into_iter()
            .chain(early)
            .min();
    }

    /// Under an overhead budget: when observation windows next open or close, or a
    /// new program's early budget check is due (call [`Collector::windows_tick`]
    /// then). `None`: no budget.
    pub fn next_window_change(&self) -> Option<Instant> {
        let at_ns = self.chores.next_window_change_ns?;
        let wait = at_ns.saturating_sub(monotonic_now_ns());
        Some(Instant::now() + Duration::from_nanos(wait))
    }

    /// True if observation windows open or close now.
    pub(super) fn window_due(&self) -> bool {
        self.chores
            .next_window_change_ns
            .is_some_and(|at| at <= monotonic_now_ns())
    }

    /// Moves probes in and out as observation windows open and close, after the
    /// early budget check of new programs if one is due (their first look first, so
    /// that their images are known).
    pub fn windows_tick(&mut self) {
        let early_due = self
            .budget
            .as_ref()
            .and_then(|budget| budget.early_check_ns())
            .is_some_and(|due| due <= monotonic_now_ns());
        if early_due && self.kernel.is_some() {
            self.observe_execs_due(Instant::now());
            if let (Some(budget), Some(kernel)) = (self.budget.as_mut(), self.kernel.as_deref_mut())
            {
                budget.check(kernel, &mut self.processes, &self.images, &mut self.stats);
            }
        }
        let (Some(budget), Some(kernel)) = (self.budget.as_mut(), self.kernel.as_deref_mut())
        else {
            return;
        };
        let next = budget.windows_tick(
            kernel,
            &mut self.processes,
            &mut self.images,
            &mut self.stats,
        );
        // Without any image nothing changes; look again in a period.
        let period = budget.options.period.as_nanos() as u64;
        // An early check still to come (due, or waiting for its spacing) comes here.
        let early = budget.early_check_ns().unwrap_or(u64::MAX);
        self.chores.next_window_change_ns = Some(next.min(monotonic_now_ns() + period).min(early));
    }

    /// The overhead budget's figures per image (duty, probed fraction, overhead) and
    /// per process (cost full time, overhead), for metrics; empty without a budget.
    pub fn budget_figures(&self) -> BudgetFigures {
        let Some(budget) = &self.budget else {
            return BudgetFigures::default();
        };
        let images = budget
            .image_figures
            .iter()
            .filter_map(|(key, figures)| {
                let state = self.images.images.get(key)?;
                Some((
                    key.to_string(),
                    state.image.path_in_target.display().to_string(),
                    *figures,
                ))
            })
            .collect();
        let processes = budget
            .costs
            .iter()
            .filter_map(|(pid, figures)| {
                let tracked = self.processes.tracked.get(pid)?;
                Some((
                    *pid,
                    tracked.info.comm_text().into_owned(),
                    tracked.observed.fraction(),
                    ProcessCostFigures {
                        pace: tracked.pace.tally.ratio(),
                        ..*figures
                    },
                ))
            })
            .collect();
        BudgetFigures {
            process_cpu: budget.options.process_cpu,
            host_cpu: budget.host_cpu(),
            images,
            processes,
        }
    }
}
