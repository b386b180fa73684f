//! Start-up allowances: a new process is probed full time until it has spent its
//! allowance (docs/design.md, "Start-up allowances"; docs/statistics.md, "Short and
//! bursty processes").
//!
//! A process of one period probed part time can only be given an unbounded interval:
//! with probability `1 - d` its bursts fall outside the window and nothing of them is
//! seen. So the budget does not act on a process that exec'd while the agent runs
//! until it has spent [`BudgetOptions::allowance`] of CPU in probes: the short jobs a
//! fleet is full of (a cron job, a script, a batch step) are observed from their first
//! allocation to their last. Two buckets keep that within the budget:
//!
//! - each program (executable and build id) has one of one allowance, refilled at the
//!   per-process budget, and a process gets its allowance only if its program's bucket
//!   is full and no other process of it has one: a program is observed whole one
//!   process at a time, at most once per `allowance / process_cpu` (a build's next
//!   `cc1` or `as` is budgeted from its first check), so allowances cost a program at
//!   most its per-process budget over time (what a process spends is charged at each
//!   check and at its exit);
//! - all allowances together draw on a host bucket of `host_cpu ×`
//!   [`HOST_HORIZON_S`] CPU seconds, refilled at `host_cpu` per second.

use std::collections::HashMap;

use super::{programs::ProgramKey, BudgetOptions};

/// The host bucket holds this many seconds of the host budget.
pub const HOST_HORIZON_S: f64 = 300.0;

/// Processes in their allowance, and programs remembered, at most; beyond, new
/// processes get none (they are budgeted as before).
const MAX_ENTRIES: usize = 4096;

/// A process in its allowance that the engine no longer follows as admitted and alive
/// (filtered out, exited with its exit event lost) is forgotten this long after its
/// exec; one whose program is never examined (unreadable, the exec queue full), ten
/// times as long.
const UNFOLLOWED_TTL_NS: u64 = 1_000_000_000;

/// A bucket of probe CPU seconds, refilled at a constant rate up to its capacity.
#[derive(Clone, Copy, Debug)]
struct Bucket {
    credit_s: f64,
    updated_ns: u64,
}

impl Bucket {
    fn full(capacity_s: f64, now_ns: u64) -> Self {
        Bucket {
            credit_s: capacity_s,
            updated_ns: now_ns,
        }
    }

    /// Brings the credit up to `now_ns` and returns it.
    fn refill(&mut self, capacity_s: f64, per_s: f64, now_ns: u64) -> f64 {
        let elapsed_s = now_ns.saturating_sub(self.updated_ns) as f64 * 1e-9;
        self.credit_s = (self.credit_s + elapsed_s * per_s).min(capacity_s);
        self.updated_ns = self.updated_ns.max(now_ns);
        self.credit_s
    }
}

/// One process in its allowance.
#[derive(Clone, Debug)]
struct Entry {
    /// Probe CPU seconds it has spent.
    spent_s: f64,
    /// Its program, once examined (its allowance then confirmed).
    program: Option<ProgramKey>,
    /// When it exec'd (CLOCK_MONOTONIC ns).
    since_ns: u64,
}

/// A program's bucket, and how many of its processes are in an allowance now.
#[derive(Clone, Copy, Debug)]
struct ProgramState {
    bucket: Bucket,
    active: u32,
}

/// The allowances of the processes that have one, the host's bucket and every
/// program's. See the module docs.
#[derive(Debug)]
pub struct Allowances {
    /// Probe CPU seconds one process may spend before the budget acts on it: also the
    /// capacity of a program's bucket.
    per_process_s: f64,
    /// What a program's bucket refills per second: the per-process budget.
    program_refill_per_s: f64,
    /// The host bucket's capacity and refill rate (CPU seconds, per second).
    host_capacity_s: f64,
    host_refill_per_s: f64,
    host: Bucket,
    processes: HashMap<u32, Entry>,
    programs: HashMap<ProgramKey, ProgramState>,
}

impl Allowances {
    /// Allowances of `options.allowance` each, programs refilled at
    /// `options.process_cpu`, and a full host bucket for a host budget of `host_cpu`
    /// CPUs, at `now_ns`.
    pub fn new(options: &BudgetOptions, host_cpu: f64, now_ns: u64) -> Self {
        Self {
            per_process_s: options.allowance.as_secs_f64(),
            program_refill_per_s: options.process_cpu,
            host_capacity_s: host_cpu * HOST_HORIZON_S,
            host_refill_per_s: host_cpu,
            host: Bucket::full(host_cpu * HOST_HORIZON_S, now_ns),
            processes: HashMap::new(),
            programs: HashMap::new(),
        }
    }

    /// `pid` exec'd at `now_ns`: it starts in an allowance, unless allowances are off
    /// or too many processes have one. Its program is checked once known
    /// ([`Allowances::resolve`]).
    pub fn exec_seen(&mut self, pid: u32, now_ns: u64) {
        self.end(pid);
        if self.per_process_s > 0.0 && self.processes.len() < MAX_ENTRIES {
            let entry = Entry {
                spent_s: 0.0,
                program: None,
                since_ns: now_ns,
            };
            self.processes.insert(pid, entry);
        }
    }

    /// True if `pid` is in its allowance: the budget does not act on it.
    pub fn covers(&self, pid: u32) -> bool {
        self.processes.contains_key(&pid)
    }

    /// Probe CPU seconds the host bucket holds at `now_ns`.
    pub fn host_credit_s(&mut self, now_ns: u64) -> f64 {
        self.host
            .refill(self.host_capacity_s, self.host_refill_per_s, now_ns)
    }

    /// `pid`, in its allowance, is known to run `program` (its new program examined)
    /// at `now_ns`. The allowance stands only if the program's bucket is full and no
    /// other process of it is in one: a program is observed whole one process at a
    /// time, at most once per refill. What it spent so far is taken from the bucket.
    pub fn resolve(&mut self, pid: u32, program: &ProgramKey, now_ns: u64) {
        let Some(spent_s) = self
            .processes
            .get(&pid)
            .filter(|entry| entry.program.is_none())
            .map(|entry| entry.spent_s)
        else {
            return;
        };
        let (capacity, per_s) = (self.per_process_s, self.program_refill_per_s);
        if !self.programs.contains_key(program) && self.programs.len() >= MAX_ENTRIES {
            // Full buckets hold nothing a new one would not: forgotten first.
            self.programs
                .retain(|_, state| state.bucket.refill(capacity, per_s, now_ns) < capacity);
        }
        let granted = match self.programs.get_mut(program) {
            Some(state) => {
                state.active == 0 && state.bucket.refill(capacity, per_s, now_ns) >= capacity
            }
            None => self.programs.len() < MAX_ENTRIES,
        };
        if !granted {
            self.processes.remove(&pid);
            return;
        }
        let state = self
            .programs
            .entry(program.clone())
            .or_insert(ProgramState {
                bucket: Bucket::full(capacity, now_ns),
                active: 0,
            });
        state.active += 1;
        state.bucket.credit_s -= spent_s;
        if let Some(entry) = self.processes.get_mut(&pid) {
            entry.program = Some(program.clone());
        }
    }

    /// `pid` spent `spent_s` CPU seconds in probes up to `now_ns`: charged to it, its
    /// program's bucket (once known) and the host's. Its allowance ends when it has
    /// spent it, or when the host bucket is empty.
    pub fn charge(&mut self, pid: u32, spent_s: f64, now_ns: u64) {
        let spent_s = spent_s.max(0.0);
        let host_credit = self.host_credit_s(now_ns);
        let Some(entry) = self.processes.get_mut(&pid) else {
            return;
        };
        entry.spent_s += spent_s;
        let spent = entry.spent_s;
        if let Some(state) = entry
            .program
            .as_ref()
            .and_then(|p| self.programs.get_mut(p))
        {
            state.bucket.credit_s -= spent_s;
        }
        self.host.credit_s = host_credit - spent_s;
        if spent >= self.per_process_s || self.host.credit_s <= 0.0 {
            self.end(pid);
        }
    }

    /// `pid` exited at `now_ns`, having spent `spent_s` since its last charge: charged,
    /// and its allowance ends.
    pub fn exited(&mut self, pid: u32, spent_s: f64, now_ns: u64) {
        self.charge(pid, spent_s, now_ns);
        self.end(pid);
    }

    /// Forgets at `now_ns` the processes in an allowance that `followed` says the
    /// engine no longer follows as admitted and alive, and those never examined, after
    /// their [`UNFOLLOWED_TTL_NS`].
    pub fn prune(&mut self, now_ns: u64, followed: impl Fn(u32) -> bool) {
        let stale: Vec<u32> = self
            .processes
            .iter()
            .filter(|(&pid, entry)| {
                let age = now_ns.saturating_sub(entry.since_ns);
                (age >= UNFOLLOWED_TTL_NS && !followed(pid))
                    || (age >= 10 * UNFOLLOWED_TTL_NS && entry.program.is_none())
            })
            .map(|(&pid, _)| pid)
            .collect();
        for pid in stale {
            self.end(pid);
        }
    }

    /// `pid`'s allowance ends (spent, exited, exec'd again or forgotten).
    fn end(&mut self, pid: u32) {
        let program = self.processes.remove(&pid).and_then(|entry| entry.program);
        if let Some(state) = program.and_then(|p| self.programs.get_mut(&p)) {
            state.active = state.active.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const S: u64 = 1_000_000_000;

    fn program(name: &str) -> ProgramKey {
        ProgramKey {
            exe: name.into(),
            build_id: String::new(),
        }
    }

    fn allowances(per_process_ms: u64, host_cpu: f64) -> Allowances {
        let options = BudgetOptions {
            allowance: Duration::from_millis(per_process_ms),
            ..BudgetOptions::default()
        };
        Allowances::new(&options, host_cpu, 0)
    }

    /// A program's first process gets an allowance; the next ones only once the
    /// program's bucket is full again, refilled at the per-process budget, and never
    /// two at once.
    #[test]
    fn a_program_gets_allowances_at_the_budgets_rate() {
        // 500 ms each, refilled at 1% of a CPU: full again 50 s after being spent.
        let mut a = allowances(500, 0.02);
        let (job, cc1) = (program("job"), program("cc1"));
        a.exec_seen(1, 0);
        a.charge(1, 0.1, S);
        assert!(a.covers(1), "not examined yet: in its allowance");
        a.resolve(1, &cc1, 2 * S);
        // A second cc1 while the first is in its allowance: none.
        a.exec_seen(2, 2 * S);
        a.resolve(2, &cc1, 2 * S);
        assert!(!a.covers(2));
        a.charge(1, 0.3, 2 * S);
        assert!(a.covers(1));
        a.charge(1, 0.2, 3 * S);
        assert!(!a.covers(1), "spent");
        // Another cc1 soon after: none.
        a.exec_seen(3, 4 * S);
        a.resolve(3, &cc1, 4 * S);
        assert!(!a.covers(3));
        // A job of another program: its own; what it spent at its exit is charged.
        a.exec_seen(4, 5 * S);
        a.resolve(4, &job, 5 * S);
        a.charge(4, 0.1, 5 * S);
        a.exited(4, 0.2, 6 * S);
        assert!(!a.covers(4));
        // The same job again 3 s later: its bucket is not full, so none.
        a.exec_seen(5, 9 * S);
        a.resolve(5, &job, 9 * S);
        assert!(!a.covers(5));
        // 30 s after the job (0.3 s back at 1%): full, an allowance again.
        a.exec_seen(6, 36 * S);
        a.resolve(6, &job, 36 * S);
        assert!(a.covers(6));
        // cc1 spent 0.6 s in all (0.1 before it was examined): full again 60 s on.
        a.exec_seen(7, 55 * S);
        a.resolve(7, &cc1, 55 * S);
        assert!(!a.covers(7));
        a.exec_seen(8, 64 * S);
        a.resolve(8, &cc1, 64 * S);
        assert!(a.covers(8));
    }

    /// Processes the engine no longer follows are forgotten after a second; never
    /// examined ones after ten.
    #[test]
    fn unfollowed_processes_leave_their_allowance() {
        let mut a = allowances(500, 0.02);
        a.exec_seen(1, 0);
        a.exec_seen(2, 0);
        a.exec_seen(3, 0);
        a.resolve(3, &program("x"), 0);
        a.prune(S / 2, |_| false);
        assert!(a.covers(1) && a.covers(2));
        a.prune(S, |pid| pid != 1);
        assert!(!a.covers(1) && a.covers(2) && a.covers(3));
        a.prune(10 * S, |_| true);
        assert!(!a.covers(2), "never examined");
        assert!(a.covers(3));
    }

    /// The host bucket bounds all allowances together, and refills at the host budget.
    #[test]
    fn the_host_bucket_bounds_every_allowance() {
        // 0.01 CPU: a bucket of 3 CPU seconds.
        let mut a = allowances(500, 0.01);
        for pid in 0..7 {
            a.exec_seen(pid, 0);
            a.resolve(pid, &program(&pid.to_string()), S);
            a.charge(pid, 0.45, S);
        }
        // 7 x 0.45 = 3.15 > 3: the seventh emptied it.
        assert!((0..6).all(|pid| a.covers(pid)));
        assert!(!a.covers(6));
        // 100 s later: 1 CPU second back.
        assert!((a.host_credit_s(101 * S) - 0.85).abs() < 1e-9);
        assert!((a.host_credit_s(10_000 * S) - 3.0).abs() < 1e-9);
    }

    /// Zero turns allowances off; processes in one are bounded in number.
    #[test]
    fn allowances_can_be_off_and_are_bounded() {
        let mut off = allowances(0, 0.02);
        off.exec_seen(1, 0);
        assert!(!off.covers(1));
        let mut a = allowances(500, 0.02);
        for pid in 0..(MAX_ENTRIES as u32 + 10) {
            a.exec_seen(pid, 0);
        }
        assert_eq!(a.processes.len(), MAX_ENTRIES);
    }
}
