//! The per-process overhead budget: protecting production comes first.
//!
//! The kernel counts every probe hit per process (`PROCESS_GATES`). A start-up
//! calibration measures what one hit costs on this machine (the engine's `calibrate.rs`), so hits
//! per second become an estimated fraction of a CPU spent in allocbpf's probes. A
//! process over its budget is backed off in two steps:
//!
//! 1. **Pause**: its gate is closed in the kernel; its hits only count themselves (no
//!    sampling, no stack copy, no ring-buffer record). The trap into the kernel remains:
//!    a uprobe on a shared file cannot be removed from one process.
//! 2. **Detach**: if, while paused, the trap alone still costs more than
//!    `detach_fraction` of a CPU, the probes of the images that process uses are
//!    detached, for every process that maps them, until the back-off ends.
//!
//! Back-offs start at `backoff_initial` and double (up to `backoff_max`) each time the
//! same process is caught again within an hour; then the process is sampled again.

pub(crate) mod controller;

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

/// Budget settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BudgetOptions {
    /// Largest estimated fraction of one CPU a process may spend in sampled probes.
    pub cpu_fraction: f64,
    /// While paused, detach its images if the traps alone cost more than this.
    pub detach_fraction: f64,
    /// How often hits are read and checked.
    pub check_every: Duration,
    /// First back-off.
    pub backoff_initial: Duration,
    /// Longest back-off.
    pub backoff_max: Duration,
}

impl Default for BudgetOptions {
    fn default() -> Self {
        Self {
            cpu_fraction: 0.01,
            detach_fraction: 0.05,
            check_every: Duration::from_secs(1),
            backoff_initial: Duration::from_secs(10),
            backoff_max: Duration::from_secs(600),
        }
    }
}

/// What one probe hit costs, measured at start-up.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HitCost {
    /// A hit of a sampled (open) process at an emulated probe point: trap plus
    /// program, nanoseconds.
    pub sampled_ns: f64,
    /// A hit of a paused process: trap plus the gate lookup.
    pub paused_ns: f64,
    /// What a hit at a single-stepped instruction costs on top (the out-of-line step
    /// and its second trap), measured on an instruction of our own.
    pub stepped_extra_ns: f64,
}

/// Probe hits of one process, as the kernel counted them (running sums).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hits {
    /// Every hit.
    pub all: u64,
    /// Hits at single-stepped probe points (a subset of `all`).
    pub stepped: u64,
}

/// What the budget decided for one process.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum BudgetAction {
    /// Close its gate until the back-off ends.
    Pause {
        /// The process.
        pid: u32,
        /// Its estimated CPU fraction.
        fraction: f64,
        /// For how long.
        backoff: Duration,
    },
    /// Detach the images it uses until the back-off ends.
    DetachImages {
        /// The process.
        pid: u32,
        /// The traps' estimated CPU fraction while paused.
        fraction: f64,
        /// For how long.
        backoff: Duration,
    },
    /// The back-off ended: sample it again.
    Resume {
        /// The process.
        pid: u32,
    },
}

#[derive(Clone, Copy, Debug)]
struct BackedOff {
    until: Instant,
    backoff: Duration,
    detached: bool,
}

/// Budget state across checks.
#[derive(Debug)]
pub struct Budget {
    /// The settings.
    pub options: BudgetOptions,
    /// The measured cost of a hit.
    pub cost: HitCost,
    last_hits: HashMap<u32, Hits>,
    last_check: Option<Instant>,
    backed_off: HashMap<u32, BackedOff>,
    /// Last back-off per process and when it ended (for doubling).
    history: HashMap<u32, (Duration, Instant)>,
    /// Back-offs started so far.
    pub backoffs: u64,
    /// Image detachments started so far.
    pub detachments: u64,
}

impl Budget {
    /// A budget with a measured hit cost.
    pub fn new(options: BudgetOptions, cost: HitCost) -> Self {
        Self {
            options,
            cost,
            last_hits: HashMap::new(),
            last_check: None,
            backed_off: HashMap::new(),
            history: HashMap::new(),
            backoffs: 0,
            detachments: 0,
        }
    }

    /// True while `pid` is backed off.
    pub fn is_backed_off(&self, pid: u32) -> bool {
        self.backed_off.contains_key(&pid)
    }

    /// Processes currently backed off.
    pub fn paused(&self) -> usize {
        self.backed_off.len()
    }

    /// Checks cumulative hits per process at `now`; returns what to do.
    pub fn check(&mut self, hits: &HashMap<u32, Hits>, now: Instant) -> Vec<BudgetAction> {
        let mut actions = Vec::new();
        let elapsed = self
            .last_check
            .map(|t| now.saturating_duration_since(t).as_secs_f64())
            .unwrap_or(0.0);
        self.last_check = Some(now);
        for (&pid, &total) in hits {
            let previous = self.last_hits.insert(pid, total).unwrap_or(total);
            if elapsed <= 0.0 {
                continue;
            }
            let rate = total.all.saturating_sub(previous.all) as f64 / elapsed;
            // Each single-stepped hit costs its step on top: the cost of the probes
            // this process actually hits, not of glibc's malloc.
            let stepped = total.stepped.saturating_sub(previous.stepped) as f64 / elapsed;
            let extra = stepped * self.cost.stepped_extra_ns;
            match self.backed_off.get_mut(&pid) {
                None => {
                    let fraction = (rate * self.cost.sampled_ns + extra) * 1e-9;
                    if fraction > self.options.cpu_fraction {
                        let backoff = self.next_backoff(pid, now);
                        self.backed_off.insert(
                            pid,
                            BackedOff {
                                until: now + backoff,
                                backoff,
                                detached: false,
                            },
                        );
                        self.backoffs += 1;
                        actions.push(BudgetAction::Pause {
                            pid,
                            fraction,
                            backoff,
                        });
                    }
                }
                Some(state) if !state.detached => {
                    let fraction = (rate * self.cost.paused_ns + extra) * 1e-9;
                    if fraction > self.options.detach_fraction {
                        state.detached = true;
                        self.detachments += 1;
                        actions.push(BudgetAction::DetachImages {
                            pid,
                            fraction,
                            backoff: state.until.saturating_duration_since(now),
                        });
                    }
                }
                Some(_) => {}
            }
        }
        let ended: Vec<u32> = self
            .backed_off
            .iter()
            .filter(|(_, s)| s.until <= now)
            .map(|(&pid, _)| pid)
            .collect();
        for pid in ended {
            let state = self.backed_off.remove(&pid).expect("listed above");
            self.history.insert(pid, (state.backoff, now));
            actions.push(BudgetAction::Resume { pid });
        }
        // Forget processes no longer in the kernel's map (exited).
        self.last_hits.retain(|pid, _| hits.contains_key(pid));
        self.history
            .retain(|_, (_, ended)| now.saturating_duration_since(*ended) < HISTORY);
        actions
    }

    fn next_backoff(&self, pid: u32, now: Instant) -> Duration {
        match self.history.get(&pid) {
            Some((last, ended)) if now.saturating_duration_since(*ended) < HISTORY => {
                (*last * 2).min(self.options.backoff_max)
            }
            _ => self.options.backoff_initial,
        }
    }
}

/// A process caught again within this long after a back-off gets a doubled one.
const HISTORY: Duration = Duration::from_secs(3600);

/// How the engine starts its calibration child: this very executable (the single-step
/// figure puts a probe on its own [`calibration_step`]), with the arguments under which
/// it runs [`calibration_child`]. The binary that defines those arguments says which.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CalibrationChild {
    /// Arguments that run `calibration_child(false)`, the malloc/free loop.
    pub loop_args: Vec<String>,
    /// Arguments that run `calibration_child(true)`, the single-step loop.
    pub step_args: Vec<String>,
}

/// Iterations of the calibration loop (one malloc and one free each).
pub const CALIBRATION_ITERATIONS: u32 = 200_000;

/// The calibration workload, run in a child process ([`CalibrationChild`]): waits for
/// a line on stdin (so the parent can set its gate first), then times
/// [`CALIBRATION_ITERATIONS`] malloc/free pairs and prints nanoseconds per pair.
/// With `step`, it calls [`calibration_step`] instead (a tenth as many times: a
/// single-stepped probe costs ~14 us).
pub fn calibration_child(step: bool) -> std::io::Result<()> {
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    let iterations = if step {
        CALIBRATION_ITERATIONS / 10
    } else {
        CALIBRATION_ITERATIONS
    };
    let started = Instant::now();
    for i in 0..iterations {
        if step {
            std::hint::black_box(calibration_step(std::hint::black_box(u64::from(i))));
            continue;
        }
        // SAFETY: plain libc allocation, freed at once; black_box keeps the calls.
        unsafe {
            let p = libc::malloc(std::hint::black_box(64 + (i as usize & 63)));
            libc::free(std::hint::black_box(p));
        }
    }
    let ns = started.elapsed().as_nanos() as f64 / f64::from(iterations);
    println!("{ns}");
    Ok(())
}

/// A function whose first instruction (`nop`, +0) the kernel emulates and whose second
/// (`lea`, +1) it single-steps: the calibration probes each in turn to measure what a
/// single-stepped probe costs on this machine.
#[unsafe(naked)]
pub extern "C" fn calibration_step(x: u64) -> u64 {
    core::arch::naked_asm!("nop", "lea rax, [rdi + rdi * 2]", "ret")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hits(all: &[(u32, u64)]) -> HashMap<u32, Hits> {
        all.iter()
            .map(|&(pid, all)| (pid, Hits { all, stepped: 0 }))
            .collect()
    }

    #[test]
    fn single_stepped_hits_weigh_their_measured_cost() {
        let mut b = budget();
        let t0 = Instant::now();
        let sec = Duration::from_secs(1);
        let stepped = |all, stepped| HashMap::from([(9, Hits { all, stepped })]);
        assert!(b.check(&stepped(0, 0), t0).is_empty());
        // 1,000 hits/s at 1 us is 0.1% of a CPU; single-stepped, 14% of one.
        assert!(b.check(&stepped(1_000, 0), t0 + sec).is_empty());
        let actions = b.check(&stepped(2_000, 1_000), t0 + 2 * sec);
        assert!(
            matches!(actions[0], BudgetAction::Pause { pid: 9, fraction, .. } if (fraction - 0.014).abs() < 1e-9),
            "{actions:?}"
        );
    }

    fn budget() -> Budget {
        Budget::new(
            BudgetOptions::default(),
            HitCost {
                sampled_ns: 1000.0,
                paused_ns: 500.0,
                stepped_extra_ns: 13_000.0,
            },
        )
    }

    #[test]
    fn over_budget_pauses_then_detaches_then_resumes_with_doubling() {
        let mut b = budget();
        let t0 = Instant::now();
        let sec = Duration::from_secs(1);
        // 1% of a CPU at 1 us per hit is 10,000 hits/s.
        assert!(b.check(&hits(&[(7, 0), (8, 0)]), t0).is_empty());
        let actions = b.check(&hits(&[(7, 20_000), (8, 5_000)]), t0 + sec);
        assert_eq!(actions.len(), 1);
        assert!(
            matches!(actions[0], BudgetAction::Pause { pid: 7, backoff, .. } if backoff == Duration::from_secs(10))
        );
        // Paused, 200,000 hits/s x 0.5 us = 10% of a CPU in traps alone: detach.
        let actions = b.check(&hits(&[(7, 220_000), (8, 6_000)]), t0 + 2 * sec);
        assert!(matches!(
            actions[0],
            BudgetAction::DetachImages { pid: 7, .. }
        ));
        let actions = b.check(&hits(&[(7, 220_000)]), t0 + 12 * sec);
        assert_eq!(actions, vec![BudgetAction::Resume { pid: 7 }]);
        // Caught again: twice as long.
        let actions = b.check(&hits(&[(7, 400_000)]), t0 + 13 * sec);
        assert!(
            matches!(actions[0], BudgetAction::Pause { pid: 7, backoff, .. } if backoff == Duration::from_secs(20))
        );
        assert_eq!((b.backoffs, b.detachments, b.paused()), (2, 1, 1));
    }
}
