//! Each process a runtime looked at, in one place: its runtime's own state, a retry
//! after a look that came too early (an interpreter still initialising, a JVM still
//! starting), or nothing to do; and one forget for every runtime.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use crate::{Departure, RuntimeMaps};

/// What is known of one process.
#[derive(Debug)]
pub enum Known<T> {
    /// One of this runtime's, read through `T`.
    Runtime(T),
    /// Looked at too early: looked at again after `next`.
    Retry {
        /// When it may be looked at again.
        next: Instant,
        /// Looks so far.
        attempts: u32,
    },
    /// Not this runtime's, or one it cannot read (the reason was said once).
    Other,
}

/// How often, and how many times, a process looked at too early is looked at again
/// before it is profiled without its runtime's frames for good.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// The wait between looks.
    pub every: Duration,
    /// Looks again at most.
    pub times: u32,
}

/// What a runtime knows of each process it looked at, and the kernel map (if any) it
/// writes an entry of for each one it profiles.
#[derive(Debug)]
pub struct ProcessStates<T> {
    states: HashMap<u32, Known<T>>,
    retry: RetryPolicy,
    map: Option<&'static str>,
}

impl<T> ProcessStates<T> {
    /// No process yet; `map`: the runtime's per-process kernel map, whose entry goes
    /// at [`ProcessStates::forget`].
    pub fn new(retry: RetryPolicy, map: Option<&'static str>) -> Self {
        Self {
            states: HashMap::new(),
            retry,
            map,
        }
    }

    /// The looks made at `pid` so far when it may be looked at (0: never seen; a
    /// retry's count), `None` when it is known for good (its runtime's or another's).
    pub fn attempts(&self, pid: u32) -> Option<u32> {
        match self.states.get(&pid) {
            None => Some(0),
            Some(Known::Retry { attempts, .. }) => Some(*attempts),
            Some(_) => None,
        }
    }

    /// Records a look at `pid` that came too early, after `attempts` before it: true
    /// when it will be looked at again, false (and it is [`Known::Other`] now) when it
    /// has had all its looks.
    pub fn retry_later(&mut self, pid: u32, attempts: u32, now: Instant) -> bool {
        if attempts >= self.retry.times {
            self.states.insert(pid, Known::Other);
            return false;
        }
        let next = now + self.retry.every;
        let attempts = attempts + 1;
        self.states.insert(pid, Known::Retry { next, attempts });
        true
    }

    /// `pid` is one of this runtime's, read through `state`.
    pub fn insert(&mut self, pid: u32, state: T) -> &mut T {
        self.states.insert(pid, Known::Runtime(state));
        match self.states.get_mut(&pid) {
            Some(Known::Runtime(state)) => state,
            _ => unreachable!("just inserted"),
        }
    }

    /// `pid` is not this runtime's, or cannot be read by it.
    pub fn set_other(&mut self, pid: u32) {
        self.states.insert(pid, Known::Other);
    }

    /// True when `pid` has any state (looked at before).
    pub fn knows(&self, pid: u32) -> bool {
        self.states.contains_key(&pid)
    }

    /// `pid`'s runtime state, if it is one of this runtime's.
    pub fn get(&self, pid: u32) -> Option<&T> {
        match self.states.get(&pid) {
            Some(Known::Runtime(state)) => Some(state),
            _ => None,
        }
    }

    /// `pid`'s runtime state, if it is one of this runtime's.
    pub fn get_mut(&mut self, pid: u32) -> Option<&mut T> {
        match self.states.get_mut(&pid) {
            Some(Known::Runtime(state)) => Some(state),
            _ => None,
        }
    }

    /// Every process of this runtime's, with its state.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (u32, &mut T)> {
        (self.states.iter_mut()).filter_map(|(&pid, known)| match known {
            Known::Runtime(state) => Some((pid, state)),
            _ => None,
        })
    }

    /// The state of every process of this runtime's.
    pub fn states(&self) -> impl Iterator<Item = &T> {
        (self.states.values()).filter_map(|known| match known {
            Known::Runtime(state) => Some(state),
            _ => None,
        })
    }

    /// The pids of this runtime's processes.
    pub fn pids(&self) -> Vec<u32> {
        (self.states.iter())
            .filter(|(_, known)| matches!(known, Known::Runtime(_)))
            .map(|(&pid, _)| pid)
            .collect()
    }

    /// True when no process is this runtime's.
    pub fn is_empty(&self) -> bool {
        !self
            .states
            .values()
            .any(|known| matches!(known, Known::Runtime(_)))
    }

    /// True when `pid` was looked at too early and its next look is due at `now`.
    pub fn look_again_due(&self, pid: u32, now: Instant) -> bool {
        matches!(self.states.get(&pid), Some(Known::Retry { next, .. }) if now >= *next)
    }

    /// Removes what is known of `pid`, returning its runtime state if it had one.
    pub fn remove(&mut self, pid: u32) -> Option<T> {
        match self.states.remove(&pid)? {
            Known::Runtime(state) => Some(state),
            _ => None,
        }
    }

    /// Forgets `pid` as every runtime does: its state goes, and its kernel map entry
    /// at an exec or a pid's reuse (whatever is known here: the process may have been
    /// forgotten at its main thread's exit while a thread that outlived it exec'd).
    /// After an exit, threads that outlive the main thread keep the entry until the
    /// cut releases the pid's kernel entries.
    pub fn forget(&mut self, pid: u32, why: Departure, maps: &mut dyn RuntimeMaps) {
        self.states.remove(&pid);
        if let Some(map) = self.map {
            if matches!(why, Departure::Exec | Departure::Reused) {
                maps.forget_entry(map, pid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RuntimeMapError;

    #[derive(Default)]
    struct Recorded(Vec<(&'static str, u32)>);

    impl RuntimeMaps for Recorded {
        fn set_entry(&mut self, _: &'static str, _: u32, _: &[u8]) -> Result<(), RuntimeMapError> {
            Ok(())
        }

        fn forget_entry(&mut self, map: &'static str, pid: u32) {
            self.0.push((map, pid));
        }
    }

    const POLICY: RetryPolicy = RetryPolicy {
        every: Duration::from_millis(500),
        times: 2,
    };

    #[test]
    fn a_process_looked_at_too_early_is_looked_at_again_a_bounded_number_of_times() {
        let mut states: ProcessStates<()> = ProcessStates::new(POLICY, None);
        let now = Instant::now();
        assert_eq!(states.attempts(1), Some(0));
        assert!(states.retry_later(1, 0, now));
        assert!(!states.look_again_due(1, now));
        assert!(states.look_again_due(1, now + POLICY.every));
        assert_eq!(states.attempts(1), Some(1));
        assert!(states.retry_later(1, 1, now));
        assert!(!states.retry_later(1, 2, now), "out of looks");
        assert_eq!(
            states.attempts(1),
            None,
            "known for good: not this runtime's"
        );
        assert!(!states.look_again_due(1, now + POLICY.every * 10));
    }

    #[test]
    fn forget_drops_the_kernel_entry_only_when_the_program_changed() {
        let mut states = ProcessStates::new(POLICY, Some("MAP"));
        let mut maps = Recorded::default();
        *states.insert(7, 1u8) += 1;
        assert_eq!(states.get(7), Some(&2));
        states.forget(7, Departure::Exit, &mut maps);
        assert!(maps.0.is_empty() && !states.knows(7));
        for why in [Departure::Exec, Departure::Reused] {
            states.insert(7, 1);
            states.forget(7, why, &mut maps);
        }
        states.forget(8, Departure::Released, &mut maps);
        assert_eq!(maps.0, vec![("MAP", 7), ("MAP", 7)]);
    }
}
