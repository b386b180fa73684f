//! The system-wide profiler: attach, follow processes and images, collect per process.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    sync::atomic::Ordering,
    time::{Duration, Instant, SystemTime},
};

use allocbpf_common::{GateState, Totals};
use anyhow::{bail, Context, Result};

mod overhead;
mod release;

use super::{
    budget::{Budget, BudgetOptions},
    filter::ProcessFilter,
    process::{BuildIdCache, ProcessInfo},
    RESCAN_INTERVAL,
};
use crate::{
    aggregate::{Aggregate, StackKey},
    discover::ImageCache,
    estimate::{interval_table::REFRESH_INTERVAL, Confidence},
    events::{Event, EventReader},
    image::{AllocatorImage, ImageKey},
    probe::{Counters, ImageLinks, Sampler, SamplerConfig, ThreadTables, COLLECT_EXITED_EVERY},
    procfs::{self, MapsEntry},
    report::{KernelFigures, Report},
    session::LiveOptions,
    stacks::{StackResolver, UnwindMode},
    symbolize::FrameSymbolizer,
};

/// What system-wide profiling samples and how.
#[derive(Clone, Debug)]
pub struct SystemOptions {
    /// Mean sampling interval in bytes.
    pub rate: u64,
    /// Track sampled blocks until freed (inuse profiles).
    pub live: Option<LiveOptions>,
    /// How user stacks are unwound.
    pub unwind: UnwindMode,
    /// Bytes of user stack copied per sample (auto/dwarf).
    pub stack_bytes: u32,
    /// Symbolize frames.
    pub symbolize: bool,
    /// Level of the confidence intervals.
    pub confidence: Confidence,
    /// Which processes are profiled.
    pub filter: ProcessFilter,
    /// `--allocator-symbol` prefixes.
    pub allocator_prefixes: Vec<String>,
    /// The overhead budget (`None`: no budget).
    pub budget: Option<BudgetOptions>,
    /// Thread table sizes.
    pub thread_tables: ThreadTables,
}

impl SystemOptions {
    /// What discovery looks for, and whether stacks unwind through unprobed frames.
    pub fn lookup(&self) -> crate::image::Lookup {
        crate::image::Lookup {
            prefixes: self.allocator_prefixes.clone(),
            unwind_tables: self.unwind != UnwindMode::Fp,
        }
    }
}

/// One process's profile for one interval.
#[derive(Clone, Debug)]
pub struct ProcessProfile {
    /// The process and its labels.
    pub info: ProcessInfo,
    /// Its profile.
    pub report: Report,
    /// Start of the interval (wall clock).
    pub started: SystemTime,
    /// End of the interval.
    pub ended: SystemTime,
    /// True if the process exited during the interval (its last profile).
    pub exited: bool,
}

/// Running counts, for logs and the agent's metrics.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct SystemStats {
    /// Samples aggregated.
    pub samples: u64,
    /// Samples dropped because their process is filtered out (before its gate closed).
    pub filtered_samples: u64,
    /// Images with probes attached now.
    pub images_attached: u64,
    /// Images that could not be attached.
    pub attach_failures: u64,
    /// Processes seen so far.
    pub processes_seen: u64,
    /// Processes followed now.
    pub processes_tracked: u64,
    /// Exec events received.
    pub exec_events: u64,
    /// Exit events received.
    pub exit_events: u64,
    /// Processes backed off for their overhead budget (total).
    pub budget_backoffs: u64,
    /// Image detachments for the budget (total).
    pub budget_detachments: u64,
    /// Processes backed off now.
    pub budget_paused: u64,
    /// Live blocks retired because the kernel no longer tracked them: their `Freed`
    /// event was lost (total).
    pub lost_frees: u64,
    /// Module files closed because no profile referred to them any more (total).
    pub module_files_closed: u64,
    /// Module files held open now (for symbolization).
    pub module_files_open: u64,
    /// Modules in the normalizer's table now (those current stacks refer to).
    pub module_entries: u64,
    /// Images detached because no process maps them any more (total).
    pub images_released: u64,
    /// Exec events not followed up because the queue of processes to examine was full
    /// (the periodic rescan finds them later).
    pub exec_queue_overflows: u64,
    /// Ring-buffer records that could not be decoded.
    pub malformed_records: u64,
    /// The most ring-buffer bytes found waiting at one read.
    pub ring_peak_bytes: u64,
    /// The most record bytes read from the ring and waiting for this thread at once
    /// (while it examined an image or cut a profile).
    pub queue_peak_bytes: u64,
    /// Processes with kernel entries (totals or gate) after the last cut: bounded by
    /// the processes running, whatever the churn.
    pub kernel_processes: u64,
    /// Blocks in the kernel's live map at the last cut (`--live`).
    pub kernel_live_blocks: u64,
}

struct Tracked {
    info: ProcessInfo,
    admitted: bool,
    aggregate: Aggregate,
    exited: bool,
    /// Allocator images this process maps (for budget detachments).
    images: Vec<ImageKey>,
    /// Every executable file it mapped when last examined (and images found mapped
    /// since): what keeps cached facts and attached images alive (`release.rs`).
    mapped: Vec<ImageKey>,
}

struct ImageState {
    image: AllocatorImage,
    /// `None` while detached by the budget (or after a failed attach).
    links: Option<ImageLinks>,
    detached_until: Option<Instant>,
}

/// A live block's allocation is older than this before a missing kernel entry is taken
/// for a lost `Freed` event (its call has long returned by then).
const LOST_FREE_MIN_AGE: Duration = Duration::from_secs(10);

/// Exec events waiting for the loader to map the new program's libraries.
const EXEC_QUEUE_LIMIT: usize = 4096;
/// When an exec'd process is looked at: soon, and again for slow loaders.
const EXEC_DELAYS: [Duration; 2] = [Duration::from_millis(20), Duration::from_millis(500)];

/// Profiles every process of the host. See the module docs of [`crate::system`].
pub struct SystemProfiler {
    options: SystemOptions,
    sampler: Option<Sampler>,
    reader: EventReader,
    stacks: StackResolver,
    processes: HashMap<u32, Tracked>,
    images: HashMap<ImageKey, ImageState>,
    cache: ImageCache,
    build_ids: BuildIdCache,
    exec_queue: VecDeque<(Instant, u32, usize)>,
    /// Processes that exited without ever being tracked (no sample: cron jobs,
    /// scripts): their kernel entries (fallback totals, gates, live blocks) are
    /// removed at the next cut, so bounded maps hold running processes only and a
    /// reused pid starts clean.
    untracked_exits: HashSet<u32>,
    last_scan: Instant,
    last_refresh: Instant,
    budget: Option<Budget>,
    last_budget_check: Instant,
    /// Never profiled: allocbpf itself and its calibration children.
    ignored: HashSet<u32>,
    interval_started: SystemTime,
    interval_started_at: Instant,
    batch: Vec<Event>,
    /// During a cut: the epoch that ended. Samples of a later epoch read meanwhile
    /// belong to the next interval and wait in `held`.
    cutting: Option<u64>,
    held: Vec<Event>,
    last_collect: Instant,
    /// Running counts.
    pub stats: SystemStats,
}

impl SystemProfiler {
    /// Loads the sampler, attaches every image in use and (with a budget) measures the
    /// cost of a probe hit.
    pub fn start(options: SystemOptions) -> Result<SystemProfiler> {
        let config = SamplerConfig {
            pid: None,
            rate: options.rate,
            empty_probes: false,
            thread_tables: options.thread_tables,
            live: options.live.map(|l| l.mechanism),
            stack_copy_bytes: options.unwind.stack_copy_bytes(options.stack_bytes),
        };
        let mut sampler = Sampler::load(config)?;
        let reader = {
            let (ring, ring_bytes) = sampler.take_events()?;
            EventReader::new(ring, ring_bytes)
        }
        .context("ring buffer")?;
        let me = std::process::id();
        sampler.set_gate(me, GateState::Excluded)?;
        let now = Instant::now();
        let mut profiler = SystemProfiler {
            stacks: StackResolver::new(options.unwind, &options.allocator_prefixes),
            options,
            sampler: Some(sampler),
            reader,
            processes: HashMap::new(),
            images: HashMap::new(),
            cache: ImageCache::default(),
            build_ids: BuildIdCache::default(),
            exec_queue: VecDeque::new(),
            untracked_exits: HashSet::new(),
            last_scan: now,
            last_refresh: now,
            budget: None,
            last_budget_check: now,
            ignored: HashSet::from([me]),
            interval_started: SystemTime::now(),
            interval_started_at: now,
            batch: Vec::new(),
            cutting: None,
            held: Vec::new(),
            last_collect: Instant::now(),
            stats: SystemStats::default(),
        };
        // The unprobed cost of the calibration loop, before anything is attached.
        let baseline = match profiler.options.budget {
            Some(_) => {
                let mut runs = Vec::new();
                for _ in 0..3 {
                    runs.push(profiler.calibration_run(GateState::Open)?);
                }
                overhead::median(runs)
            }
            None => 0.0,
        };
        // Our own libc is the host's: attach it whatever the filters say, so the
        // calibration below measures a real probe.
        profiler.attach_images_of(me, &procfs::read_maps(me));
        profiler.scan_all();
        if profiler.stats.images_attached == 0 {
            bail!("no allocator image could be attached (see the warnings above)");
        }
        if let Some(options) = profiler.options.budget {
            let cost = profiler.calibrate(baseline)?;
            tracing::info!(
                "overhead budget: {:.1}% of a CPU per process; a probe hit costs {:.0} ns sampled, {:.0} ns paused, {:.0} ns more where the probed instruction is single-stepped",
                options.cpu_fraction * 100.0,
                cost.sampled_ns,
                cost.paused_ns,
                cost.stepped_extra_ns
            );
            profiler.budget = Some(Budget::new(options, cost));
        }
        Ok(profiler)
    }

    fn sampler(&mut self) -> &mut Sampler {
        self.sampler.as_mut().expect("the sampler lives until stop")
    }

    /// Looks at every process in `/proc`.
    fn scan_all(&mut self) {
        self.last_scan = Instant::now();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return;
        };
        let pids: Vec<u32> = entries
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .collect();
        for pid in pids {
            if !self.processes.contains_key(&pid) {
                self.observe(pid);
            }
        }
    }

    /// (Re)reads `pid`'s identity, applies the filters and attaches its images.
    fn observe(&mut self, pid: u32) {
        if self.ignored.contains(&pid) {
            return;
        }
        // One read of the maps serves the identity (the executable's build id) and
        // the images to attach.
        let maps = procfs::read_maps(pid);
        let Some(info) = ProcessInfo::read(pid, &maps, &mut self.build_ids) else {
            return;
        };
        let admitted = self.options.filter.admits(&info);
        let paused = self.budget.as_ref().is_some_and(|b| b.is_backed_off(pid));
        let gate = match (admitted, paused) {
            (false, _) => GateState::Excluded,
            (true, true) => GateState::Paused,
            (true, false) => GateState::Open,
        };
        if let Err(error) = self.sampler().set_gate(pid, gate) {
            tracing::warn!("pid {pid}: cannot set its gate: {error}");
        }
        let live = self.options.live.is_some();
        match self.processes.get_mut(&pid) {
            Some(tracked) => {
                tracked.info = info;
                tracked.admitted = admitted;
            }
            None => {
                self.stats.processes_seen += 1;
                self.processes.insert(
                    pid,
                    Tracked {
                        info,
                        admitted,
                        aggregate: if live {
                            Aggregate::with_live_tracking()
                        } else {
                            Aggregate::default()
                        },
                        exited: false,
                        images: Vec::new(),
                        mapped: Vec::new(),
                    },
                );
            }
        }
        if admitted {
            self.attach_images_of(pid, &maps);
        }
    }

    /// Attaches the images `pid` maps (`maps`) that are not attached yet.
    fn attach_images_of(&mut self, pid: u32, maps: &[MapsEntry]) {
        let found = self.cache.discover(pid, maps, &self.options.lookup());
        let keys: Vec<ImageKey> = found.iter().map(|i| i.key).collect();
        let mapped: Vec<ImageKey> = crate::image::candidate_mappings(maps)
            .into_iter()
            .map(ImageKey::of)
            .collect();
        for image in found {
            if self.images.contains_key(&image.key) {
                continue;
            }
            let links = match self.sampler().attach(&image) {
                Ok(attached) => {
                    self.stats.images_attached += 1;
                    image.log_probe_points();
                    tracing::info!(
                        "attached {} probes to {} ({}) for pid {pid}",
                        attached.links.len(),
                        image.path_in_target.display(),
                        image.key
                    );
                    Some(attached.links)
                }
                Err(error) => {
                    self.stats.attach_failures += 1;
                    tracing::warn!(
                        "cannot attach to {} ({}): {:#}",
                        image.path_in_target.display(),
                        image.key,
                        anyhow::Error::from(error)
                    );
                    None
                }
            };
            self.images.insert(
                image.key,
                ImageState {
                    image,
                    links,
                    detached_until: None,
                },
            );
        }
        if let Some(tracked) = self.processes.get_mut(&pid) {
            tracked.images = keys;
            tracked.mapped = mapped;
        }
    }

    /// Reads the next batch of ring-buffer records and handles them.
    pub async fn read(&mut self) -> std::io::Result<()> {
        let mut batch = std::mem::take(&mut self.batch);
        let result = self.reader.read_batch(&mut batch).await;
        self.handle(&mut batch);
        self.batch = batch;
        result
    }

    /// Handles whatever the ring buffer holds now, without waiting.
    fn drain_ring(&mut self) {
        let mut batch = std::mem::take(&mut self.batch);
        // A chunk at a time: the queue may hold 16 MiB, and decoded events as much.
        while self.reader.drain_some(&mut batch) {
            self.handle(&mut batch);
        }
        self.handle(&mut batch);
        self.batch = batch;
    }

    fn handle(&mut self, batch: &mut Vec<Event>) {
        self.stats.malformed_records = self.reader.malformed;
        let reader = &self.reader.stats;
        self.stats.ring_peak_bytes = reader.ring_peak_bytes.load(Ordering::Relaxed);
        self.stats.queue_peak_bytes = reader.queue_peak_bytes.load(Ordering::Relaxed);
        for event in batch.drain(..) {
            match event {
                // During a cut, a sample of the new epoch and every event after it
                // wait for the next interval, in order: a block's `Freed` must not be
                // handled before its held sample, or the block would stay live.
                Event::Sample(sample)
                    if self.cutting.is_some_and(|ended| {
                        !self.held.is_empty() || sample.epoch != ended as u32
                    }) =>
                {
                    self.held.push(Event::Sample(sample));
                }
                event @ (Event::Freed { .. } | Event::Untracked { .. })
                    if self.cutting.is_some() && !self.held.is_empty() =>
                {
                    self.held.push(event);
                }
                Event::Sample(sample) => {
                    let pid = sample.pid;
                    if self.ignored.contains(&pid) {
                        continue;
                    }
                    // After stop (no sampler) only processes already known count.
                    if !self.processes.contains_key(&pid) && self.sampler.is_some() {
                        self.observe(pid);
                    }
                    match self.processes.get(&pid) {
                        Some(tracked) if tracked.admitted => {}
                        Some(_) => {
                            // Sampled before its gate closed (or after the LRU map
                            // forgot it): dropped here, and the gate closed again.
                            self.stats.filtered_samples += 1;
                            if let Some(sampler) = self.sampler.as_mut() {
                                let _ = sampler.set_gate(pid, GateState::Excluded);
                            }
                            continue;
                        }
                        // Gone before we could read its identity.
                        None => continue,
                    }
                    let frames = self.stacks.resolve(&sample);
                    let tracked = self.processes.get_mut(&pid).expect("checked above");
                    tracked.aggregate.add(StackKey { pid, frames }, &sample);
                    self.stats.samples += 1;
                }
                Event::Freed { pid, sample_id, .. } => {
                    if let Some(tracked) = self.processes.get_mut(&pid) {
                        tracked.aggregate.freed(sample_id);
                    }
                }
                Event::Untracked { pid, sample_id } => {
                    if let Some(tracked) = self.processes.get_mut(&pid) {
                        tracked.aggregate.untracked(sample_id);
                    }
                }
                Event::Exec { pid } => {
                    self.stats.exec_events += 1;
                    self.stacks.forget(pid);
                    if self.sampler.is_some() {
                        if self.exec_queue.len() < EXEC_QUEUE_LIMIT {
                            self.exec_queue
                                .push_back((Instant::now() + EXEC_DELAYS[0], pid, 0));
                        } else {
                            self.stats.exec_queue_overflows += 1;
                        }
                    }
                }
                Event::Exit { pid } => {
                    self.stats.exit_events += 1;
                    match self.processes.get_mut(&pid) {
                        Some(tracked) => tracked.exited = true,
                        // Bounded by the host's pid space.
                        None => {
                            self.untracked_exits.insert(pid);
                        }
                    }
                }
            }
        }
    }

    /// Periodic work, to call every ~100 ms: exec'd processes, rescans, the interval
    /// table, the budget, kernel logs.
    pub fn housekeeping(&mut self) {
        let now = Instant::now();
        while let Some(&(due, pid, step)) = self.exec_queue.front() {
            if due > now {
                break;
            }
            self.exec_queue.pop_front();
            self.observe(pid);
            if let Some(delay) = EXEC_DELAYS.get(step + 1) {
                self.exec_queue.push_back((now + *delay, pid, step + 1));
            }
        }
        if now.duration_since(self.last_scan) >= RESCAN_INTERVAL {
            self.scan_all();
        }
        if now.duration_since(self.last_refresh) >= REFRESH_INTERVAL {
            self.last_refresh = now;
            if let Err(error) = self.sampler().refresh_intervals() {
                tracing::warn!("interval table not refreshed: {error}");
            }
        }
        if let Some(check_every) = self.budget.as_ref().map(|b| b.options.check_every) {
            if now.duration_since(self.last_budget_check) >= check_every {
                self.last_budget_check = now;
                self.check_budget(now);
            }
        }
        self.reattach_due(now);
        if now.duration_since(self.last_collect) >= COLLECT_EXITED_EVERY {
            self.last_collect = now;
            self.sampler().collect_exited_threads();
        }
        self.sampler().flush_logs();
    }

    /// Exact kernel totals and counters of `epoch`, which has ended (or, at stop, is
    /// the current one with every probe detached), after running programs are waited
    /// for.
    fn kernel_figures(&mut self, epoch: u64) -> (Counters, HashMap<u32, Totals>) {
        let sampler = self.sampler();
        let counters = sampler.counters_of(epoch).unwrap_or_else(|error| {
            tracing::warn!("kernel counters unavailable: {error}");
            Counters::default()
        });
        let totals = sampler.totals_of(epoch).unwrap_or_else(|error| {
            tracing::warn!("exact totals unavailable: {error}");
            HashMap::new()
        });
        (counters, totals)
    }

    /// Cuts one profile per profiled process for the interval that ends now, and starts
    /// the next; processes that exited are forgotten after their last profile.
    ///
    /// One window without stopping the probes (docs/statistics.md, "One window"): a new
    /// epoch starts, running programs are waited for, then the ended epoch's totals,
    /// counters and samples are exactly the interval's; samples of the new epoch read
    /// meanwhile are kept for the next interval.
    pub fn cut(&mut self) -> Vec<ProcessProfile> {
        let ended = match self.sampler().next_epoch() {
            Ok(ended) => ended,
            Err(error) => {
                // Reading a running epoch would count its calls again at the next
                // cut: the interval stays open instead, and is cut next time.
                tracing::warn!("interval not cut, the epoch could not advance: {error}");
                return Vec::new();
            }
        };
        crate::probe::wait_for_running_programs();
        let figures = self.kernel_figures(ended);
        self.cutting = Some(ended);
        self.drain_ring();
        let profiles = self.cut_with(figures);
        self.cutting = None;
        let mut held = std::mem::take(&mut self.held);
        self.handle(&mut held);
        profiles
    }

    fn cut_with(
        &mut self,
        (counters, totals): (Counters, HashMap<u32, Totals>),
    ) -> Vec<ProcessProfile> {
        let ended = SystemTime::now();
        let duration = self.interval_started_at.elapsed();
        let now_ns = crate::session::monotonic_now_ns();
        let mut symbolizer = if self.options.symbolize {
            FrameSymbolizer::new()
        } else {
            FrameSymbolizer::unsymbolized()
        };
        let mut profiles = Vec::new();
        let mut gone = HashSet::new();
        // Blocks whose Freed event was lost (a full ring) would stay live for good:
        // those the kernel no longer tracks, allocated long enough ago that their call
        // has returned (a sample is sent at the call, its block tracked at the return).
        let kernel_live = match (&self.sampler, self.options.live.is_some()) {
            (Some(sampler), true) => Some(sampler.live_sample_ids()),
            _ => None,
        };
        if let Some(kernel_live) = &kernel_live {
            self.stats.kernel_live_blocks = kernel_live.values().map(|ids| ids.len() as u64).sum();
        }
        let settled_before = now_ns.saturating_sub(LOST_FREE_MIN_AGE.as_nanos() as u64);
        for (&pid, tracked) in &mut self.processes {
            if let Some(kernel_live) = &kernel_live {
                let known = kernel_live.get(&pid);
                let lost = tracked.aggregate.forget_lost_frees(settled_before, |id| {
                    known.is_some_and(|ids| ids.contains(&id))
                });
                self.stats.lost_frees += lost;
            }
            if !tracked.exited && !procfs::is_alive(pid) {
                // Its exit event was lost (full ring): same outcome.
                tracked.exited = true;
            }
            // The window's own totals (one epoch), not a running sum.
            let exact = totals.get(&pid).copied().unwrap_or_default();
            if tracked.admitted && (!tracked.aggregate.is_empty() || exact.calls > 0) {
                tracked.aggregate.finish(now_ns, None);
                let report = Report::build(
                    &tracked.aggregate,
                    &self.stacks.normalizer.modules,
                    &mut symbolizer,
                    self.options.rate,
                    self.options.confidence,
                    KernelFigures {
                        duration,
                        exact,
                        counters,
                    },
                );
                profiles.push(ProcessProfile {
                    info: tracked.info.clone(),
                    report,
                    started: self.interval_started,
                    ended,
                    exited: tracked.exited,
                });
            }
            tracked.aggregate.start_interval();
            if tracked.exited {
                gone.insert(pid);
            }
        }
        for pid in &gone {
            self.processes.remove(pid);
            self.stacks.forget(*pid);
        }
        // Processes never tracked are in no report: their entries go too (a pid reused
        // since has sampled and is tracked, and is left alone).
        for pid in std::mem::take(&mut self.untracked_exits) {
            if !self.processes.contains_key(&pid) {
                gone.insert(pid);
            }
        }
        if let Some(sampler) = self.sampler.as_mut() {
            // Backstop for exit events lost to a full ring: kernel entries of processes
            // neither tracked nor alive.
            let kernel_pids = sampler.kernel_pids();
            gone.extend(
                kernel_pids
                    .iter()
                    .filter(|pid| !self.processes.contains_key(pid) && !procfs::is_alive(**pid)),
            );
            sampler.forget_processes(&gone);
            self.stats.kernel_processes =
                kernel_pids.iter().filter(|pid| !gone.contains(pid)).count() as u64;
            // Not at stop (no sampler): everything is let go of with the profiler.
            self.release_unused_images();
            self.release_unused_modules();
        }
        self.stats.processes_tracked = self.processes.len() as u64;
        self.interval_started = ended;
        self.interval_started_at = Instant::now();
        profiles
    }

    /// Detaches everything, reads what is still in the ring buffer and cuts the last
    /// profiles: nothing collected is lost. The exact totals are read after every
    /// probe is detached and no program run is in flight, so they and the samples
    /// cover the same calls (docs/statistics.md, "One window").
    pub fn stop(mut self) -> Vec<ProcessProfile> {
        let links: Vec<_> = self
            .images
            .values_mut()
            .filter_map(|state| state.links.take())
            .collect();
        if let Some(sampler) = self.sampler.as_mut() {
            for image in links {
                sampler.detach(image);
            }
        }
        crate::probe::wait_for_running_programs();
        let epoch = self.sampler().epoch();
        let figures = self.kernel_figures(epoch);
        if let Some(mut sampler) = self.sampler.take() {
            sampler.flush_logs();
        }
        self.drain_ring();
        self.cut_with(figures)
    }

    /// The kernel's counters now (zero if they cannot be read).
    pub fn counters(&mut self) -> Counters {
        self.sampler().counters().unwrap_or_default()
    }

    /// Replaces the process filter (SIGHUP) and applies it to every known process.
    pub fn set_filter(&mut self, filter: ProcessFilter) {
        self.options.filter = filter;
        let pids: Vec<u32> = self.processes.keys().copied().collect();
        for pid in pids {
            self.observe(pid);
        }
    }

    /// Images known (attached or not), for logs.
    pub fn images(&self) -> impl Iterator<Item = (&AllocatorImage, bool)> {
        self.images.values().map(|s| (&s.image, s.links.is_some()))
    }
}
