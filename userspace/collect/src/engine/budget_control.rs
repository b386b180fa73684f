//! The engine's part that applies the overhead budget ([`crate::budget`], the policy):
//! reads the kernel's probe hits, turns them into each process's cost, and plans every
//! image's duty ([`plan_duties`]) in its [`WindowSchedule`]; `window_moves.rs` moves
//! the probes in and out as the windows open and close.

use std::collections::HashMap;

use allocbpf_images::{image::ImageKey, procfs};
use allocbpf_probe::sampler::monotonic_now_ns;

mod process_readings;

pub(super) use self::process_readings::{program_of, read_pace};
use super::{process_table::THREADS_REREAD_NS, CollectorStats, ImageSet, ProcessTable, Tracked};
use crate::{
    budget::{
        agent_cost::next_coarsening,
        allowance::Allowances,
        early::EarlyChecks,
        plan_duties,
        programs::ProgramCosts,
        windows::{window_shift, Unplaced, WindowSchedule},
        BudgetOptions, HitCost, Hits, ProcessCost,
    },
    kernel::{Gates, Kernel},
};
use allocbpf_profile::estimate::windows::SampleWindow;

/// Exposure below this over a check says too little of a process's cost to update it.
const MIN_EXPOSURE_NS: u64 = 1_000_000;

/// An image is probed full time again at once when no process over its budget has
/// mapped it for this long: a build's next heavy step (`as` after `cc1`, the next
/// `cc1`) comes within it and finds the image still part time, while a job that comes
/// later is probed full time from its first call.
const QUIET_BEFORE_FULL_TIME_NS: u64 = 2_000_000_000;

/// A duty change smaller than this factor is not logged.
const LOGGED_CHANGE: f64 = 2.0;

/// What the budget knows of one process's cost.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ProcessCostFigures {
    /// Estimated fraction of a CPU it would spend in probes if probed full time.
    pub full_time_cpu: f64,
    /// Estimated fraction of a CPU it spent in probes over the last check.
    pub overhead_cpu: f64,
    /// Its pace while probed relative to unprobed over the current interval, when
    /// measured and large enough to correct for (docs/statistics.md, "Pace").
    pub pace: Option<f64>,
    /// `full_time_cpu` was measured (over at least `MIN_EXPOSURE_NS` probed): a
    /// process is given its own links only once it is known to be light.
    pub measured: bool,
    /// Estimated fraction of a CPU the agent spent on its samples over the last check,
    /// at their steady per-sample cost (`budget/agent_cost.rs`).
    pub agent_cpu: f64,
    /// What `agent_cpu` would be at its own sampling interval (smoothed).
    pub uncoarsened_agent_cpu: f64,
    /// Its sampling interval is raised `2^coarsening` times so that `agent_cpu` stays
    /// within its budget.
    pub coarsening: u32,
}

/// The budget with its clocks, cost estimates and window schedule.
pub(crate) struct BudgetController {
    /// The settings.
    pub options: BudgetOptions,
    /// The measured cost of a hit.
    pub cost: HitCost,
    /// The windows.
    pub schedule: WindowSchedule,
    /// The host budget in CPUs.
    host_cpu: f64,
    /// The host's CPUs.
    cpus: f64,
    last_check_ns: u64,
    /// Recent execs, and the early check they ask for.
    pub(super) early: EarlyChecks,
    last_hits: HashMap<u32, Hits>,
    last_attached: HashMap<ImageKey, u64>,
    /// Per image, when a process over its budget last mapped it.
    last_heavy_ns: HashMap<ImageKey, u64>,
    /// The share of periods with windows last logged.
    activation_logged: f64,
    /// Per process, its cost figures.
    pub costs: HashMap<u32, ProcessCostFigures>,
    /// Per program, the last cost measured of one of its processes.
    pub(super) programs: ProgramCosts,
    /// New processes' start-up allowances (`budget/allowance.rs`).
    pub(super) allowances: Allowances,
    /// Per image, the fraction of the last check it was probed and the cost of its
    /// heaviest process (full time), for metrics and logs.
    pub image_figures: HashMap<ImageKey, ImageFigures>,
}

/// What the budget knows of one image.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ImageFigures {
    /// Its planned duty now.
    pub duty: f64,
    /// Fraction of the last check its probes were in.
    pub attached_fraction: f64,
    /// Estimated CPU its processes spent in probes over the last check (each process
    /// counted under every image it maps).
    pub overhead_cpu: f64,
}

/// What a check knows of every process alike.
#[derive(Clone, Copy)]
struct Check<'a> {
    /// The images, with their schedules.
    images: &'a ImageSet,
    /// Each image's probed time since the last check.
    attached: &'a HashMap<ImageKey, u64>,
    /// Since the last check.
    elapsed_ns: u64,
    /// Now (CLOCK_MONOTONIC).
    now_ns: u64,
}

impl BudgetController {
    /// A controller for `options` with a measured hit `cost`, its periods counted from
    /// now; `one_process`: the host budget is that process's.
    pub fn new(options: BudgetOptions, cost: HitCost, one_process: bool) -> Self {
        let now_ns = monotonic_now_ns();
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let host_cpu = match one_process {
            true => options.process_cpu,
            false => options.host_share * cpus as f64,
        };
        Self {
            schedule: WindowSchedule::new(now_ns, options.period.as_nanos() as u64),
            cpus: cpus as f64,
            host_cpu,
            allowances: Allowances::new(&options, host_cpu, now_ns),
            options,
            cost,
            last_check_ns: now_ns,
            early: EarlyChecks::default(),
            last_hits: HashMap::new(),
            last_attached: HashMap::new(),
            last_heavy_ns: HashMap::new(),
            activation_logged: 1.0,
            costs: HashMap::new(),
            programs: ProgramCosts::default(),
            image_figures: HashMap::new(),
        }
    }

    /// The host budget in CPUs.
    pub fn host_cpu(&self) -> f64 {
        self.host_cpu
    }

    /// Places a sample of `tracked` taken at `t_ns`: taken full time through its own
    /// links, or in its window, with every image it maps that can be probed really
    /// probed then.
    pub fn place(
        &self,
        tracked: &Tracked,
        set: &ImageSet,
        t_ns: u64,
    ) -> Result<SampleWindow, Unplaced> {
        if tracked.own.covers(t_ns) {
            return Ok(SampleWindow {
                period: self.schedule.period_of(t_ns),
                inclusion: 1.0,
            });
        }
        let images = &tracked.images;
        let window = self.schedule.place(images, t_ns)?;
        if images.iter().all(|key| set.covered(key, t_ns)) {
            Ok(window)
        } else {
            Err(Unplaced::Unknown)
        }
    }

    /// `pid` exec'd now: its new program may be heavy, so a check comes early
    /// (`early.rs`).
    pub fn exec_seen(&mut self, pid: u32) {
        let now_ns = monotonic_now_ns();
        self.early.exec_seen(pid, now_ns);
        self.allowances.exec_seen(pid, now_ns);
    }

    /// `pid` exited now: what it spent in probes since the last check is charged to its
    /// allowance (a short job may live between two checks), which ends.
    pub fn exit_seen(&mut self, kernel: Option<&dyn Gates>, pid: u32) {
        if !self.allowances.covers(pid) {
            return;
        }
        let now_ns = monotonic_now_ns();
        let spent = kernel
            .and_then(|kernel| kernel.gate_hits_of(pid))
            .map_or(0.0, |gate| {
                let total = Hits::from(gate);
                let before = self.last_hits.insert(pid, total).unwrap_or_default();
                self.cost.seconds(&before, &total)
            });
        self.allowances.exited(pid, spent, now_ns);
    }

    /// True if the budget acts on `pid`: measured over its budget full time, and out of
    /// its start-up allowance, if it had one.
    pub(super) fn over_budget(&self, pid: u32) -> bool {
        !self.allowances.covers(pid)
            && self
                .costs
                .get(&pid)
                .is_some_and(|cost| cost.full_time_cpu > self.options.process_cpu)
    }

    /// When an early check may run (then call [`BudgetController::check`]), if one is
    /// asked for.
    pub fn early_check_ns(&self) -> Option<u64> {
        self.early.next_ns(self.last_check_ns)
    }

    /// If a check period has passed, or an early check is due: reads every process's
    /// hits, updates its cost, plans the duties and its observed time. True if it
    /// checked.
    pub fn check(
        &mut self,
        kernel: &mut dyn Kernel,
        processes: &mut ProcessTable,
        images: &ImageSet,
        stats: &mut CollectorStats,
    ) -> bool {
        let now_ns = monotonic_now_ns();
        let elapsed_ns = now_ns.saturating_sub(self.last_check_ns);
        let every_ns = self.options.check_every.as_nanos() as u64;
        if !self.early.check_due(now_ns, self.last_check_ns, every_ns) {
            return false;
        }
        self.last_check_ns = now_ns;
        self.early.checked(now_ns);
        let hits = match kernel.gate_hits() {
            Ok(hits) => hits,
            Err(error) => {
                tracing::warn!("probe hits unavailable: {error}");
                return false;
            }
        };
        let attached = self.attached_since_last_check(images, now_ns);
        let check = Check {
            images,
            attached: &attached,
            elapsed_ns,
            now_ns,
        };
        let mut new_hits = HashMap::new();
        for (pid, gate) in hits {
            let Some(tracked) = processes.tracked.get_mut(&pid) else {
                continue;
            };
            let total = Hits::from(gate);
            new_hits.insert(pid, total);
            // The coarsening in force is the gate's: a reused pid's gate may keep the
            // last process's, and an evicted one is back at none.
            self.costs.entry(pid).or_default().coarsening = gate.coarsening;
            self.measure(pid, tracked, total, &check);
            self.coarsen(kernel, pid, tracked);
        }
        self.last_hits = new_hits;
        self.costs.retain(|pid, _| self.last_hits.contains_key(pid));
        self.allowances.prune(now_ns, |pid| {
            (processes.tracked.get(&pid)).is_some_and(|t| t.admitted && !t.exited)
        });
        // Programs are known once their images are (the exec queue's look), hit or not.
        for (&pid, tracked) in &processes.tracked {
            if self.allowances.covers(pid) && !tracked.images.is_empty() {
                self.allowances.resolve(pid, &program_of(tracked), now_ns);
                if !self.allowances.covers(pid) {
                    tracing::debug!(
                        "pid {pid} ({:?}): no start-up allowance (its program had one lately)",
                        tracked.info.comm
                    );
                }
            }
        }
        self.plan(processes, images, &attached, elapsed_ns, now_ns);
        self.plan_activation(now_ns);
        stats.budget_windowed_images =
            self.image_figures.values().filter(|f| f.duty < 1.0).count() as u64;
        stats.budget_periods_with_windows_percent =
            (self.schedule.activation() * 100.0).round() as u64;
        self.assign_own_links(kernel, processes, images, stats, now_ns);
        true
    }

    /// The share of periods given windows: what keeps the agent's CPU for moving probes
    /// within its share (`BudgetOptions::window_moves_cpu`), at the moves' measured cost
    /// (`windows.rs`). Each move registers breakpoints in every process mapping the
    /// image, so on a host of hundreds of processes mapping libc, moves every period
    /// cost the agent more than all else it does.
    fn plan_activation(&mut self, now_ns: u64) {
        let allowed_ns = self.options.window_moves_cpu * self.schedule.period_ns() as f64;
        let share = self.schedule.affordable_activation(allowed_ns, now_ns);
        self.schedule.set_activation(share);
        let (now, logged) = (self.schedule.activation(), self.activation_logged);
        if (now - logged).abs() >= 0.05 && (now / logged - 1.0).abs() >= 0.25 {
            self.activation_logged = now;
            tracing::info!(
                "windows in {:.0}% of periods: moving probes in every period would cost {:.1} ms of CPU a period (allowed {:.1})",
                now * 100.0,
                self.schedule.moves_cpu_per_period(1.0, now_ns) * 1e-6,
                allowed_ns * 1e-6
            );
        }
    }

    /// Probed time per image since the last check, from the running totals.
    fn attached_since_last_check(
        &mut self,
        images: &ImageSet,
        now_ns: u64,
    ) -> HashMap<ImageKey, u64> {
        let totals: HashMap<ImageKey, u64> = images
            .images
            .iter()
            .map(|(key, state)| (*key, state.attached_ns(now_ns)))
            .collect();
        let attached: HashMap<ImageKey, u64> = totals
            .iter()
            .map(|(key, &total)| {
                let before = self.last_attached.get(key).copied().unwrap_or(0);
                (*key, total.saturating_sub(before))
            })
            .collect();
        self.last_attached = totals;
        attached
    }

    /// One process at a check: its pace, the share of the check it was observed, its
    /// spend (charged to its start-up allowance) and its cost full time, from its
    /// probe hits `total` (cumulative) and the images' probed time `attached`.
    fn measure(&mut self, pid: u32, tracked: &mut Tracked, total: Hits, check: &Check<'_>) {
        let Check {
            images,
            attached,
            elapsed_ns,
            now_ns,
        } = *check;
        let elapsed = elapsed_ns as f64 * 1e-9;
        if tracked.exited {
            // Its clock is gone, or about to be: a reused pid must not continue it.
            tracked.pace.restart();
        } else if tracked.admitted {
            read_pace(&self.cost, pid, tracked, total, images, None);
            // How many CPUs it could keep busy, for those whose pace may be
            // corrected (one small /proc read each, a few processes at a time).
            let heavy = tracked.pace.tally.trap_share().unwrap_or(0.0)
                >= allocbpf_profile::estimate::pace::MIN_TRAP_SHARE;
            // Once per tally (a new one starts with none), then now and again.
            let due = tracked.pace.tally.capacity <= 0.0
                || now_ns.saturating_sub(tracked.threads_read_ns) >= THREADS_REREAD_NS;
            if let Some(threads) = (heavy && due).then(|| procfs::thread_count(pid)).flatten() {
                tracked.threads_read_ns = now_ns;
                tracked
                    .pace
                    .tally
                    .saw_capacity(f64::from(threads).min(self.cpus));
            }
        }
        // Time accounting: what share of this check it was observed (expected).
        let inclusion = match tracked.own.since_ns {
            Some(_) => 1.0,
            None => self.schedule.inclusion_at(&tracked.images, now_ns),
        };
        tracked
            .observed
            .add(inclusion, elapsed_ns, self.schedule.period_of(now_ns));
        // A process new since the last check is measured from its first hit,
        // over the whole check, or since its exec if that came in the check at
        // least 25 ms ago (`early.rs`): its cost is underestimated at worst, and a
        // heavy one is caught at its first check.
        let before = self.last_hits.get(&pid).copied().unwrap_or_default();
        // The agent's own work on its samples, at a steady per-sample cost (a one-time
        // warm-up is not charged: `budget/agent_cost.rs`): bounded by coarsening, not
        // by windows (`coarsen`).
        let figures = self.costs.entry(pid).or_default();
        let (agent_samples, uncoarsened) = tracked.agent.check(elapsed, figures.coarsening);
        figures.agent_cpu = agent_samples / elapsed.max(1e-9);
        figures.uncoarsened_agent_cpu = uncoarsened;
        let spent = self.cost.seconds(&before, &total);
        let lived_ns = self.early.lived_ns(pid, now_ns, elapsed_ns);
        // Probed full time through its own links; else while its images were.
        let exposure_ns = match tracked.own.attached() {
            true => elapsed_ns,
            false => tracked
                .images
                .iter()
                .filter_map(|key| attached.get(key))
                .copied()
                .max()
                .unwrap_or(elapsed_ns),
        }
        .min(lived_ns);
        // Inside windows its samples were drawn denser than they would be full
        // time: their recording counts at the full-time density.
        let shift = match tracked.own.attached() {
            true => 0,
            false => window_shift(self.schedule.inclusion_at(&tracked.images, now_ns)),
        };
        let spent_full_time = self.cost.seconds_at_shift(&before, &total, shift);
        tracing::trace!(
            "pid {pid}: {} hits in {} us, probed {} us",
            total.all.saturating_sub(before.all),
            elapsed_ns / 1000,
            exposure_ns / 1000
        );
        if !tracked.exited && self.allowances.covers(pid) {
            self.allowances.charge(pid, spent, now_ns);
            if !self.allowances.covers(pid) {
                // Once per process that had an allowance (once per program per refill
                // of its bucket, but while the host's allowances are empty): an
                // operator's answer to "why is this job probed part time".
                tracing::info!(
                    "pid {pid} ({:?}): out of its start-up allowance (the host's allowances hold {:.2} CPU s)",
                    tracked.info.comm,
                    self.allowances.host_credit_s(now_ns)
                );
            }
        }
        let figures = self.costs.entry(pid).or_default();
        figures.overhead_cpu = spent / elapsed;
        if exposure_ns >= MIN_EXPOSURE_NS {
            figures.measured = true;
            let full = spent_full_time / (exposure_ns as f64 * 1e-9);
            // Up at once (a new heavy phase must be caught), down gently.
            figures.full_time_cpu = if full >= figures.full_time_cpu {
                full
            } else {
                0.5 * (figures.full_time_cpu + full)
            };
            self.programs
                .measured(program_of(tracked), figures.full_time_cpu, now_ns);
        }
    }

    /// Raises or lowers `pid`'s coarsening so that the agent's CPU for its samples
    /// stays within its budget (`budget/agent_cost.rs`). A start-up allowance does not
    /// spare it: that is for its probes, so that a short job is observed whole, and a
    /// coarser one still is.
    fn coarsen(&mut self, kernel: &mut dyn Kernel, pid: u32, tracked: &Tracked) {
        if tracked.exited || !tracked.admitted {
            return;
        }
        let Some(figures) = self.costs.get_mut(&pid) else {
            return;
        };
        let next = next_coarsening(
            figures.coarsening,
            figures.uncoarsened_agent_cpu,
            self.options.agent_cap(),
        );
        if next == figures.coarsening {
            return;
        }
        if let Err(error) = kernel.set_coarsening(pid, next) {
            tracing::warn!("pid {pid}: its sampling interval cannot be changed: {error}");
            return;
        }
        tracing::info!(
            "pid {pid} ({:?}): its samples would cost the agent ~{:.1}% of a CPU; sampling interval x{} (was x{})",
            tracked.info.comm,
            figures.uncoarsened_agent_cpu * 100.0,
            1u32 << next,
            1u32 << figures.coarsening
        );
        figures.coarsening = next;
    }

    /// Plans every image's duty from the costs of the processes the budget acts on (not
    /// exited, out of their allowance) and records it in the schedule: a decrease from
    /// full time at once, anything else from the first period whose phase is not drawn
    /// yet; an increase by at most a doubling per `recovery`, but back to full time at
    /// once when no process over its budget has mapped it for
    /// [`QUIET_BEFORE_FULL_TIME_NS`] (the heavy one exited: the next job on the host's
    /// libc must not be probed part time for its sake).
    fn plan(
        &mut self,
        processes: &ProcessTable,
        images: &ImageSet,
        attached: &HashMap<ImageKey, u64>,
        elapsed_ns: u64,
        now_ns: u64,
    ) {
        let costs: Vec<ProcessCost<'_, ImageKey>> = processes
            .tracked
            .iter()
            .filter(|(pid, tracked)| !tracked.exited && !self.allowances.covers(**pid))
            .filter_map(|(pid, tracked)| {
                let figures = self.costs.get(pid)?;
                Some(ProcessCost {
                    full_time_cpu: figures.full_time_cpu,
                    images: &tracked.images,
                })
            })
            .collect();
        // Probes are in a lead before each window, in the periods given windows.
        let lead_share = self.schedule.lead() as f64 * self.schedule.activation()
            / self.schedule.period_ns() as f64;
        let keys = images
            .images
            .iter()
            .filter(|(_, state)| !state.failed)
            .map(|(key, _)| (*key, lead_share));
        let targets = plan_duties(&self.options, self.host_cpu, &costs, keys);
        for cost in costs
            .iter()
            .filter(|c| c.full_time_cpu > self.options.process_cpu)
        {
            for key in cost.images {
                self.last_heavy_ns.insert(*key, now_ns);
            }
        }
        self.last_heavy_ns
            .retain(|key, _| targets.contains_key(key));
        let growth = 2f64.powf(elapsed_ns as f64 / self.options.recovery.as_nanos() as f64);
        let next_period_ns = self.schedule.next_undrawn_ns(now_ns);
        let mut figures = HashMap::new();
        for (key, target) in targets {
            let current = self.schedule.duty_at(&key, now_ns);
            let planned = self.schedule.duty_at(&key, next_period_ns);
            let new = if target < planned {
                let from = if current >= 1.0 {
                    now_ns
                } else {
                    next_period_ns
                };
                self.schedule.set_duty(key, from, target);
                target
            } else if target >= 1.0
                && planned < 1.0
                && self
                    .last_heavy_ns
                    .get(&key)
                    .is_none_or(|&at| now_ns.saturating_sub(at) >= QUIET_BEFORE_FULL_TIME_NS)
            {
                self.schedule.set_duty(key, now_ns, 1.0);
                1.0
            } else if target > planned {
                let raised = (planned * growth).min(target);
                self.schedule.set_duty(key, next_period_ns, raised);
                raised
            } else {
                planned
            };
            if new < planned / LOGGED_CHANGE || (new >= 1.0 && planned < 1.0) {
                self.log_change(&key, processes, images, new);
            }
            let overhead_cpu = processes
                .tracked
                .iter()
                .filter(|(_, t)| t.images.contains(&key))
                .filter_map(|(pid, _)| self.costs.get(pid))
                .map(|f| f.overhead_cpu)
                .sum();
            figures.insert(
                key,
                ImageFigures {
                    duty: new,
                    attached_fraction: attached.get(&key).copied().unwrap_or(0) as f64
                        / elapsed_ns.max(1) as f64,
                    overhead_cpu,
                },
            );
        }
        self.image_figures = figures;
    }

    fn log_change(&self, key: &ImageKey, processes: &ProcessTable, images: &ImageSet, duty: f64) {
        let path = images
            .images
            .get(key)
            .map(|s| s.image.path_in_target.display().to_string())
            .unwrap_or_default();
        if duty >= 1.0 {
            tracing::info!("{path:?} ({key}): probed full time again");
            return;
        }
        let heaviest = processes
            .tracked
            .iter()
            .filter(|(_, t)| t.images.contains(key))
            .filter_map(|(pid, t)| Some((*pid, &t.info.comm, self.costs.get(pid)?.full_time_cpu)))
            .max_by(|a, b| a.2.total_cmp(&b.2));
        let window_ms = duty * self.options.period.as_secs_f64() * 1e3;
        match heaviest {
            Some((pid, comm, cpu)) => tracing::info!(
                "{path:?} ({key}): probed {:.2}% of the time ({window_ms:.0} ms per {:.1}s period): pid {pid} ({comm:?}) would spend ~{:.0}% of a CPU in probes full time",
                duty * 100.0,
                self.options.period.as_secs_f64(),
                cpu * 100.0
            ),
            None => tracing::info!(
                "{path:?} ({key}): probed {:.2}% of the time (host budget)",
                duty * 100.0
            ),
        }
    }
}
