//! Early budget checks for new programs.
//!
//! An image whose processes are all light is probed full time, so a heavy program that
//! starts on it (a compiler's cc1 on the host's libc) traps on every call until a
//! budget check sees its cost. Regular checks come every `check_every`, read at a
//! housekeeping tick: up to one and a half checks of full-time probing, which cost a
//! compile under a new agent several percent (docs/design.md, "Overhead budget"). So an
//! exec asks for a check [`EARLY_CHECK_AFTER`] later, and a process that exec'd within
//! a check is costed over the time since its exec, not over the whole check, which
//! would dilute a 25 ms-old process's cost up to eightfold.

use std::collections::{HashMap, VecDeque};

/// How long after an exec its early check comes: after the exec queue's first look at
/// the new program (20 ms), so that its images are known.
pub const EARLY_CHECK_AFTER_NS: u64 = 25_000_000;

/// Checks come at most this often, however many programs exec: each reads every
/// process's hits.
pub const MIN_CHECK_SPACING_NS: u64 = 25_000_000;

/// Exec times kept at most (a host exec'ing faster is costed over whole checks).
const MAX_NEWCOMERS: usize = 4096;

/// Exec times older than this are forgotten: their process never hit a probe while
/// they would have mattered.
const NEWCOMER_TTL_NS: u64 = 1_000_000_000;

/// Recent execs and the early check they ask for.
#[derive(Debug, Default)]
pub(crate) struct EarlyChecks {
    /// When each recently exec'd process exec'd (CLOCK_MONOTONIC, ns).
    exec_ns: HashMap<u32, u64>,
    /// When early checks are due, one per recent exec (bounded as `exec_ns`), in the
    /// order asked.
    due_ns: VecDeque<u64>,
}

impl EarlyChecks {
    /// `pid` exec'd at `now_ns`: an early check is due [`EARLY_CHECK_AFTER_NS`] later.
    pub fn exec_seen(&mut self, pid: u32, now_ns: u64) {
        if self.exec_ns.len() < MAX_NEWCOMERS || self.exec_ns.contains_key(&pid) {
            self.exec_ns.insert(pid, now_ns);
        }
        self.ask_at(now_ns + EARLY_CHECK_AFTER_NS);
    }

    /// A check is wanted at `at_ns` (bounded as the execs' early checks).
    pub fn ask_at(&mut self, at_ns: u64) {
        if self.due_ns.len() < MAX_NEWCOMERS {
            self.due_ns.push_back(at_ns);
        }
    }

    /// When the early check asked for may run, the last check having run at
    /// `last_ns`: when due, but no sooner than [`MIN_CHECK_SPACING_NS`] after the last.
    pub fn next_ns(&self, last_ns: u64) -> Option<u64> {
        let spaced = last_ns.saturating_add(MIN_CHECK_SPACING_NS);
        self.due_ns.iter().min().map(|&due| due.max(spaced))
    }

    /// Whether a check should run at `now_ns`, the last one having run at `last_ns`:
    /// a regular one every `every_ns`, or an early one no sooner than
    /// [`MIN_CHECK_SPACING_NS`] after the last.
    pub fn check_due(&self, now_ns: u64, last_ns: u64, every_ns: u64) -> bool {
        let since = now_ns.saturating_sub(last_ns);
        since >= every_ns
            || (self.due_ns.iter().any(|&due| due <= now_ns) && since >= MIN_CHECK_SPACING_NS)
    }

    /// A check ran at `now_ns`: it serves the early checks due by then. One due later
    /// stands: a regular check between an exec and its early check comes before the
    /// new program is examined, and cannot tell what it is.
    pub fn checked(&mut self, now_ns: u64) {
        self.due_ns.retain(|&due| due > now_ns);
        self.exec_ns
            .retain(|_, exec_ns| now_ns.saturating_sub(*exec_ns) < NEWCOMER_TTL_NS);
    }

    /// How long `pid` may have run its program in a check of `elapsed_ns` ending at
    /// `now_ns`: since its exec, if that came within the check (then forgotten) at
    /// least [`EARLY_CHECK_AFTER_NS`] ago. A younger program is costed over the whole
    /// check as before: a start-up burst of a few ms (a compiler driver's 364 calls
    /// in 3 ms) says little of what it will cost, and would lower its images' duty
    /// for everyone for the tens of seconds a duty takes to recover.
    pub fn lived_ns(&mut self, pid: u32, now_ns: u64, elapsed_ns: u64) -> u64 {
        match self.exec_ns.remove(&pid) {
            Some(exec_ns) if now_ns.saturating_sub(exec_ns) >= EARLY_CHECK_AFTER_NS => {
                now_ns.saturating_sub(exec_ns).min(elapsed_ns)
            }
            _ => elapsed_ns,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const EVERY: u64 = 200 * MS;

    /// An exec brings the next check forward to 25 ms after it, no sooner than 25 ms
    /// after the last check; the check serves it.
    #[test]
    fn an_exec_brings_a_check_forward() {
        let mut early = EarlyChecks::default();
        assert!(!early.check_due(100 * MS, 0, EVERY));
        early.exec_seen(7, 100 * MS);
        early.exec_seen(8, 110 * MS);
        assert_eq!(early.next_ns(0), Some(125 * MS));
        assert_eq!(early.next_ns(115 * MS), Some(140 * MS));
        assert!(!early.check_due(124 * MS, 0, EVERY));
        assert!(early.check_due(125 * MS, 0, EVERY));
        // A check 10 ms before: the early one waits for the spacing.
        assert!(!early.check_due(125 * MS, 115 * MS, EVERY));
        assert!(early.check_due(140 * MS, 115 * MS, EVERY));
        // A check before it is due does not serve it.
        early.checked(115 * MS);
        assert_eq!(early.next_ns(115 * MS), Some(140 * MS));
        early.checked(140 * MS);
        assert_eq!(early.next_ns(140 * MS), None);
        assert!(!early.check_due(170 * MS, 140 * MS, EVERY));
        assert!(early.check_due(340 * MS, 140 * MS, EVERY));
    }

    /// Two execs close together: a check at the first's due time leaves the second's.
    #[test]
    fn each_exec_gets_its_early_check() {
        let mut early = EarlyChecks::default();
        early.exec_seen(7, 100 * MS);
        early.exec_seen(8, 120 * MS);
        assert_eq!(early.next_ns(0), Some(125 * MS));
        early.checked(125 * MS);
        assert_eq!(early.next_ns(125 * MS), Some(150 * MS));
        early.checked(150 * MS);
        assert_eq!(early.next_ns(150 * MS), None);
    }

    /// A process that exec'd within the check, at least 25 ms before it, is costed
    /// since its exec, once; others and later checks over the whole check.
    #[test]
    fn a_newcomer_is_costed_since_its_exec() {
        let mut early = EarlyChecks::default();
        early.exec_seen(7, 100 * MS);
        assert_eq!(early.lived_ns(7, 125 * MS, 125 * MS), 25 * MS);
        assert_eq!(early.lived_ns(7, 325 * MS, 200 * MS), 200 * MS);
        assert_eq!(early.lived_ns(8, 125 * MS, 125 * MS), 125 * MS);
        // Younger than the early check: the whole check.
        early.exec_seen(10, 100 * MS);
        assert_eq!(early.lived_ns(10, 110 * MS, 150 * MS), 150 * MS);
        // An exec before the last check: the whole check.
        early.exec_seen(9, 100 * MS);
        assert_eq!(early.lived_ns(9, 400 * MS, 200 * MS), 200 * MS);
    }

    /// Exec times are bounded in number and in age.
    #[test]
    fn newcomers_are_bounded() {
        let mut early = EarlyChecks::default();
        for pid in 0..(MAX_NEWCOMERS as u32 + 10) {
            early.exec_seen(pid, 0);
        }
        assert_eq!(early.exec_ns.len(), MAX_NEWCOMERS);
        early.exec_seen(1, 500 * MS);
        early.checked(1_100 * MS);
        assert_eq!(early.exec_ns.len(), 1);
        assert_eq!(early.lived_ns(1, 1_100 * MS, 200 * MS), 200 * MS);
    }
}
