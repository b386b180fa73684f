//! Storing and spooling profiles on a thread of their own.
//!
//! Encoding a cut's profiles (pprof, gzip), writing each to the store (with fsync),
//! retention, and spooling for push are file work whose time depends on the disk: on
//! the agent's main thread they held up the ring-buffer reader for as long as they
//! took. The main thread hands each cut to this thread and goes back to reading;
//! profiles are written in cut order.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        mpsc, Arc,
    },
    thread::JoinHandle,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result};

use super::{
    config::Retention,
    push::{PreparedPush, PushMeta, Pusher},
    store::ProfileStore,
};
use allocbpf_collect::engine::ProcessProfile;
use allocbpf_export::pprof;

/// What the writer has done, for the metrics (read by the main thread).
#[derive(Debug, Default)]
pub struct WriterStats {
    /// Profiles written to the store.
    pub profiles_written: AtomicU64,
    /// Profiles that could not be written to the store.
    pub store_errors: AtomicU64,
    /// Profiles deleted by retention or to make room on a full file system.
    pub store_deleted: AtomicU64,
    /// Bytes in the store.
    pub store_bytes: AtomicU64,
    /// CLOCK_MONOTONIC nanoseconds at which the job in progress, or the profile in
    /// progress of an export, started (0: idle): progress, not the length of a cut.
    pub job_started_ns: AtomicU64,
}

impl WriterStats {
    /// Marks the start of a step: a job, or one profile of an export.
    fn busy(&self) {
        self.job_started_ns.store(
            allocbpf_probe::sampler::monotonic_now_ns(),
            Ordering::Relaxed,
        );
    }

    /// Marks the thread idle.
    fn idle(&self) {
        self.job_started_ns.store(0, Ordering::Relaxed);
    }

    /// How long the thread has been on its current step (zero when idle): the watchdog
    /// stops being fed when this exceeds its period.
    pub fn stalled_for(&self) -> Duration {
        match self.job_started_ns.load(Ordering::Relaxed) {
            0 => Duration::ZERO,
            started => Duration::from_nanos(
                allocbpf_probe::sampler::monotonic_now_ns().saturating_sub(started),
            ),
        }
    }
}

enum Job {
    Export(Vec<ProcessProfile>),
    Reconfigure {
        retention: Retention,
        // Boxed: a prepared push (with its HTTP client) is large, and rare.
        push: Box<Option<PreparedPush>>,
    },
    /// Deliver the spool for at most this long, then stop.
    Finish(Duration),
}

/// The writer thread's handle.
pub struct Writer {
    jobs: mpsc::Sender<Job>,
    thread: Option<JoinHandle<()>>,
    /// Shared counters.
    pub stats: Arc<WriterStats>,
}

impl Writer {
    /// Starts the thread, which owns `store` and `pusher` from now on.
    pub fn start(store: ProfileStore, pusher: Option<Pusher>, hostname: String) -> Result<Writer> {
        let stats = Arc::new(WriterStats::default());
        stats
            .store_bytes
            .store(store.total_bytes(), Ordering::Relaxed);
        let (jobs, receiver) = mpsc::channel();
        let state = WriterState {
            store,
            pusher,
            hostname,
            stats: stats.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("allocbpf-writer".into())
            .spawn(move || state.run(receiver))
            .context("starting the profile writer thread")?;
        Ok(Writer {
            jobs,
            thread: Some(thread),
            stats,
        })
    }

    /// Queues one cut's profiles (retention runs after each cut, even one without
    /// profiles); returns at once.
    pub fn export(&self, profiles: Vec<ProcessProfile>) {
        let _ = self.jobs.send(Job::Export(profiles));
    }

    /// Applies a reloaded retention and push (`None`: no push), after the profiles
    /// queued before.
    pub fn reconfigure(&self, retention: Retention, push: Option<PreparedPush>) {
        let _ = self.jobs.send(Job::Reconfigure {
            retention,
            push: Box::new(push),
        });
    }

    /// Writes everything queued, delivers the spool for at most `push_timeout`, and
    /// stops the thread.
    pub fn finish(mut self, push_timeout: Duration) {
        let _ = self.jobs.send(Job::Finish(push_timeout));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

struct WriterState {
    store: ProfileStore,
    pusher: Option<Pusher>,
    hostname: String,
    stats: Arc<WriterStats>,
}

impl WriterState {
    fn run(mut self, jobs: mpsc::Receiver<Job>) {
        for job in jobs {
            self.stats.busy();
            let finish = matches!(job, Job::Finish(_));
            match job {
                Job::Export(profiles) => self.export(profiles),
                Job::Reconfigure { retention, push } => self.reconfigure(retention, *push),
                Job::Finish(timeout) => {
                    if let Some(pusher) = self.pusher.take() {
                        pusher.flush(timeout);
                    }
                }
            }
            self.stats.idle();
            if finish {
                return;
            }
        }
    }

    fn reconfigure(&mut self, retention: Retention, push: Option<PreparedPush>) {
        self.store.set_retention(retention);
        // The old pusher finishes its request in flight in the background; the new one
        // waits for it before sending.
        let previous = self.pusher.take().and_then(Pusher::retire);
        self.pusher = match push.map(|prepared| prepared.start(previous)) {
            Some(Ok(pusher)) => Some(pusher),
            Some(Err(error)) => {
                tracing::error!("SIGHUP: push not restarted: {error:#}");
                None
            }
            None => None,
        };
        self.enforce_retention();
    }

    /// Stores (and spools for push) one profile per process.
    fn export(&mut self, profiles: Vec<ProcessProfile>) {
        for profile in profiles {
            self.stats.busy();
            let mut labels = profile.info.labels(&self.hostname);
            if let Some(time) = &profile.report.time_sampling {
                // Under the overhead budget: how much of the interval was observed (the
                // estimates are scaled to the whole interval; see the profile comment).
                labels.push((
                    "observed_fraction",
                    format!("{:.4}", time.observed_fraction),
                ));
            }
            let start_ns = profile
                .started
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as i64);
            let mut message = pprof::to_profile(&profile.report, start_ns);
            pprof::add_labels(&mut message, &labels);
            pprof::add_comment(
                &mut message,
                &format!("exact_bytes={}", profile.report.totals.exact_bytes),
            );
            pprof::add_comment(
                &mut message,
                &format!("exact_calls={}", profile.report.totals.exact_calls),
            );
            let gzipped = pprof::gzip(&message);
            match self.store.write(
                profile.started,
                profile.ended,
                profile.info.pid,
                &profile.info.comm,
                &gzipped,
            ) {
                Ok(_) => {
                    self.stats.profiles_written.fetch_add(1, Ordering::Relaxed);
                }
                Err(error) => {
                    // Counted and logged; the push below still gets the profile.
                    self.stats.store_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("cannot store a profile: {error:#}");
                }
            }
            if let Some(pusher) = &self.pusher {
                let seconds =
                    |t: SystemTime| t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
                let meta = PushMeta {
                    labels: labels
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.clone()))
                        .collect(),
                    from: seconds(profile.started),
                    until: seconds(profile.ended).max(seconds(profile.started) + 1),
                };
                pusher.enqueue(&meta, &gzipped);
            }
        }
        self.enforce_retention();
    }

    fn enforce_retention(&mut self) {
        let deleted = self.store.enforce_retention(SystemTime::now());
        if deleted > 0 {
            tracing::info!("retention: {deleted} old profile(s) deleted");
        }
        self.stats
            .store_deleted
            .store(self.store.deleted, Ordering::Relaxed);
        self.stats
            .store_bytes
            .store(self.store.total_bytes(), Ordering::Relaxed);
    }
}
