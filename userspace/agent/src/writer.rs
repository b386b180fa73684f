//! Storing and spooling profiles on a thread of their own.
//!
//! Encoding a cut's profiles (pprof, gzip), writing each to the store (with fsync),
//! retention, and spooling for push are file work whose time depends on the disk: on
//! the agent's main thread they held up the ring-buffer reader for as long as they
//! took. The main thread hands each cut to this thread and goes back to reading;
//! profiles are written in cut order, and the directories a cut touched (store and
//! spool) are synced once after it.
//!
//! At most [`MAX_QUEUED_CUTS`] cuts wait for (or are in) the thread: a disk slower
//! than the cuts would otherwise grow the queue, and the agent's memory, without
//! bound. A cut beyond that is dropped, counted (`profiles_dropped`) and logged.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        mpsc, Arc,
    },
    thread::JoinHandle,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result};

use super::{
    config::Retention,
    push::{PreparedPush, PushMeta, Pusher},
    store::{ProfileStore, RetentionClock},
};

/// Cuts the writer may hold (queued or in progress) before it drops new ones.
pub const MAX_QUEUED_CUTS: usize = 3;
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
    /// Profiles of cuts dropped because the writer already held [`MAX_QUEUED_CUTS`].
    pub profiles_dropped: AtomicU64,
    /// CLOCK_MONOTONIC nanoseconds at which the job in progress, or the profile in
    /// progress of an export, started (0: idle): progress, not the length of a cut.
    pub job_started_ns: AtomicU64,
}

impl WriterStats {
    /// Marks the start of a step: a job, or one profile of an export.
    fn busy(&self) {
        self.job_started_ns
            .store(allocbpf_collect::monotonic_now_ns(), Ordering::Relaxed);
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
            started => {
                Duration::from_nanos(allocbpf_collect::monotonic_now_ns().saturating_sub(started))
            }
        }
    }
}

enum Job {
    Export(Vec<ProcessProfile>),
    Reconfigure {
        retention: Retention,
        /// One per store.
        push: Vec<PreparedPush>,
    },
    /// Deliver the spool, starting no request after this instant, then stop.
    Finish(Instant),
    /// Wait for the sender (tests: a writer held busy).
    #[cfg(test)]
    Hold(mpsc::Receiver<()>),
}

/// The writer thread's handle.
pub struct Writer {
    jobs: mpsc::Sender<Job>,
    thread: Option<JoinHandle<()>>,
    /// Export jobs queued or in progress.
    queued_cuts: Arc<AtomicUsize>,
    /// Disconnected when the thread ends.
    done: mpsc::Receiver<()>,
    /// Shared counters.
    pub stats: Arc<WriterStats>,
}

impl Writer {
    /// Starts the thread, which owns `store` and `pushers` (one per store) from now on.
    pub fn start(store: ProfileStore, pushers: Vec<Pusher>, hostname: String) -> Result<Writer> {
        let stats = Arc::new(WriterStats::default());
        stats
            .store_bytes
            .store(store.total_bytes(), Ordering::Relaxed);
        let (jobs, receiver) = mpsc::channel();
        let queued_cuts = Arc::new(AtomicUsize::new(0));
        let (done_sender, done) = mpsc::channel::<()>();
        let state = WriterState {
            store,
            pushers,
            retired: HashMap::new(),
            hostname,
            stats: stats.clone(),
            queued_cuts: queued_cuts.clone(),
            clock: RetentionClock::new(),
        };
        let thread = std::thread::Builder::new()
            .name("allocbpf-writer".into())
            .spawn(move || {
                // Dropped as the thread ends, however it ends: `done` disconnects.
                let _done = done_sender;
                state.run(receiver)
            })
            .context("starting the profile writer thread")?;
        Ok(Writer {
            jobs,
            thread: Some(thread),
            queued_cuts,
            done,
            stats,
        })
    }

    /// Queues one cut's profiles (retention runs after each cut, even one without
    /// profiles); returns at once. A cut that would be the writer's
    /// [`MAX_QUEUED_CUTS`]+1st is dropped (counted, logged): returns whether it was
    /// queued.
    pub fn export(&self, profiles: Vec<ProcessProfile>) -> bool {
        let queued = self.queued_cuts.load(Ordering::Relaxed);
        if queued >= MAX_QUEUED_CUTS {
            self.stats
                .profiles_dropped
                .fetch_add(profiles.len() as u64, Ordering::Relaxed);
            tracing::warn!(
                "the profile writer holds {queued} cuts already (a slow store disk?): a cut of {} profile(s) dropped",
                profiles.len()
            );
            return false;
        }
        self.export_last(profiles);
        true
    }

    /// Queues the last cut (at stop), whatever the writer holds.
    pub fn export_last(&self, profiles: Vec<ProcessProfile>) {
        self.queued_cuts.fetch_add(1, Ordering::Relaxed);
        let _ = self.jobs.send(Job::Export(profiles));
    }

    /// Applies a reloaded retention and push (one per store; none: no push), after the
    /// profiles queued before.
    pub fn reconfigure(&self, retention: Retention, push: Vec<PreparedPush>) {
        let _ = self.jobs.send(Job::Reconfigure { retention, push });
    }

    /// Writes everything queued, delivers the spool starting no request after
    /// `push_until`, and stops the thread, waiting for it until `deadline` at most.
    /// False if it had not finished by then (it ends with the process).
    pub fn finish(mut self, push_until: Instant, deadline: Instant) -> bool {
        let _ = self.jobs.send(Job::Finish(push_until));
        let wait = deadline.saturating_duration_since(Instant::now());
        match self.done.recv_timeout(wait) {
            Err(mpsc::RecvTimeoutError::Timeout) => false,
            Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                if let Some(thread) = self.thread.take() {
                    let _ = thread.join();
                }
                true
            }
        }
    }

    /// Keeps the thread busy until the returned sender sends or drops (tests).
    #[cfg(test)]
    fn hold(&self) -> mpsc::Sender<()> {
        let (release, held) = mpsc::channel();
        let _ = self.jobs.send(Job::Hold(held));
        release
    }
}

struct WriterState {
    store: ProfileStore,
    pushers: Vec<Pusher>,
    /// Delivery threads of stores a reload removed, by spool directory, still finishing
    /// their request in flight: a pusher later started for that store waits for it.
    retired: HashMap<&'static str, JoinHandle<()>>,
    hostname: String,
    stats: Arc<WriterStats>,
    queued_cuts: Arc<AtomicUsize>,
    clock: RetentionClock,
}

impl WriterState {
    fn run(mut self, jobs: mpsc::Receiver<Job>) {
        for job in jobs {
            self.stats.busy();
            let finish = matches!(job, Job::Finish(_));
            match job {
                Job::Export(profiles) => {
                    self.export(profiles);
                    self.queued_cuts.fetch_sub(1, Ordering::Relaxed);
                }
                Job::Reconfigure { retention, push } => self.reconfigure(retention, push),
                Job::Finish(push_until) => {
                    // Each store's deadline is the same instant: flushed side by side.
                    std::thread::scope(|scope| {
                        for pusher in self.pushers.drain(..) {
                            scope.spawn(move || pusher.flush(push_until));
                        }
                    });
                    // Threads of stores a reload removed end their request in flight
                    // by then (a record cut off mid-request would go again later).
                    for (_, thread) in self.retired.drain() {
                        while !thread.is_finished() && Instant::now() < push_until {
                            std::thread::sleep(Duration::from_millis(10));
                        }
                        if thread.is_finished() {
                            let _ = thread.join();
                        }
                    }
                }
                #[cfg(test)]
                Job::Hold(held) => {
                    let _ = held.recv();
                }
            }
            self.stats.idle();
            if finish {
                return;
            }
        }
    }

    fn reconfigure(&mut self, retention: Retention, push: Vec<PreparedPush>) {
        self.store.set_retention(retention);
        // Each old pusher finishes its request in flight in the background; the next one
        // of the same store, now or at a later reload, waits for it before sending (so
        // nothing goes twice).
        for pusher in self.pushers.drain(..) {
            let dir = pusher.destination().spool_dir();
            if let Some(thread) = pusher.retire() {
                // A store has one running pusher, which took the retired thread before
                // it: nothing older is left here to wait for.
                self.retired.insert(dir, thread);
            }
        }
        self.retired.retain(|_, thread| !thread.is_finished());
        for prepared in push {
            let before = self.retired.remove(prepared.destination().spool_dir());
            match prepared.start(before) {
                Ok(pusher) => self.pushers.push(pusher),
                Err(error) => tracing::error!("SIGHUP: push not restarted: {error:#}"),
            }
        }
        self.enforce_retention();
        self.sync_directories();
    }

    /// Stores (and spools for push) one profile per process.
    fn export(&mut self, profiles: Vec<ProcessProfile>) {
        for profile in profiles {
            self.stats.busy();
            let start_ns = profile
                .started
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as i64);
            let meta = pprof::ProfileMeta::of_process(
                &profile.report,
                start_ns,
                &profile.info.labels(&self.hostname),
            );
            let gzipped = pprof::encode(&profile.report, &meta);
            match self.store.write(
                profile.started,
                profile.ended,
                profile.info.pid,
                &profile.info.comm_text(),
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
            if !self.pushers.is_empty() {
                let seconds =
                    |t: SystemTime| t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
                // The profile's labels, observed_fraction included: the spool record
                // keeps them all, each transport picks its own.
                let push = PushMeta {
                    labels: meta.labels,
                    from: seconds(profile.started),
                    until: seconds(profile.ended).max(seconds(profile.started) + 1),
                };
                for pusher in &self.pushers {
                    pusher.enqueue(&push, &gzipped);
                }
            }
        }
        self.enforce_retention();
        self.sync_directories();
    }

    /// Makes the cut's renames and deletions durable: one fsync per directory touched.
    fn sync_directories(&mut self) {
        if let Err(error) = self.store.sync_dirs() {
            tracing::warn!("store: cannot sync a directory: {error}");
        }
        for pusher in &self.pushers {
            match pusher.sync_spool() {
                Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                    tracing::warn!("push spool: cannot sync its directory: {error}");
                }
                _ => {}
            }
        }
    }

    fn enforce_retention(&mut self) {
        let deleted = self.store.enforce_retention(self.clock.now());
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

#[cfg(test)]
mod tests {
    use super::*;

    fn writer(name: &str) -> (Writer, std::path::PathBuf) {
        let root = std::env::temp_dir().join(format!("allocbpf-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let retention = Retention {
            max_age: Duration::from_secs(3600),
            max_bytes: 1 << 30,
            max_files: 1000,
        };
        let store = ProfileStore::open(&root, retention).unwrap();
        (
            Writer::start(store, Vec::new(), "host".into()).unwrap(),
            root,
        )
    }

    /// A writer held up (a slow disk) takes MAX_QUEUED_CUTS cuts, drops the next ones,
    /// and takes new cuts again once it caught up; the last cut is never dropped.
    #[test]
    fn the_writer_queue_is_bounded() {
        let (writer, root) = writer("writer-queue");
        let release = writer.hold();
        for _ in 0..MAX_QUEUED_CUTS {
            assert!(writer.export(Vec::new()));
        }
        assert!(!writer.export(Vec::new()), "one cut too many was queued");
        writer.export_last(Vec::new());
        drop(release);
        let deadline = Instant::now() + Duration::from_secs(10);
        while writer.queued_cuts.load(Ordering::Relaxed) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(writer.queued_cuts.load(Ordering::Relaxed), 0);
        assert!(writer.export(Vec::new()));
        let now = Instant::now();
        assert!(writer.finish(now, now + Duration::from_secs(10)));
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// Stopping waits for the writer until the deadline, not longer.
    #[test]
    fn finish_keeps_its_deadline() {
        let (writer, root) = writer("writer-deadline");
        let release = writer.hold();
        let started = Instant::now();
        assert!(!writer.finish(started, started + Duration::from_millis(200)));
        assert!(started.elapsed() < Duration::from_secs(2));
        drop(release);
        let _ = std::fs::remove_dir_all(&root);
    }
}
