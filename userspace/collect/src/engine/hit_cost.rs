//! The engine's start-up measurement for the overhead budget: what one probe hit costs
//! on this machine, timed in a child process (the running executable, started with the
//! arguments of [`CalibrationChild`](crate::budget::CalibrationChild); its own code is
//! probed to time a single-stepped hit).

use std::{
    io::{BufRead, BufReader, Write},
    process::{Command, Stdio},
};

use super::Collector;
#[cfg(doc)]
use crate::options::Scope;
use crate::{
    budget::{calibration_step, HitCost},
    error::{error_chain, CollectError},
};
use allocbpf_common::GateState;
use allocbpf_profile::estimate::median;

type Result<T> = std::result::Result<T, CollectError>;

/// `context` for the calibration's steps: a failed step names itself.
trait Context<T> {
    fn context(self, what: &str) -> Result<T>;
}

impl<T, E: std::error::Error + Send + Sync + 'static> Context<T> for std::result::Result<T, E> {
    fn context(self, what: &str) -> Result<T> {
        self.map_err(|source| CollectError::Calibration {
            what: what.to_string(),
            source: Box::new(source),
        })
    }
}

impl<T> Context<T> for Option<T> {
    fn context(self, what: &str) -> Result<T> {
        self.ok_or_else(|| CollectError::Calibration {
            what: what.to_string(),
            source: "not found".into(),
        })
    }
}

impl Collector {
    /// Measures what a probe hit costs ([`Scope::Host`]): a child process times
    /// malloc/free pairs through the host's probes (its gate open), three times;
    /// `baseline` is the same loop timed before any probe was attached. Then what a
    /// single-stepped probe adds ([`Collector::stepped_extra_or_default`]). Medians, because this
    /// machine is noisy.
    pub(super) fn calibrate(&mut self, baseline: f64) -> Result<HitCost> {
        let hits_per_pair = if self.options.live.is_some() {
            2.0
        } else {
            1.0
        };
        let mut probed = Vec::new();
        for _ in 0..3 {
            probed.push(self.calibration_run(GateState::Open)?);
        }
        Ok(HitCost {
            hit_ns: ((median(&probed) - baseline) / hits_per_pair).max(1.0),
            stepped_extra_ns: self.stepped_extra_or_default(None),
        })
    }

    /// Measures what a probe hit costs ([`Scope::Process`], before the target's probes
    /// are in): the host's libc is not probed for other processes, so the child times
    /// its own step function bare and with the empty program on its emulated first
    /// instruction. The sampler's program costs a little more than the empty one
    /// (docs/benchmarks.md), which this leaves out.
    pub(super) fn calibrate_for_one_process(&mut self) -> Result<HitCost> {
        let mut bare = Vec::new();
        for _ in 0..3 {
            bare.push(self.child_run(true, GateState::Open, None)?);
        }
        // The emulated runs serve both figures: the hit, and the single step's extra.
        let emulated = self.step_runs(0)?;
        Ok(HitCost {
            hit_ns: (emulated - median(&bare)).max(1.0),
            stepped_extra_ns: self.stepped_extra_or_default(Some(emulated)),
        })
    }

    /// What a probe on a single-stepped instruction costs more than one on an emulated
    /// instruction, in nanoseconds per hit (`emulated`: the emulated runs' median, if
    /// already timed), or the figure measured on the development machines if it
    /// cannot be measured. The child calls [`calibration_step`] with an empty program
    /// on its emulated first instruction, then on its single-stepped second one.
    fn stepped_extra_or_default(&mut self, emulated: Option<f64>) -> f64 {
        let measured = emulated
            .map_or_else(|| self.step_runs(0), Ok)
            .and_then(|emulated| Ok((self.step_runs(1)? - emulated).max(0.0)));
        match measured {
            Ok(ns) => ns,
            Err(error) => {
                // The figure measured on the development machines (docs/benchmarks.md).
                tracing::warn!(
                    "single-step cost not measured ({}); assuming 14 us",
                    error_chain(&error)
                );
                14_000.0
            }
        }
    }

    /// The median of three runs of the child's step loop with the empty program at
    /// byte `at` of [`calibration_step`] (0: emulated, 1: single-stepped).
    fn step_runs(&mut self, at: u64) -> Result<f64> {
        let exe = std::env::current_exe().context("finding allocbpf's own executable")?;
        let offset = own_file_offset(calibration_step as *const () as usize as u64)
            .context("locating the calibration function in our executable")?;
        let mut runs = Vec::new();
        for _ in 0..3 {
            runs.push(self.child_run(true, GateState::Open, Some((&exe, offset + at)))?);
        }
        Ok(median(&runs))
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
        let calibration = &self.options.calibration;
        let mut command = Command::new(exe);
        command.args(match step {
            true => &calibration.step_args,
            false => &calibration.loop_args,
        });
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting the calibration child")?;
        let pid = child.id();
        self.processes.ignored.insert(pid);
        if self.scope.pid().is_none() {
            self.kernel().set_gate(pid, gate)?;
        }
        let link = match probe {
            Some((path, offset)) => Some(self.kernel().attach_empty_at(path, offset, pid)?),
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
            Ok((
                line,
                child.wait().context("waiting for the calibration child")?,
            ))
        };
        let result = run();
        if result.is_err() {
            // Never leave the child or its probe behind.
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(link) = link {
            self.kernel().detach(link);
        }
        // Nobody reads the ring buffer during start-up: empty it now, or the sampled
        // runs' records would crowd out every process's samples (they are ignored).
        self.drain_ring();
        self.processes.ignored.remove(&pid);
        let (line, status) = result?;
        let ns: f64 = line
            .trim()
            .parse()
            .context(&format!("calibration child printed {line:?} ({status})"))?;
        Ok(ns)
    }
}

/// The file offset, in our own executable, of the code at `address` in this process.
fn own_file_offset(address: u64) -> Option<u64> {
    allocbpf_images::procfs::own_mapping_at(address)
        .map(|entry| address - entry.range.start + entry.offset)
}
