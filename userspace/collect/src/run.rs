//! One profiling run, end to end: start a [`Collector`], collect until a stop
//! condition, stop it and return one report. The same loop serves one process
//! ([`Scope::Process`]: it also stops when the target exits) and every process
//! ([`Scope::Host`]: one report of all of them).
//!
//! It prints nothing: what a person is told (what is profiled through what, and at the
//! end how much) it hands to its caller, the binary, as a [`Started`] and a
//! [`Finished`].

use std::{
    os::fd::{FromRawFd, OwnedFd},
    time::Duration,
};

use allocbpf_common::LiveMode;
use allocbpf_images::procfs;
use allocbpf_profile::report::Report;
use tokio::{
    io::{unix::AsyncFd, Interest},
    signal::unix::{signal, SignalKind},
};

use crate::{
    engine::{window_wait, AttachedTarget, Collector, HOUSEKEEPING_TICK},
    error::CollectError,
    kernel::KernelLoader,
    options::{CollectOptions, Scope},
};

/// Why collection stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The requested duration elapsed.
    Duration,
    /// The target exited.
    TargetExited,
    /// Ctrl-C or SIGTERM.
    Signal,
    /// The ring buffer could not be read (logged); what was collected is kept.
    ReadError,
    /// The target exited while its probes were being attached: what the probes in
    /// by then collected is reported, and the binary says so (exit status 3).
    ExitedDuringAttach,
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StopReason::Duration => "duration elapsed",
            StopReason::TargetExited => "target exited",
            StopReason::Signal => "interrupted",
            StopReason::ReadError => "ring buffer read failed",
            StopReason::ExitedDuringAttach => "target exited before its probes were live",
        })
    }
}

/// What is profiled, through what: known once every probe is attached. A run says
/// [`Started::Process`] or [`Started::Host`], then [`Started::LiveTracking`] when it
/// tracks live blocks (its probe points are logged between the two).
pub enum Started<'a> {
    /// [`Scope::Process`]: the target as attached...
    Process {
        /// ...its pid, name, images and probes...
        target: &'a AttachedTarget,
        /// ...and the mean sampling interval, bytes.
        rate: u64,
    },
    /// [`Scope::Process`] with live tracking: how returns are observed...
    LiveTracking {
        /// ...through which mechanism...
        mode: LiveMode,
        /// ...and how many deallocation entries are probed.
        frees: usize,
    },
    /// [`Scope::Host`]: every process, through this many allocator images.
    Host {
        /// Images attached at start.
        images: u64,
    },
}

/// Where a run is, told about once a second while it goes on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Progress {
    /// Since collection started.
    pub elapsed: Duration,
    /// Samples aggregated so far.
    pub samples: u64,
    /// Samples lost so far (ring buffer full).
    pub drops: u64,
    /// The mean sampling interval in force now, bytes (raised under ring pressure).
    pub interval: u64,
    /// Processes followed now.
    pub processes: u64,
}

/// How often [`Progress`] is told.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// How a run ended.
#[derive(Debug)]
pub struct Finished {
    /// The report: one process's, or every process's merged.
    pub report: Report,
    /// Why it stopped.
    pub stop: StopReason,
    /// [`Scope::Host`]: what was seen over the run.
    pub host: Option<HostFigures>,
}

/// What a [`Scope::Host`] run saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostFigures {
    /// Processes with a profile.
    pub processes: usize,
    /// Samples handled.
    pub samples: u64,
    /// Exec events received.
    pub exec_events: u64,
    /// Allocator images attached at the end.
    pub images: u64,
}

/// Opens a pidfd, which becomes readable when the process exits. `None` if it is gone.
fn pidfd_open(pid: u32) -> Option<OwnedFd> {
    // SAFETY: plain syscall; a non-negative result is a new fd we own.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn wait_error<E: std::error::Error + Send + Sync + 'static>(
    what: &'static str,
) -> impl FnOnce(E) -> CollectError {
    move |source| CollectError::Wait {
        what,
        source: Box::new(source),
    }
}

/// Profiles `scope` through the kernel side `loader` loads until `duration` elapses, a
/// signal arrives or (one process) the target exits; tells `tell` what is profiled
/// once it is attached and `progress` where the run is every [`PROGRESS_EVERY`], and
/// returns the report and why it stopped. Every process: one report of all of them
/// (an empty one, with a note, if nothing allocated).
pub async fn run(
    loader: &dyn KernelLoader,
    options: CollectOptions,
    scope: Scope,
    duration: Option<Duration>,
    mut tell: impl FnMut(&Started<'_>),
    mut progress: impl FnMut(&Progress),
) -> Result<Finished, CollectError> {
    let (rate, confidence, live) = (options.rate, options.confidence, options.live.is_some());
    let started = std::time::Instant::now();
    // Watch for the target's exit before attaching, so an exit during attach is not
    // missed.
    let exit_fd = scope
        .pid()
        .and_then(pidfd_open)
        // SAFETY: the AsyncFd owns the OwnedFd, which keeps the fd open until dropped.
        .map(|fd| unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) })
        .transpose()
        .map_err(wait_error("pidfd"))?;
    let mut collector = Collector::start(loader, options, scope)?;
    // A target gone by the time every probe is in (an attach may have failed for it):
    // stop at once, keeping what the probes in by then saw.
    let exited_during_attach = collector
        .target()
        .is_some_and(|target| procfs::has_exited(target.pid));
    if !exited_during_attach {
        announce(&collector, rate, &mut tell);
    }
    let mut sigterm = signal(SignalKind::terminate()).map_err(wait_error("SIGTERM handler"))?;
    let mut tick = tokio::time::interval(HOUSEKEEPING_TICK);
    let mut progress_tick = tokio::time::interval(PROGRESS_EVERY);
    let deadline = duration.map(|d| tokio::time::Instant::now() + d);
    let stop = loop {
        if exited_during_attach {
            break StopReason::ExitedDuringAttach;
        }
        let window_at = collector.next_window_change();
        tokio::select! {
            read = collector.read() => {
                if let Err(error) = read {
                    // Stop, but keep and write what was collected.
                    tracing::error!("reading the ring buffer failed: {error}");
                    break StopReason::ReadError;
                }
            }
            _ = async { tokio::time::sleep_until(deadline.unwrap()).await }, if deadline.is_some() => {
                break StopReason::Duration;
            }
            _ = async { exit_fd.as_ref().unwrap().readable().await }, if exit_fd.is_some() => {
                break StopReason::TargetExited;
            }
            _ = tokio::signal::ctrl_c() => break StopReason::Signal,
            _ = sigterm.recv() => break StopReason::Signal,
            _ = tick.tick() => collector.housekeeping(),
            _ = progress_tick.tick() => {
                let drops = collector.counters().ring_buffer_drops;
                progress(&Progress {
                    elapsed: started.elapsed(),
                    samples: collector.stats.samples,
                    drops,
                    interval: rate << collector.stats.pressure_level.min(32),
                    processes: collector.processes_followed(),
                });
            }
            _ = window_wait(window_at) => collector.windows_tick(),
        }
    };
    let stats = collector.stats.clone();
    let silence = collector.target().map(|t| t.silence.to_string());
    let profiles = collector.stop();
    let mut host = None;
    let report = match silence {
        // One process: its report, whatever it holds (a silent one's note says why).
        Some(silence) => profiles
            .into_iter()
            .next()
            .map(|p| p.report)
            .unwrap_or_else(|| {
                Report::empty(rate, confidence, started.elapsed(), live, Some(silence))
            }),
        None => {
            host = Some(HostFigures {
                processes: profiles.len(),
                samples: stats.samples,
                exec_events: stats.exec_events,
                images: stats.images_attached,
            });
            Report::merge(profiles.into_iter().map(|p| p.report).collect())
                .unwrap_or_else(|| Report::empty(rate, confidence, started.elapsed(), live, None))
        }
    };
    Ok(Finished { report, stop, host })
}

/// Tells `started` what is profiled, through what, and logs every probe point.
fn announce(collector: &Collector, rate: u64, started: &mut impl FnMut(&Started<'_>)) {
    let Some(target) = collector.target() else {
        started(&Started::Host {
            images: collector.stats.images_attached,
        });
        return;
    };
    started(&Started::Process { target, rate });
    for image in &target.images {
        image.log_probe_points();
    }
    if let Some(mode) = target.live_mode {
        started(&Started::LiveTracking {
            mode,
            frees: target.frees,
        });
    }
}
