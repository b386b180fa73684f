//! The overhead budget: probing costs at most what the operator allows, and never
//! stops seeing a process (docs/design.md, "Overhead budget").
//!
//! The kernel counts every probe hit per process (`PROCESS_GATES`). A start-up
//! calibration measures what one hit costs on this machine (the engine's
//! `hit_cost.rs`), so hits per second of probed time become the CPU fraction a process
//! would spend in probes were it probed full time. An image then gets a *duty*: the
//! fraction of time its probes are in, low enough that no process mapping it exceeds
//! the per-process budget and all together stay within the host's
//! ([`plan_duties`]). Images are probed in randomly placed windows of that duty
//! ([`windows`]); samples are weighed up by the inverse of their inclusion probability,
//! so estimates stay unbiased for the whole interval.
//!
//! A uprobe on a shared file cannot be removed from one process only: the kernel's
//! per-process filter can select processes but not exclude one. So the duty of a shared
//! image (libc) is the smallest its heaviest process needs, and every process mapping
//! it is observed that fraction of the time, which the estimates account for, unless it
//! is light (it gets probes of its own, filtered on its pid) or new (a process exec'd
//! under the agent is probed full time until it has spent its start-up allowance:
//! [`allowance`]).

pub mod agent_cost;
pub mod allowance;
mod calibration;
pub(crate) mod early;
pub mod pace;
pub mod programs;
pub mod windows;

use std::{collections::HashMap, hash::Hash, time::Duration};

pub use self::calibration::{
    calibration_child, calibration_step, CalibrationChild, CALIBRATION_ITERATIONS,
};

/// Budget settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BudgetOptions {
    /// Largest estimated fraction of one CPU a process may spend in probes.
    pub process_cpu: f64,
    /// Largest fraction of one CPU the agent may spend on one process's samples (none:
    /// `process_cpu`); past it, the process's sampling interval is raised
    /// (`agent_cost.rs`).
    pub agent_cpu: Option<f64>,
    /// Largest estimated fraction of the host's CPUs all processes together may spend.
    pub host_share: f64,
    /// Largest fraction of one CPU the agent may spend moving windowed images' probes in
    /// and out (each move registers breakpoints in every process mapping the image);
    /// past it, windows come in a share of the periods only (`windows.rs`).
    pub window_moves_cpu: f64,
    /// Period of the observation windows: one window per image per period.
    pub period: Duration,
    /// Shortest window: the budget is overrun rather than observe less than this per
    /// period (shorter windows would cost more to attach than they save).
    pub min_window: Duration,
    /// How often hits are read and duties planned.
    pub check_every: Duration,
    /// Time for a lowered duty to double back up towards a higher one its processes
    /// allow. An image none of whose processes is over its budget any more (the heavy
    /// one exited) is probed full time again at once.
    pub recovery: Duration,
    /// Probe CPU time a process that exec'd while the agent runs may spend before the
    /// budget acts on it ([`allowance`]); zero: none.
    pub allowance: Duration,
}

impl Default for BudgetOptions {
    fn default() -> Self {
        Self {
            process_cpu: 0.01,
            agent_cpu: None,
            host_share: 0.01,
            window_moves_cpu: 0.005,
            period: Duration::from_secs(1),
            min_window: Duration::from_millis(10),
            check_every: Duration::from_millis(200),
            recovery: Duration::from_secs(10),
            allowance: Duration::from_millis(500),
        }
    }
}

impl BudgetOptions {
    /// The fraction of one CPU the agent may spend on one process's samples.
    pub fn agent_cap(&self) -> f64 {
        self.agent_cpu.unwrap_or(self.process_cpu)
    }

    /// The smallest duty: one shortest window per period.
    pub fn min_duty(&self) -> f64 {
        (self.min_window.as_secs_f64() / self.period.as_secs_f64()).min(1.0)
    }
}

/// What one probe hit costs, measured at start-up.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HitCost {
    /// A hit at an emulated probe point: trap plus program, nanoseconds.
    pub hit_ns: f64,
    /// What a hit at a single-stepped instruction costs on top (the out-of-line step
    /// and its second trap), measured on an instruction of our own.
    pub stepped_extra_ns: f64,
}

impl HitCost {
    /// CPU seconds spent by the hits counted from `before` to `after` (running sums of
    /// one process): each hit at its calibrated cost, the single-step extra for the
    /// stepped ones, and the recording time of its samples as measured in the kernel.
    pub fn seconds(&self, before: &Hits, after: &Hits) -> f64 {
        self.seconds_at_shift(before, after, 0)
    }

    /// [`HitCost::seconds`] had the samples been drawn `2^shift` times sparser: what
    /// hits taken inside windows of shift `shift` (samples drawn that much denser,
    /// `windows::window_shift`) would have cost probed full time. Exact while the
    /// denser sampling probability stays under 1; above, it errs low.
    pub fn seconds_at_shift(&self, before: &Hits, after: &Hits, shift: u8) -> f64 {
        let hits = after.all.saturating_sub(before.all) as f64;
        let stepped = after.stepped.saturating_sub(before.stepped) as f64;
        let recording = after.sample_ns.saturating_sub(before.sample_ns) as f64;
        let recording = recording / f64::from(1u32 << shift.min(31));
        (hits * self.hit_ns + stepped * self.stepped_extra_ns + recording) * 1e-9
    }
}

/// Probe hits of one process, as the kernel counted them (running sums).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hits {
    /// Every hit.
    pub all: u64,
    /// Hits at single-stepped probe points (a subset of `all`).
    pub stepped: u64,
    /// Nanoseconds its sampled hits spent recording their samples (stack copy, ring
    /// buffer), timed in the kernel: the calibrated hit, almost never sampled, leaves
    /// them out.
    pub sample_ns: u64,
}

impl From<allocbpf_common::ProcessGate> for Hits {
    fn from(gate: allocbpf_common::ProcessGate) -> Self {
        Hits {
            all: gate.hits,
            stepped: gate.stepped_hits,
            sample_ns: gate.sample_ns,
        }
    }
}

/// One process's figures for [`plan_duties`].
#[derive(Clone, Copy, Debug)]
pub struct ProcessCost<'a, K> {
    /// Estimated fraction of a CPU it would spend in probes if probed full time.
    pub full_time_cpu: f64,
    /// The allocator images it maps.
    pub images: &'a [K],
}

/// The duty of every image in `images`: the largest that keeps each process within
/// `process_cpu` (a process over it lowers every image it maps to `process_cpu / cost`,
/// less the image's `lead`, the share of a period its probes are in before each window)
/// and all processes together within `host_cpu` CPUs (every duty scaled by the same
/// factor), but not under `min_duty`: one window per period is the floor, so a process
/// costing more than `process_cpu / (min_duty + lead)` full time overruns its budget
/// rather than go unseen (docs/design.md, "Overhead budget").
pub fn plan_duties<K: Copy + Eq + Hash>(
    options: &BudgetOptions,
    host_cpu: f64,
    processes: &[ProcessCost<'_, K>],
    images: impl IntoIterator<Item = (K, f64)>,
) -> HashMap<K, f64> {
    let leads: HashMap<K, f64> = images.into_iter().collect();
    let mut duties: HashMap<K, f64> = leads.keys().map(|&key| (key, 1.0)).collect();
    for process in processes {
        if process.full_time_cpu <= options.process_cpu {
            continue;
        }
        let share = options.process_cpu / process.full_time_cpu;
        for key in process.images {
            if let Some(d) = duties.get_mut(key) {
                *d = d.min(share - leads[key]);
            }
        }
    }
    // A process is probed while any image it maps is: its cost follows the largest.
    let exposure = |process: &ProcessCost<'_, K>, duties: &HashMap<K, f64>| {
        process
            .images
            .iter()
            .filter_map(|key| {
                let duty = duties.get(key)?.max(0.0);
                Some(if duty < 1.0 { duty + leads[key] } else { 1.0 })
            })
            .fold(0.0f64, f64::max)
    };
    let total: f64 = processes
        .iter()
        .map(|p| p.full_time_cpu * exposure(p, &duties))
        .sum();
    if total > host_cpu && total > 0.0 {
        let scale = host_cpu / total;
        for duty in duties.values_mut() {
            *duty *= scale;
        }
    }
    let floor = options.min_duty();
    for duty in duties.values_mut() {
        *duty = duty.max(floor);
    }
    duties
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHARED: u32 = 1;
    const PRIVATE: u32 = 2;
    const OTHER: u32 = 3;

    /// A compiler at 80% of a CPU full time on a shared libc sets libc's duty to 1.25%;
    /// an image it does not map keeps its full time; the light process does not lower
    /// anything.
    #[test]
    fn the_heaviest_process_sets_its_images_duty() {
        let options = BudgetOptions::default();
        let heavy = [SHARED, PRIVATE];
        let light = [SHARED, OTHER];
        let duties = plan_duties(
            &options,
            1.0,
            &[
                ProcessCost {
                    full_time_cpu: 0.8,
                    images: &heavy,
                },
                ProcessCost {
                    full_time_cpu: 0.001,
                    images: &light,
                },
            ],
            [(SHARED, 0.002), (PRIVATE, 0.0), (OTHER, 0.0)],
        );
        // Less the shared image's lead: 2 ms of every 1 s period.
        assert!((duties[&SHARED] - 0.0105).abs() < 1e-12);
        assert!((duties[&PRIVATE] - 0.0125).abs() < 1e-12);
        assert_eq!(duties[&OTHER], 1.0);
    }

    /// Many processes each under the per-process budget but together over the host's:
    /// every duty is scaled by the same factor, then floored.
    #[test]
    fn the_host_budget_scales_every_duty() {
        let options = BudgetOptions::default();
        let images = [SHARED];
        let processes: Vec<ProcessCost<'_, u32>> = (0..10)
            .map(|_| ProcessCost {
                full_time_cpu: 0.008,
                images: &images,
            })
            .collect();
        // 10 x 0.8% = 8% of a CPU against a host budget of 2%: a quarter of the time.
        let duties = plan_duties(&options, 0.02, &processes, [(SHARED, 0.0)]);
        assert!((duties[&SHARED] - 0.25).abs() < 1e-12);
        // Impossible budgets stop at the shortest window.
        let duties = plan_duties(&options, 1e-9, &processes, [(SHARED, 0.0)]);
        assert_eq!(duties[&SHARED], options.min_duty());
    }

    #[test]
    fn hit_costs_add_the_single_step() {
        let cost = HitCost {
            hit_ns: 500.0,
            stepped_extra_ns: 13_500.0,
        };
        let before = Hits {
            all: 10,
            stepped: 1,
            sample_ns: 5_000,
        };
        let after = Hits {
            all: 1_010,
            stepped: 101,
            sample_ns: 25_000,
        };
        let expected = 500e-6 + 1.35e-3 + 20e-6;
        assert!((cost.seconds(&before, &after) - expected).abs() < 1e-12);
    }
}
