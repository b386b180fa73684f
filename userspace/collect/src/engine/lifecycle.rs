//! A process's life as the engine sees it: an exec (a new program in the same
//! process) and an exit, each told once to every part that holds state of the process.

use std::time::Instant;

use allocbpf_runtime::Departure;

use super::{own_links, Collector, Scope};
use crate::kernel::Gates;

impl Collector {
    /// `pid` exec'd: what was known of its program is forgotten (stacks, runtimes, own
    /// links, images), it is looked at again soon, and the budget checks it early.
    pub(super) fn on_exec(&mut self, pid: u32) {
        self.stats.exec_events += 1;
        self.forget_process(pid, Departure::Exec);
        // A new program: its maps re-read every round again.
        self.chores.maps_rescan.forget(pid);
        if let Some(tracked) = self.processes.tracked.get_mut(&pid) {
            tracked.info.runtimes.clear();
            // What its samples cost the agent was the old program's: the new one's
            // is measured afresh, its warm-up left out again.
            tracked.agent = Default::default();
        }
        if let Some(kernel) = self.kernel.as_deref_mut() {
            // Its own links were for the images of the program it was: the
            // new one is measured afresh, through the shared windows.
            if let Some(tracked) = self.processes.tracked.get_mut(&pid) {
                own_links::take_own_links(kernel, &self.images, pid, tracked);
            }
        }
        self.processes.set_readable(pid, true);
        let host = matches!(self.scope, Scope::Host { .. });
        // Its images are the new program's, known once it is examined:
        // until then its samples cannot be placed in a budget's windows.
        if let Some(tracked) = self.processes.tracked.get_mut(&pid).filter(|_| host) {
            tracked.images.clear();
            // Until they are known its probe state is not: no span across.
            tracked.pace.restart();
        }
        if host && self.kernel.is_some() && !self.chores.exec_queue.push(pid, Instant::now()) {
            self.stats.exec_queue_overflows += 1;
        }
        // A new program on a fully probed image traps on every call until
        // a check sees its cost: have one soon.
        if let Some(budget) = self.budget.as_mut().filter(|_| host) {
            budget.exec_seen(pid);
            self.wake_for_early_check();
        }
    }

    /// `pid` exited: its own links go, its entry departs (a later process with its pid
    /// is another), and the budget hears of it.
    pub(super) fn on_exit(&mut self, pid: u32) {
        self.stats.exit_events += 1;
        self.chores.maps_rescan.forget(pid);
        if let (Some(kernel), Some(tracked)) = (
            self.kernel.as_deref_mut(),
            self.processes.tracked.get_mut(&pid),
        ) {
            tracked.exited = true;
            own_links::take_own_links(kernel, &self.images, pid, tracked);
        }
        // Its entry departs: a later process with its pid is followed apart, and
        // resolves its stacks with nothing cached for this one. Its memory is gone:
        // what its runtime's last poll read is what it has. (A process never followed
        // has nothing cached.)
        if self.processes.exited(pid) {
            self.forget_process(pid, Departure::Exit);
        }
        if let Some(budget) = self.budget.as_mut() {
            budget.exit_seen(self.kernel.as_deref().map(|k| k as &dyn Gates), pid);
        }
    }
}
