//! Processes that just exec'd, waiting for the dynamic loader to map their libraries
//! before they are examined.

use std::{
    collections::VecDeque,
    time::{Duration, Instant},
};

/// Exec events waiting at most (a burst of execs beyond it waits for the rescan).
const EXEC_QUEUE_LIMIT: usize = 4096;

/// When an exec'd process is looked at: soon, and again for slow loaders.
const EXEC_DELAYS: [Duration; 2] = [Duration::from_millis(20), Duration::from_millis(500)];

/// A bounded queue of (when due, pid, which delay).
#[derive(Default)]
pub(crate) struct ExecQueue {
    queue: VecDeque<(Instant, u32, usize)>,
}

impl ExecQueue {
    /// Queues `pid` for its first look; false if the queue is full.
    pub fn push(&mut self, pid: u32, now: Instant) -> bool {
        if self.queue.len() >= EXEC_QUEUE_LIMIT {
            return false;
        }
        self.queue.push_back((now + EXEC_DELAYS[0], pid, 0));
        true
    }

    /// The pids due at `now`, each queued again for its next look if it has one.
    pub fn due(&mut self, now: Instant) -> Vec<u32> {
        let mut due = Vec::new();
        while let Some(&(at, pid, step)) = self.queue.front() {
            if at > now {
                break;
            }
            self.queue.pop_front();
            due.push(pid);
            if let Some(delay) = EXEC_DELAYS.get(step + 1) {
                self.queue.push_back((now + *delay, pid, step + 1));
            }
        }
        due
    }
}
