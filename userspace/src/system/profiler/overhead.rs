//! The overhead budget's side of the profiler: start-up calibration of the cost of a
//! probe hit, and applying back-offs (gates, image detachments, re-attachments).

use std::{
    collections::HashMap,
    io::{BufRead, BufReader, Write},
    process::{Command, Stdio},
    time::Instant,
};

use allocbpf_common::GateState;
use anyhow::{Context, Result};

use super::{ImageKey, SystemProfiler};
use crate::system::budget::{calibration_step, BudgetAction, HitCost, Hits};

/// The median of calibration runs (an odd number of them).
pub(super) fn median(mut runs: Vec<f64>) -> f64 {
    runs.sort_by(f64::total_cmp);
    runs[runs.len() / 2]
}

impl SystemProfiler {
    pub(super) fn check_budget(&mut self, now: Instant) {
        let hits = match self.sampler().gate_hits() {
            Ok(hits) => hits,
            Err(error) => {
                tracing::warn!("probe hits unavailable: {error}");
                return;
            }
        };
        let hits: HashMap<u32, Hits> = hits
            .into_iter()
            .filter(|(pid, _)| !self.ignored.contains(pid))
            .map(|(pid, (all, stepped, _))| (pid, Hits { all, stepped }))
            .collect();
        let Some(budget) = self.budget.as_mut() else {
            return;
        };
        let actions = budget.check(&hits, now);
        self.stats.budget_backoffs = budget.backoffs;
        self.stats.budget_detachments = budget.detachments;
        self.stats.budget_paused = budget.paused() as u64;
        for action in actions {
            self.apply(action, now);
        }
    }

    fn apply(&mut self, action: BudgetAction, now: Instant) {
        let comm = |this: &Self, pid: u32| {
            this.processes
                .get(&pid)
                .map(|t| t.info.comm.clone())
                .unwrap_or_default()
        };
        match action {
            BudgetAction::Pause {
                pid,
                fraction,
                backoff,
            } => {
                tracing::warn!(
                    "pid {pid} ({}) is over its overhead budget: ~{:.1}% of a CPU in probes; sampling paused for {}s",
                    comm(self, pid),
                    fraction * 100.0,
                    backoff.as_secs()
                );
                let _ = self.sampler().set_gate(pid, GateState::Paused);
            }
            BudgetAction::DetachImages {
                pid,
                fraction,
                backoff,
            } => {
                let keys = self
                    .processes
                    .get(&pid)
                    .map(|t| t.images.clone())
                    .unwrap_or_default();
                tracing::warn!(
                    "pid {pid} ({}) still spends ~{:.1}% of a CPU in probe traps while paused: detaching {} image(s) it uses, for every process, for {}s",
                    comm(self, pid),
                    fraction * 100.0,
                    keys.len(),
                    backoff.as_secs()
                );
                for key in keys {
                    let links = self.images.get_mut(&key).and_then(|s| {
                        s.detached_until = Some(now + backoff);
                        s.links.take()
                    });
                    if let Some(links) = links {
                        self.sampler().detach(links);
                        self.stats.images_attached -= 1;
                    }
                }
            }
            BudgetAction::Resume { pid } => {
                let admitted = self.processes.get(&pid).is_some_and(|t| t.admitted);
                tracing::info!("pid {pid} ({}): back-off over", comm(self, pid));
                if admitted {
                    let _ = self.sampler().set_gate(pid, GateState::Open);
                }
            }
        }
    }

    pub(super) fn reattach_due(&mut self, now: Instant) {
        let due: Vec<ImageKey> = self
            .images
            .iter()
            .filter(|(_, s)| s.links.is_none() && s.detached_until.is_some_and(|t| t <= now))
            .map(|(k, _)| *k)
            .collect();
        for key in due {
            let image = self.images[&key].image.clone();
            let result = self.sampler().attach(&image);
            let state = self.images.get_mut(&key).expect("listed above");
            state.detached_until = None;
            match result {
                Ok(attached) => {
                    state.links = Some(attached.links);
                    self.stats.images_attached += 1;
                    tracing::info!("re-attached {}", image.path_in_target.display());
                }
                Err(error) => {
                    self.stats.attach_failures += 1;
                    tracing::warn!(
                        "cannot re-attach {}: {error}",
                        image.path_in_target.display()
                    );
                }
            }
        }
    }

    /// Measures what a probe hit costs: a child process times malloc/free pairs with
    /// its gate open (sampled) and paused, three times each; `baseline` is the same loop
    /// timed before any probe was attached. Then what a single-stepped probe adds: the
    /// child calls [`calibration_step`] with an empty program on its emulated first
    /// instruction, then on its single-stepped second one. Medians, because this
    /// machine is noisy.
    pub(super) fn calibrate(&mut self, baseline: f64) -> Result<HitCost> {
        let hits_per_pair = if self.options.live.is_some() {
            2.0
        } else {
            1.0
        };
        let mut sampled = Vec::new();
        let mut paused = Vec::new();
        for _ in 0..3 {
            sampled.push(self.calibration_run(GateState::Open)?);
            paused.push(self.calibration_run(GateState::Paused)?);
        }
        let per_hit = |ns: f64| ((ns - baseline) / hits_per_pair).max(1.0);
        let stepped_extra_ns = match self.stepped_extra() {
            Ok(ns) => ns,
            Err(error) => {
                // The figure measured on the development machines (docs/design.md).
                tracing::warn!("single-step cost not measured ({error:#}); assuming 14 us");
                14_000.0
            }
        };
        Ok(HitCost {
            sampled_ns: per_hit(median(sampled)),
            paused_ns: per_hit(median(paused)),
            stepped_extra_ns,
        })
    }

    /// What a probe on a single-stepped instruction costs more than one on an emulated
    /// instruction, in nanoseconds per hit.
    fn stepped_extra(&mut self) -> Result<f64> {
        let exe = std::env::current_exe().context("finding allocbpf's own executable")?;
        let offset = own_file_offset(calibration_step as *const () as usize as u64)
            .context("locating the calibration function in our executable")?;
        let mut emulated = Vec::new();
        let mut stepped = Vec::new();
        for _ in 0..3 {
            emulated.push(self.child_run(true, GateState::Open, Some((&exe, offset)))?);
            stepped.push(self.child_run(true, GateState::Open, Some((&exe, offset + 1)))?);
        }
        Ok((median(stepped) - median(emulated)).max(0.0))
    }

    pub(super) fn calibration_run(&mut self, gate: GateState) -> Result<f64> {
        self.child_run(false, gate, None)
    }

    /// Runs the calibration child (`step`: its single-step loop) with its gate set to
    /// `gate` and, if `probe` names a file offset, the empty program attached there for
    /// the child alone. Returns the child's nanoseconds per iteration.
    fn child_run(
        &mut self,
        step: bool,
        gate: GateState,
        probe: Option<(&std::path::Path, u64)>,
    ) -> Result<f64> {
        let exe = std::env::current_exe().context("finding allocbpf's own executable")?;
        let mut command = Command::new(exe);
        command.arg("__calibrate");
        if step {
            command.arg("--step");
        }
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting the calibration child")?;
        let pid = child.id();
        self.ignored.insert(pid);
        self.sampler().set_gate(pid, gate)?;
        let link = match probe {
            Some((path, offset)) => Some(self.sampler().attach_empty_at(path, offset, pid)?),
            None => None,
        };
        let mut run = || -> Result<(String, std::process::ExitStatus)> {
            child
                .stdin
                .take()
                .expect("piped")
                .write_all(b"go\n")
                .context("starting the calibration loop")?;
            let mut line = String::new();
            BufReader::new(child.stdout.take().expect("piped"))
                .read_line(&mut line)
                .context("reading the calibration result")?;
            Ok((line, child.wait()?))
        };
        let result = run();
        if result.is_err() {
            // Never leave the child or its probe behind.
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(link) = link {
            self.sampler().detach_empty(link);
        }
        // Nobody reads the ring buffer during start-up: empty it now, or the sampled
        // runs' records would crowd out every process's samples (they are ignored).
        self.drain_ring();
        self.ignored.remove(&pid);
        let (line, status) = result?;
        let ns: f64 = line
            .trim()
            .parse()
            .with_context(|| format!("calibration child printed {line:?} ({status})"))?;
        Ok(ns)
    }
}

/// The file offset, in our own executable, of the code at `address` in this process.
fn own_file_offset(address: u64) -> Option<u64> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    crate::procfs::parse_maps(&maps)
        .into_iter()
        .find(|entry| entry.range.contains(&address))
        .map(|entry| address - entry.range.start + entry.offset)
}
