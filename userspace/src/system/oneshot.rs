//! `allocbpf` without `--pid`: profile every process until a stop condition, then print
//! one report of all of them.

use std::time::Duration;

use anyhow::{Context, Result};
use tokio::signal::unix::{signal, SignalKind};

use super::{SystemOptions, SystemProfiler};
use crate::{report::Report, session::StopReason};

/// How often [`SystemProfiler::housekeeping`] runs.
pub const HOUSEKEEPING_TICK: Duration = Duration::from_millis(100);

/// Profiles every process until `duration` elapses or a signal arrives; returns the
/// merged report (an empty one, with a note, if nothing allocated) and why it stopped.
pub async fn run(
    options: SystemOptions,
    duration: Option<Duration>,
) -> Result<(Report, StopReason)> {
    let (rate, confidence, live) = (options.rate, options.confidence, options.live.is_some());
    let started = std::time::Instant::now();
    let mut profiler = SystemProfiler::start(options)?;
    eprintln!(
        "allocbpf: profiling every process through {} allocator image(s); Ctrl-C to stop",
        profiler.stats.images_attached
    );
    let mut sigterm = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    let mut tick = tokio::time::interval(HOUSEKEEPING_TICK);
    let deadline = duration.map(|d| tokio::time::Instant::now() + d);
    let stop = loop {
        tokio::select! {
            read = profiler.read() => {
                if let Err(error) = read {
                    tracing::error!("reading the ring buffer failed: {error}");
                    break StopReason::ReadError;
                }
            }
            _ = async { tokio::time::sleep_until(deadline.unwrap()).await }, if deadline.is_some() => {
                break StopReason::Duration;
            }
            _ = tokio::signal::ctrl_c() => break StopReason::Signal,
            _ = sigterm.recv() => break StopReason::Signal,
            _ = tick.tick() => profiler.housekeeping(),
        }
    };
    let stats = profiler.stats;
    let profiles = profiler.stop();
    eprintln!(
        "allocbpf: {} processes profiled, {} samples, {} exec events, {} images",
        profiles.len(),
        stats.samples,
        stats.exec_events,
        stats.images_attached
    );
    let report = Report::merge(profiles.into_iter().map(|p| p.report).collect())
        .unwrap_or_else(|| Report::empty(rate, confidence, started.elapsed(), live));
    Ok((report, stop))
}
