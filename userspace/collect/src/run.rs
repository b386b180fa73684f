//! One profiling run, end to end: start a [`Collector`], collect until a stop
//! condition, stop it and return one report. The same loop serves one process
//! ([`Scope::Process`]: it also stops when the target exits) and every process
//! ([`Scope::Host`]: one report of all of them).

use std::{
    os::fd::{FromRawFd, OwnedFd},
    time::Duration,
};

use allocbpf_common::LiveMode;
use allocbpf_profile::report::Report;
use tokio::{
    io::{unix::AsyncFd, Interest},
    signal::unix::{signal, SignalKind},
};

use crate::{
    engine::{window_wait, Collector, HOUSEKEEPING_TICK},
    error::CollectError,
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
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StopReason::Duration => "duration elapsed",
            StopReason::TargetExited => "target exited",
            StopReason::Signal => "interrupted",
            StopReason::ReadError => "ring buffer read failed",
        })
    }
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

/// Profiles `scope` until `duration` elapses, a signal arrives or (one process) the
/// target exits; returns the report and why it stopped. Every process: one report of
/// all of them (an empty one, with a note, if nothing allocated).
pub async fn run(
    options: CollectOptions,
    scope: Scope,
    duration: Option<Duration>,
) -> Result<(Report, StopReason), CollectError> {
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
    let mut collector = Collector::start(options, scope)?;
    announce(&collector, rate);
    let mut sigterm = signal(SignalKind::terminate()).map_err(wait_error("SIGTERM handler"))?;
    let mut tick = tokio::time::interval(HOUSEKEEPING_TICK);
    let deadline = duration.map(|d| tokio::time::Instant::now() + d);
    let stop = loop {
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
            _ = window_wait(window_at) => collector.windows_tick(),
        }
    };
    let stats = collector.stats;
    let silence = collector.target().map(|t| t.silence.to_string());
    let profiles = collector.stop();
    let report = match silence {
        // One process: its report, whatever it holds.
        Some(silence) => {
            let mut report = profiles
                .into_iter()
                .next()
                .map(|p| p.report)
                .unwrap_or_else(|| Report::empty(rate, confidence, started.elapsed(), live));
            if report.totals.exact_calls == 0 {
                report.note = Some(silence);
            }
            report
        }
        None => {
            eprintln!(
                "allocbpf: {} processes profiled, {} samples, {} exec events, {} images",
                profiles.len(),
                stats.samples,
                stats.exec_events,
                stats.images_attached
            );
            Report::merge(profiles.into_iter().map(|p| p.report).collect())
                .unwrap_or_else(|| Report::empty(rate, confidence, started.elapsed(), live))
        }
    };
    Ok((report, stop))
}

/// Says on stderr what is profiled, through what.
fn announce(collector: &Collector, rate: u64) {
    let Some(target) = collector.target() else {
        eprintln!(
            "allocbpf: profiling every process through {} allocator image(s); Ctrl-C to stop",
            collector.stats.images_attached
        );
        return;
    };
    eprintln!(
        "allocbpf: profiling pid {} ({}) through {}: {} probes, mean sampling interval {} bytes",
        target.pid,
        target.comm.to_string_lossy(),
        target
            .images
            .iter()
            .map(|image| image.describe())
            .collect::<Vec<_>>()
            .join("; "),
        target.probes,
        rate
    );
    for image in &target.images {
        image.log_probe_points();
    }
    if let Some(mode) = target.live_mode {
        let how = match mode {
            LiveMode::Session => "uprobe session links (only sampled calls pay for the return)",
            LiveMode::Uretprobe => "uretprobes on every allocation call (no session links)",
            LiveMode::Off => "no return probes (benchmark floor)",
        };
        eprintln!(
            "allocbpf: live tracking through {how}; {} deallocation entries probed",
            target.frees
        );
    }
}
