//! The collection engine: one [`Collector`] for one process and for every process.
//!
//! Data flow, keyed by process: probes (one set of uprobes per allocator image, shared
//! by every process that maps it) → ring buffer (samples, and exec/exit events) →
//! per-process gate and [`Scope`] → stacks resolved on receipt → one aggregate per
//! process → per-process reports ([`ProcessProfile`]), cut on demand (the agent cuts
//! one per interval; a one-shot run cuts once, at [`Collector::stop`]).
//!
//! Its parts, one job each: the intake (events in), the `StackResolver` (frames:
//! native, and each language runtime's, `runtimes.rs`), the `ProcessTable` (who is
//! followed), the `ImageSet` (what is attached), the `BudgetController` (the overhead
//! budget), the `IntervalCutter` (where an interval ends) and the chores (periodic
//! work: the `ExecQueue` of who exec'd and is examined next, rescans, refreshes). The
//! engine routes records between them and owns the kernel side ([`crate::kernel`]);
//! a process's exec and exit reach every part through `lifecycle.rs`.
//!
//! With [`Scope::Process`], the images are the target's, attached at start, and the
//! kernel filters on its pid. With [`Scope::Host`], new images are found from exec
//! events (a BTF raw tracepoint on `sched_process_exec`) a moment after the exec, when
//! the dynamic loader has mapped the libraries, plus a full `/proc` scan at start and
//! every [`RESCAN_INTERVAL`] for processes whose exec event was lost (a full ring
//! buffer or exec queue). Scanning only is simpler but either misses short-lived
//! processes in new images or costs a full `/proc` walk every few hundred
//! milliseconds; exec events cost nothing between execs. In both scopes, libraries
//! mapped after a process was examined (dlopen) are found by re-reading each admitted
//! process's maps every [`MAPS_RESCAN_INTERVAL`], round-robin (`maps_rescan.rs`).

use std::time::{Duration, Instant};

use allocbpf_common::GateState;
/// How returns are observed with live tracking (what [`AttachedTarget::live_mode`] says).
pub use allocbpf_common::LiveMode;
use allocbpf_images::{
    discover::Silence,
    image::{AllocatorImage, ImageKey},
    procfs,
};
use allocbpf_probe::{
    events::{Event, RawSample},
    sampler::COLLECT_EXITED_EVERY,
};
use allocbpf_profile::{
    aggregate::{SampledAllocation, StackKey},
    estimate::{attributed_sample, interval_table::REFRESH_INTERVAL},
    frame::{Frame, PROCESS_STACKS_FULL},
    report::Counters,
};
use allocbpf_runtime::Departure;
use allocbpf_stacks::resolve::StackResolver;

mod budget_control;
mod budget_wake;
mod cut;
mod exec_queue;
mod first_sight;
mod hit_cost;
mod images;
mod interval;
mod lifecycle;
mod map_shares;
mod maps_rescan;
mod own_links;
mod process_table;
mod release;
mod runtimes;
mod start;
mod stats;
#[cfg(test)]
mod tests;
mod window_moves;

use self::budget_control::BudgetController;
pub use self::budget_control::{ImageFigures, ProcessCostFigures};
pub(crate) use self::{
    exec_queue::ExecQueue,
    images::ImageSet,
    process_table::{Followed, Owner, ProcessTable, Tracked},
};
use self::{interval::IntervalCutter, maps_rescan::MapsRescan};
pub use self::{
    interval::ProcessProfile, maps_rescan::MAPS_RESCAN_INTERVAL, stats::CollectorStats,
};
use crate::{
    filter::ProcessFilter,
    identity::{self, ProcessInfo},
    kernel::{EventSource, Kernel},
    options::{CollectOptions, Scope},
    raw_samples::RawSampleLog,
};

/// How often all of `/proc` is rescanned for processes not followed yet
/// ([`Scope::Host`]); those followed have their maps re-read every
/// [`MAPS_RESCAN_INTERVAL`].
pub const RESCAN_INTERVAL: Duration = Duration::from_secs(30);

/// How often [`Collector::housekeeping`] should run.
pub const HOUSEKEEPING_TICK: Duration = Duration::from_millis(100);

/// Events handled between two looks at the budget's window clock.
const WINDOW_CHECK_EVERY: usize = 64;

/// A live block's allocation is older than this before a missing kernel entry is taken
/// for a lost `Freed` event (its call has long returned by then).
const LOST_FREE_MIN_AGE: Duration = Duration::from_secs(10);

/// [`Scope::Process`]: the target as attached at start.
pub struct AttachedTarget {
    /// Its pid.
    pub pid: u32,
    /// Its command name (bytes, not necessarily UTF-8).
    pub comm: std::ffi::OsString,
    /// Its allocator images, in the order they were found.
    pub images: Vec<AllocatorImage>,
    /// Probes attached, over all images.
    pub probes: usize,
    /// How returns are observed (the first image's), with live tracking.
    pub live_mode: Option<LiveMode>,
    /// Deallocation entries probed, over all images.
    pub frees: usize,
    /// What to say if it makes no probed call while profiled.
    pub silence: Silence,
    /// Its runtimes' own sources of samples, as the start-up line says them (a Go
    /// program's heap profile: its version and how it is read).
    pub runtimes: Vec<String>,
}

/// The events on their way in: where they come from, the batch being handled, and the
/// log raw samples are copied to.
struct Intake {
    source: Box<dyn EventSource>,
    batch: Vec<Event>,
    raw_samples: Option<RawSampleLog>,
    /// Samples waiting for their process's first look.
    first_sight: first_sight::FirstSight,
}

/// The engine's periodic work: when each kind was last done, and what is due next.
struct Chores {
    /// Processes that exec'd, looked at once their loader has mapped their libraries.
    exec_queue: ExecQueue,
    /// Whose maps are re-read next ([`MAPS_RESCAN_INTERVAL`]).
    maps_rescan: MapsRescan,
    /// The last scan of `/proc` for new processes.
    last_scan: Instant,
    /// The last refresh of the interval table.
    last_refresh: Instant,
    /// The last collection of exited threads' entries.
    last_collect: Instant,
    /// Under a budget: when windows next open or close (CLOCK_MONOTONIC ns).
    next_window_change_ns: Option<u64>,
}

/// Collects samples per process. See the module docs.
pub struct Collector {
    options: CollectOptions,
    scope: Scope,
    kernel: Option<Box<dyn Kernel>>,
    /// The events on their way in.
    intake: Intake,
    /// Frames: unwinding, normalizing, the runtimes' frames, symbolizing.
    stacks: StackResolver,
    processes: ProcessTable,
    images: ImageSet,
    budget: Option<BudgetController>,
    cutter: IntervalCutter,
    target: Option<AttachedTarget>,
    /// Periodic work: when it was last done, what is due next.
    chores: Chores,
    /// Each user's share of the kernel's runtime maps.
    map_shares: map_shares::MapShares,
    /// Running counts.
    pub stats: CollectorStats,
}

/// Distinct stacks one process's aggregate holds in an interval; past it, its new
/// stacks are added under one [`PROCESS_STACKS_FULL`] frame.
pub(crate) const MAX_STACKS_PER_PROCESS: usize = 1 << 15;

/// CPU time this thread has used, nanoseconds (0 if the clock cannot be read): what
/// the agent's work for its samples and looks costs.
pub(crate) fn thread_cpu_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec, ours.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) } != 0 {
        return 0;
    }
    (now.tv_sec as u64) * 1_000_000_000 + now.tv_nsec as u64
}

/// Waits until `at` ([`Collector::next_window_change`]); forever if `None`. For a
/// `select!` arm: take `at` before the select, call [`Collector::windows_tick`] after.
pub async fn window_wait(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// The overhead budget's figures, for metrics.
#[derive(Clone, Debug, Default)]
pub struct BudgetFigures {
    /// The per-process budget, fraction of a CPU.
    pub process_cpu: f64,
    /// The host budget, CPUs.
    pub host_cpu: f64,
    /// Per image: its file identity (`device:inode`), its path in the process that
    /// mapped it first (untrusted text), its figures.
    pub images: Vec<(String, String, ImageFigures)>,
    /// Per process: pid, command name (untrusted), observed fraction this interval,
    /// costs.
    pub processes: Vec<(u32, String, f64, ProcessCostFigures)>,
}

impl Collector {
    fn kernel(&mut self) -> &mut dyn Kernel {
        self.kernel
            .as_deref_mut()
            .expect("the kernel lives until stop")
    }

    /// [`Scope::Process`]: the target as attached.
    pub fn target(&self) -> Option<&AttachedTarget> {
        self.target.as_ref()
    }

    /// Looks at every process in `/proc`.
    fn scan_all(&mut self) {
        self.chores.last_scan = Instant::now();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return;
        };
        let pids: Vec<u32> = entries
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .collect();
        for pid in pids {
            if !self.processes.tracked.contains_key(&pid) {
                self.observe(pid);
            }
        }
    }

    /// (Re)reads `pid`'s identity, applies the scope and, if admitted, attaches its images.
    fn observe(&mut self, pid: u32) {
        if self.processes.ignored.contains(&pid) {
            return;
        }
        // One read of the maps serves the identity (the executable's build id) and
        // the images to attach.
        let maps = procfs::read_maps_counting_cuts(pid, &mut self.processes.maps_cut);
        let Some(info) = ProcessInfo::read(pid, &maps, &mut self.processes.build_ids) else {
            // Gone, or hidden from us: not read again for each of its samples.
            self.processes.set_readable(pid, false);
            return;
        };
        self.processes.set_readable(pid, true);
        let admitted = match &self.scope {
            Scope::Process(target) => pid == *target,
            Scope::Host { filter, .. } => {
                let admitted = filter.admits(&info);
                // The kernel filters on the pid in process scope: no gate is needed.
                self.set_gate(pid, admitted);
                admitted
            }
        };
        let live = self.options.live.is_some();
        match self.processes.update(info, admitted, live) {
            Followed::Known => {}
            Followed::New => self.stats.processes_seen += 1,
            Followed::Reused => {
                self.stats.processes_seen += 1;
                // What was cached about the pid is the earlier process's.
                self.forget_process(pid, Departure::Reused);
            }
        }
        // Records the files it maps (what a rescan of its maps compares with) and
        // attaches the images not attached yet. One process: its images were attached
        // at start and the facts about its files are cached (the target's), so only
        // an image it mapped since it was resolved is examined and attached here.
        // The runtimes look after the files are examined (Go's look needs the images'
        // facts). One process's start looks before attaching (its files were examined
        // when it was resolved), so that what the runtimes put in the kernel (a JVM's
        // Java frames) is there before its probes fire; its start attaches them.
        if admitted {
            let starting = matches!(self.scope, Scope::Process(_)) && self.target.is_none();
            if !starting {
                self.attach_images_of(pid, &maps);
            }
            let started_ns = thread_cpu_ns();
            self.look_at_runtimes(pid, &maps, false);
            self.stats.agent_look_ns += thread_cpu_ns().saturating_sub(started_ns);
        }
    }

    /// Looks at the processes that exec'd long enough before `now` for their loader
    /// to have mapped their libraries.
    fn observe_execs_due(&mut self, now: Instant) {
        for pid in self.chores.exec_queue.due(now) {
            self.observe(pid);
        }
    }

    /// Opens or closes `pid`'s gate for the scope's verdict (an admitted process with
    /// its own links keeps them as the ones that count).
    fn set_gate(&mut self, pid: u32, admitted: bool) {
        let own = (self.processes.tracked.get(&pid)).is_some_and(|t| t.own.attached());
        let gate = match (admitted, own) {
            (false, _) => GateState::Excluded,
            (true, true) => GateState::OwnLinks,
            (true, false) => GateState::Open,
        };
        if let Err(error) = self.kernel().set_gate(pid, gate) {
            tracing::warn!("pid {pid}: cannot set its gate: {error}");
        }
    }

    /// Attaches the images `pid` maps (`maps`) that are not attached yet.
    fn attach_images_of(&mut self, pid: u32, maps: &[procfs::MapsEntry]) {
        let lookup = self.options.lookup();
        let kernel = self
            .kernel
            .as_deref_mut()
            .expect("the kernel lives until stop");
        let (keys, mapped) =
            self.images
                .attach_images_of(kernel, &mut self.stats, pid, maps, &lookup);
        if let Some(tracked) = self.processes.tracked.get_mut(&pid) {
            tracked.images = keys;
            tracked.mapped = mapped;
        }
    }

    /// Reads the next batch of ring-buffer records and handles them.
    pub async fn read(&mut self) -> std::io::Result<()> {
        let mut batch = std::mem::take(&mut self.intake.batch);
        let result = self.intake.source.read_batch(&mut batch).await;
        self.handle(&mut batch);
        self.intake.batch = batch;
        result
    }

    /// Handles whatever the ring buffer holds now, without waiting.
    fn drain_ring(&mut self) {
        let mut batch = std::mem::take(&mut self.intake.batch);
        // A chunk at a time: the queue may hold 16 MiB, and decoded events as much.
        while self.intake.source.drain_some(&mut batch) {
            self.handle(&mut batch);
        }
        self.handle(&mut batch);
        self.intake.batch = batch;
    }

    fn handle(&mut self, batch: &mut Vec<Event>) {
        let source = self.intake.source.figures();
        self.stats.malformed_records = source.malformed;
        self.stats.ring_peak_bytes = source.ring_peak_bytes;
        self.stats.queue_peak_bytes = source.queue_peak_bytes;
        for (index, event) in batch.drain(..).enumerate() {
            // A long batch (stacks unwound for every sample) must not make the budget's
            // windows late: they are checked between events.
            if index % WINDOW_CHECK_EVERY == WINDOW_CHECK_EVERY - 1 && self.window_due() {
                // Held samples first: a window that moves must see every process
                // sampled before it (its live blocks expire with the window).
                self.look_at_first_seen(None);
                self.windows_tick();
            }
            let Some(event) = self.cutter.hold(event) else {
                continue;
            };
            // Any other event of a process whose samples wait for its first look
            // (an exit, a free of a sampled block) comes after that look.
            if let Some(pid) = event_pid(&event) {
                self.look_at_first_seen(Some(pid));
            }
            match event {
                Event::Sample(sample) => self.on_sample(sample),
                // Sample ids are unique: only the entry that holds it retires it.
                Event::Freed {
                    pid,
                    sample_id,
                    timestamp_ns,
                } => {
                    for tracked in self.processes.entries_of(pid) {
                        tracked.aggregate.freed_at(sample_id, timestamp_ns);
                    }
                }
                Event::Untracked { pid, sample_id } => {
                    for tracked in self.processes.entries_of(pid) {
                        tracked.aggregate.untracked(sample_id);
                    }
                }
                Event::Exec { pid } => self.on_exec(pid),
                Event::Exit { pid } => self.on_exit(pid),
            }
        }
        self.look_at_first_seen(None);
    }

    /// One sample: held for its process's first look if that process is new
    /// (`first_sight`), else added.
    fn on_sample(&mut self, sample: RawSample) {
        let pid = sample.pid;
        if self.processes.ignored.contains(&pid) {
            return;
        }
        // The followed process with its pid, the one that exited with it
        // (a late sample), or a new one, looked at first (a pid reused
        // after an exit is another process: `sample_owner`). After stop
        // (no kernel) only processes already known count.
        let owner = self.processes.sample_owner(pid, identity::start_time);
        let unseen = owner == Owner::Unknown && !self.processes.unreadable(pid);
        if self.intake.first_sight.holds(pid) || (unseen && self.kernel.is_some()) {
            self.hold_for_first_sight(sample);
            return;
        }
        self.add_sample(sample, owner);
    }

    /// A sample of a process looked at (`owner`): placed in its window under a budget,
    /// its stack resolved, and added to its process's aggregate.
    fn add_sample(&mut self, sample: RawSample, owner: Owner) {
        let pid = sample.pid;
        match self.processes.entry(pid, owner) {
            Some(tracked) if tracked.admitted => {}
            Some(_) => {
                // Sampled before its gate closed (or after the LRU map
                // forgot it): dropped here, and the gate closed again
                // (not for a process that exited: its pid may be reused).
                self.stats.filtered_samples += 1;
                if let Some(kernel) = self.kernel.as_mut().filter(|_| owner == Owner::Tracked) {
                    let _ = kernel.set_gate(pid, GateState::Excluded);
                }
                return;
            }
            // Gone before we could read its identity.
            None => return,
        }
        let mut allocation = allocation_of(&sample, self.stacks.attributed_object(&sample));
        if let Some(budget) = &self.budget {
            let tracked = self.processes.entry(pid, owner).expect("checked above");
            match budget.place(tracked, &self.images, sample.timestamp_ns) {
                Ok(window) => allocation.window = Some(window),
                Err(_) => {
                    self.stats.unplaced_samples += 1;
                    return;
                }
            }
        }
        if let Some(log) = self.intake.raw_samples.as_mut() {
            log.write(&sample);
        }
        // What resolving and adding it costs us, charged to its process's budget at a
        // steady per-sample cost (`budget/agent_cost.rs`).
        let started_ns = thread_cpu_ns();
        // A lost sample has its weight but no stack: it stands under one
        // frame that says so, and still counts in every total.
        let frames = if sample.lost {
            self.stats.lost_samples += 1;
            vec![Frame::Lost]
        } else {
            self.stacks.resolve(&sample)
        };
        let mut key = StackKey { pid, frames };
        let tracked = self.processes.entry(pid, owner).expect("checked above");
        let aggregate = &tracked.aggregate;
        if aggregate.stack_count() >= MAX_STACKS_PER_PROCESS && !aggregate.holds(&key) {
            // Past its cap a process's new stacks share one row that says so, their
            // weight kept: a process forging endless stacks costs its own detail.
            key.frames = vec![self.stacks.sentinel_frame(PROCESS_STACKS_FULL)];
            self.stats.stacks_merged += 1;
        }
        let tracked = self.processes.entry(pid, owner).expect("checked above");
        tracked.aggregate.add(key, &allocation);
        let spent_ns = thread_cpu_ns().saturating_sub(started_ns);
        tracked.agent.add_sample(spent_ns);
        self.stats.agent_sample_ns += spent_ns;
        self.stats.samples += 1;
    }

    /// Periodic work, to call every [`HOUSEKEEPING_TICK`]: exec'd processes, rescans
    /// (maps of followed processes, `/proc` for new ones), the interval table, the
    /// budget, exited threads, kernel logs.
    pub fn housekeeping(&mut self) {
        let now = Instant::now();
        self.observe_execs_due(now);
        self.look_again_due(now);
        if self.stacks.poll_due(now) {
            self.poll_runtimes(false);
        }
        self.rescan_maps_due(now);
        let host = matches!(self.scope, Scope::Host { .. });
        if host && now.duration_since(self.chores.last_scan) >= RESCAN_INTERVAL {
            self.scan_all();
        }
        if now.duration_since(self.chores.last_refresh) >= REFRESH_INTERVAL {
            self.chores.last_refresh = now;
            // The old table stays a valid exponential table: a failed refresh costs
            // nothing but freshness, so sampling goes on.
            if let Err(error) = self.kernel().refresh_intervals() {
                tracing::warn!("interval table not refreshed: {error}");
            }
        }
        let kernel = self
            .kernel
            .as_deref_mut()
            .expect("the kernel lives until stop");
        if let Some(budget) = self.budget.as_mut() {
            if budget.check(kernel, &mut self.processes, &self.images, &mut self.stats) {
                // Duties changed: a window may have to close now, not at the next
                // change planned before.
                self.windows_tick();
            }
        }
        let kernel = self
            .kernel
            .as_deref_mut()
            .expect("the kernel lives until stop");
        // Exited threads' entries stay frozen until collected (`probe/src/sampler/totals.rs`): free
        // them often enough that a program churning threads keeps finding slots.
        if now.duration_since(self.chores.last_collect) >= COLLECT_EXITED_EVERY {
            self.chores.last_collect = now;
            kernel.collect_exited_threads();
        }
        kernel.flush_logs();
        let level = u64::from(kernel.pressure_level());
        self.stats.pressure_level = level;
        self.stats.pressure_peak_level = self.stats.pressure_peak_level.max(level);
        self.refresh_file_counts();
    }

    /// How many processes are followed now.
    pub fn processes_followed(&self) -> u64 {
        self.processes.tracked.len() as u64
    }

    /// The kernel's counters now (zero if they cannot be read).
    pub fn counters(&mut self) -> Counters {
        self.kernel().counters().unwrap_or_default()
    }

    /// Replaces the process filter of a host scope (SIGHUP) and applies it to every
    /// known process.
    pub fn set_filter(&mut self, new: ProcessFilter) {
        if let Scope::Host { filter, .. } = &mut self.scope {
            *filter = new;
        }
        let pids: Vec<u32> = self.processes.tracked.keys().copied().collect();
        for pid in pids {
            self.observe(pid);
        }
    }

    /// Images known (attached or not), for logs.
    pub fn images(&self) -> impl Iterator<Item = (&AllocatorImage, bool)> {
        self.images
            .images
            .values()
            .map(|s| (&s.image, s.links.is_some()))
    }
}

/// The process a non-sample event is about.
fn event_pid(event: &Event) -> Option<u32> {
    match *event {
        Event::Sample(_) => None,
        Event::Freed { pid, .. }
        | Event::Untracked { pid, .. }
        | Event::Exec { pid }
        | Event::Exit { pid } => Some(pid),
    }
}

/// What the estimator needs of `sample`: the ring buffer's sample less its stack (the
/// key it is added under) and its window, which a budget sets.
/// A sample that a runtime's probe took of a chunk of its heap (a JVM's new TLAB, a V8
/// LAB) stands for the object that took the chunk, at the rate that gives it the
/// chunk's weight ([`attributed_sample`]); the runtime says what that object is
/// (`attributed`: its bytes, 0 when not known, for one that lost its capture in the
/// ring of lost samples), docs/statistics.md has the derivation.
fn allocation_of(sample: &RawSample, attributed: Option<u64>) -> SampledAllocation {
    let (size, offset, rate, certain) = match attributed {
        Some(object) => attributed_sample(sample.size, object, sample.rate, sample.certain),
        None => (sample.size, sample.offset, sample.rate, sample.certain),
    };
    SampledAllocation {
        sample_id: sample.sample_id,
        size,
        offset,
        rate,
        certain,
        timestamp_ns: sample.timestamp_ns,
        window: None,
    }
}
