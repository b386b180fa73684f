//! One profiling session of one process: attach, collect until a stop condition,
//! detach, and build the report.
//!
//! Data flow: probe → ring buffer ([`events`]) → [`normalize`] on receipt →
//! [`aggregate`] → (at the end) [`symbolize`] → [`report`] → [`export`].
//!
//! [`events`]: crate::events
//! [`normalize`]: crate::normalize
//! [`aggregate`]: crate::aggregate
//! [`symbolize`]: crate::symbolize
//! [`report`]: crate::report
//! [`export`]: crate::export

use std::{
    os::fd::{FromRawFd, OwnedFd},
    path::PathBuf,
    time::{Duration, Instant},
};

use allocbpf_common::LiveMode;
use anyhow::{Context, Result};
use tokio::{
    io::{unix::AsyncFd, Interest},
    signal::unix::{signal, SignalKind},
};

use crate::{
    aggregate::{Aggregate, StackKey},
    estimate::{interval_table::REFRESH_INTERVAL, Confidence},
    events::{Event, EventReader, RawSample},
    export::raw_samples::RawSampleLog,
    probe::{LiveMechanism, Sampler, SamplerConfig, ThreadTables, COLLECT_EXITED_EVERY},
    report::{KernelFigures, Report},
    stacks::{StackResolver, UnwindMode},
    symbolize::FrameSymbolizer,
    target::Target,
};

/// What to profile and how.
#[derive(Clone, Debug)]
pub struct SessionOptions {
    /// Target process.
    pub pid: u32,
    /// Mean sampling interval in bytes.
    pub rate: u64,
    /// Stop after this long.
    pub duration: Option<Duration>,
    /// Attach the empty program (benchmark floor).
    pub empty_probes: bool,
    /// Track sampled blocks until freed (`--live`, `--leaks`).
    pub live: Option<LiveOptions>,
    /// How user stacks are unwound.
    pub unwind: UnwindMode,
    /// Symbolize frames (false: `--no-symbolize`).
    pub symbolize: bool,
    /// Bytes of user stack copied per sample (auto/dwarf).
    pub stack_bytes: u32,
    /// Level of the confidence intervals in the report.
    pub confidence: Confidence,
    /// Where to write every raw sample as a JSON line, if anywhere.
    pub raw_samples: Option<PathBuf>,
    /// Thread table sizes.
    pub thread_tables: ThreadTables,
    /// `--allocator-symbol` prefixes (`je_`): also probe files defining `PREFIXmalloc`.
    pub allocator_prefixes: Vec<String>,
}

impl SessionOptions {
    /// What discovery looks for, and whether stacks unwind through unprobed frames.
    pub fn lookup(&self) -> crate::image::Lookup {
        crate::image::Lookup {
            prefixes: self.allocator_prefixes.clone(),
            unwind_tables: self.unwind != UnwindMode::Fp,
        }
    }
}

/// `--live` and `--leaks`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveOptions {
    /// How returns are observed.
    pub mechanism: LiveMechanism,
    /// With `--leaks`: report live blocks at least this old.
    pub leaks_min_age: Option<Duration>,
}

/// CLOCK_MONOTONIC now, the clock of `bpf_ktime_get_ns()`.
pub fn monotonic_now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-parameter.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Why collection stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// `--duration` elapsed.
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

/// Samples normalized and aggregated as they arrive.
struct Collector {
    stacks: StackResolver,
    aggregate: Aggregate,
    raw_samples: Option<RawSampleLog>,
}

impl Collector {
    fn add_batch(&mut self, batch: &mut Vec<Event>) {
        for event in batch.drain(..) {
            match event {
                Event::Sample(sample) => self.add_sample(&sample),
                Event::Freed { sample_id, .. } => self.aggregate.freed(sample_id),
                Event::Untracked { sample_id, .. } => self.aggregate.untracked(sample_id),
                Event::Exec { .. } | Event::Exit { .. } => {}
            }
        }
    }

    fn add_sample(&mut self, sample: &RawSample) {
        if let Some(log) = self.raw_samples.as_mut() {
            log.write(sample);
        }
        let frames = self.stacks.resolve(sample);
        let key = StackKey {
            pid: sample.pid,
            frames,
        };
        self.aggregate.add(key, sample);
    }
}

/// Runs a session to completion and returns its report.
pub async fn run(options: &SessionOptions) -> Result<(Report, StopReason)> {
    let target = Target::resolve(options.pid, &options.lookup())?;
    let raw_samples = options
        .raw_samples
        .as_deref()
        .map(RawSampleLog::create)
        .transpose()?;
    let config = SamplerConfig {
        pid: Some(target.pid),
        rate: options.rate,
        empty_probes: options.empty_probes,
        thread_tables: options.thread_tables,
        live: options.live.map(|l| l.mechanism),
        stack_copy_bytes: options.unwind.stack_copy_bytes(options.stack_bytes),
    };
    let mut sampler = Sampler::load(config)?;
    let mut reader = {
        let (ring, ring_bytes) = sampler.take_events()?;
        EventReader::new(ring, ring_bytes)
    }
    .context("ring buffer")?;
    // Watch for exit before attaching, so an exit during attach is not missed.
    let exit_fd = pidfd_open(target.pid)
        // SAFETY: the AsyncFd owns the OwnedFd, which keeps the fd open until dropped.
        .map(|fd| unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) })
        .transpose()
        .context("pidfd")?;
    let mut attached = Vec::new();
    for image in &target.images {
        attached.push(sampler.attach(image)?);
    }
    let started = Instant::now();
    eprintln!(
        "allocbpf: profiling pid {} ({}) through {}: {} probes, mean sampling interval {} bytes",
        target.pid,
        target.comm,
        target
            .images
            .iter()
            .map(|image| image.describe())
            .collect::<Vec<_>>()
            .join("; "),
        attached.iter().map(|a| a.links.len()).sum::<usize>(),
        options.rate
    );
    for image in &target.images {
        image.log_probe_points();
    }
    if let Some(first) = attached.first().filter(|_| options.live.is_some()) {
        let how = match first.live_mode {
            LiveMode::Session => "uprobe session links (only sampled calls pay for the return)",
            LiveMode::Uretprobe => "uretprobes on every allocation call (no session links)",
            LiveMode::Off => "no return probes (benchmark floor)",
        };
        eprintln!(
            "allocbpf: live tracking through {how}; {} deallocation entries probed",
            attached.iter().map(|a| a.frees).sum::<usize>()
        );
    }

    let mut collector = Collector {
        stacks: StackResolver::new(options.unwind, &options.allocator_prefixes),
        aggregate: if options.live.is_some() {
            Aggregate::with_live_tracking()
        } else {
            Aggregate::default()
        },
        raw_samples,
    };
    // Cache the target's maps while it surely lives: its last samples may be read
    // after it exits.
    collector.stacks.prime(target.pid);
    let mut batch = Vec::new();
    let mut sigterm = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    let mut refresh = tokio::time::interval(REFRESH_INTERVAL);
    refresh.tick().await;
    // Exited threads' entries stay frozen until collected (probe/totals.rs): free
    // them often enough that a program churning threads keeps finding slots.
    let mut collect = tokio::time::interval(COLLECT_EXITED_EVERY);
    collect.tick().await;
    let deadline = options.duration.map(|d| tokio::time::Instant::now() + d);
    let stop = loop {
        tokio::select! {
            read = reader.read_batch(&mut batch) => {
                collector.add_batch(&mut batch);
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
            _ = collect.tick() => {
                sampler.collect_exited_threads();
            }
            _ = refresh.tick() => {
                // The old table stays a valid exponential table: a failed refresh costs
                // nothing but freshness, so sampling goes on.
                if let Err(error) = sampler.refresh_intervals() {
                    tracing::warn!("interval table not refreshed: {error}");
                }
                sampler.flush_logs();
            }
        }
    };
    let duration = started.elapsed();
    // Leak ages are measured to the moment collection stopped (or the target exited).
    let stopped_ns = monotonic_now_ns();

    // One window for everything (docs/statistics.md, "One window"): detach every
    // probe and wait until no program run is in flight, so the exact totals and
    // counters read next include every call the ring buffer holds a sample of, and
    // nothing after. Then the samples still in the ring buffer: nothing collected is
    // lost. A failed read costs those figures (reported as 0, with a warning), never
    // the samples.
    for image in attached {
        sampler.detach(image.links);
    }
    crate::probe::wait_for_running_programs();
    let counters = sampler.counters().unwrap_or_else(|error| {
        tracing::warn!("kernel counters unavailable: {error}");
        Default::default()
    });
    let exact = match sampler.totals() {
        Ok(mut totals) => totals.remove(&target.pid).unwrap_or_default(),
        Err(error) => {
            tracing::warn!("exact totals unavailable: {error}");
            Default::default()
        }
    };
    sampler.flush_logs();
    drop(sampler);
    reader.drain(&mut batch);
    collector.add_batch(&mut batch);
    if reader.malformed > 0 {
        tracing::warn!("{} malformed ring-buffer records skipped", reader.malformed);
    }

    if let Some(log) = collector.raw_samples.as_mut() {
        log.finish();
    }
    if let Some(unwinder) = &collector.stacks.unwinder {
        tracing::info!(
            "unwound {} stacks in {:.6}s ({} bytes of unwind sections cached, {} files evicted)",
            unwinder.unwound,
            unwinder.elapsed.as_secs_f64(),
            unwinder.cached_bytes(),
            unwinder.evicted_files(),
        );
    }
    collector
        .aggregate
        .finish(stopped_ns, options.live.and_then(|l| l.leaks_min_age));
    let mut symbolizer = if options.symbolize {
        FrameSymbolizer::new()
    } else {
        FrameSymbolizer::unsymbolized()
    };
    let symbolizing = Instant::now();
    let mut report = Report::build(
        &collector.aggregate,
        &collector.stacks.normalizer.modules,
        &mut symbolizer,
        options.rate,
        options.confidence,
        KernelFigures {
            duration,
            exact,
            counters,
        },
    );
    if report.totals.exact_calls == 0 {
        report.note = Some(target.silence.to_string());
    }
    tracing::info!(
        "symbolized {} stacks of {} samples in {:.6}s",
        report.stacks.len(),
        report.totals.samples,
        symbolizing.elapsed().as_secs_f64()
    );
    Ok((report, stop))
}
