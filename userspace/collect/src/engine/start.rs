//! Starting the engine: load the kernel side, attach the target's images or every image
//! in use, and (host scope, with a budget) measure what a probe hit costs.

use std::time::Instant;

use allocbpf_common::GateState;
use allocbpf_images::{
    procfs,
    target::{Target, TargetError},
};
use allocbpf_probe::sampler::SamplerConfig;
use allocbpf_stacks::resolve::StackResolver;

use super::{
    budget_control::BudgetController, interval::IntervalCutter, AttachedTarget, Chores, Collector,
    CollectorStats, ExecQueue, ImageSet, Intake, ProcessTable,
};
use crate::{
    budget::{BudgetOptions, HitCost},
    error::CollectError,
    identity::ProcessInfo,
    kernel::{KernelLoader, Loaded},
    options::{CollectOptions, Scope},
    raw_samples::RawSampleLog,
};

impl Collector {
    /// Loads the kernel side through `loader` (the eBPF sampler: [`EbpfObject`]) and
    /// attaches: the target's images ([`Scope::Process`]), or every image in use,
    /// measuring the cost of a probe hit if there is a budget ([`Scope::Host`]).
    /// Errors say why nothing can be profiled; a host image that cannot be attached is
    /// only a warning.
    ///
    /// [`EbpfObject`]: crate::kernel::EbpfObject
    pub fn start(
        loader: &dyn KernelLoader,
        options: CollectOptions,
        scope: Scope,
    ) -> Result<Collector, CollectError> {
        // The target first: an unknown pid or a process without an allocator fails
        // before anything is loaded.
        let target = match scope {
            Scope::Process(pid) => match Target::resolve(pid, &options.lookup()) {
                Ok(target) => Some(target),
                // It existed when resolving began (else `NoSuchProcess`): an unreadable
                // map, or no allocator in files it could no longer show, is its exit
                // (under way: it may not be a zombie yet).
                Err(error)
                    if !matches!(error, TargetError::NoSuchProcess(_))
                        && procfs::is_exiting(pid) =>
                {
                    return Err(CollectError::TargetExited { pid })
                }
                Err(error) => return Err(error.into()),
            },
            Scope::Host { .. } => None,
        };
        Self::start_resolved(loader, options, scope, target)
    }

    /// [`Collector::start`] once [`Scope::Process`]'s target is resolved.
    pub(crate) fn start_resolved(
        loader: &dyn KernelLoader,
        options: CollectOptions,
        scope: Scope,
        target: Option<Target>,
    ) -> Result<Collector, CollectError> {
        let mut collector = Self::assemble(loader, options, scope)?;
        match target {
            Some(target) => collector.attach_target(target)?,
            None => collector.attach_host()?,
        }
        if collector.budget.is_some() {
            collector.windows_tick();
        }
        Ok(collector)
    }

    /// Loads the kernel side and puts the engine together, with nothing attached.
    pub(crate) fn assemble(
        loader: &dyn KernelLoader,
        options: CollectOptions,
        scope: Scope,
    ) -> Result<Collector, CollectError> {
        let raw_samples = options
            .raw_samples
            .as_deref()
            .map(RawSampleLog::create)
            .transpose()?;
        let Loaded { kernel, events } = loader.load(SamplerConfig {
            pid: scope.pid(),
            rate: options.rate,
            empty_probes: options.empty_probes,
            thread_tables: options.thread_tables,
            live: options.live.map(|l| l.mechanism),
            stack_copy_bytes: options.unwind.stack_copy_bytes(options.stack_bytes),
            count_hits: options.budget.is_some(),
            multi_links: true,
        })?;
        let mut options = options;
        if options.budget.is_some() && !kernel.windows_supported() {
            tracing::warn!(
                "this kernel cannot take an image's probes out at once (uprobe_multi links with process filtering, Linux 6.10+, and uprobe session links for --live, 6.13+): the overhead budget cannot probe part time, so every image is probed full time"
            );
            options.budget = None;
        }
        let now = Instant::now();
        Ok(Collector {
            stacks: StackResolver::new(
                options.unwind,
                &options.allocator_prefixes,
                (options.runtimes.0)(),
            ),
            // A host scope never profiles allocbpf itself; `--pid` may name anything.
            processes: ProcessTable {
                record_timelines: options.timeline,
                ..match &scope {
                    Scope::Host { .. } => ProcessTable::ignoring(std::process::id()),
                    Scope::Process(_) => ProcessTable::default(),
                }
            },
            options,
            scope,
            kernel: Some(kernel),
            intake: Intake {
                source: events,
                batch: Vec::new(),
                raw_samples,
                first_sight: Default::default(),
            },
            images: ImageSet::default(),
            budget: None,
            cutter: IntervalCutter::new(),
            target: None,
            chores: Chores {
                exec_queue: ExecQueue::default(),
                maps_rescan: Default::default(),
                last_scan: now,
                last_refresh: now,
                last_collect: now,
                next_window_change_ns: None,
            },
            map_shares: Default::default(),
            stats: CollectorStats::default(),
        })
    }

    /// [`Scope::Process`]: attaches every image of the target (any failure is an
    /// error), and starts the interval once they are.
    fn attach_target(&mut self, target: Target) -> Result<(), CollectError> {
        // Timed before the target's probes are in: they would slow the child's loop.
        let calibration = match self.options.budget {
            Some(_) => Some(self.calibrate_for_one_process()?),
            None => None,
        };
        let mut attached = AttachedTarget {
            pid: target.pid,
            comm: target.comm,
            images: Vec::new(),
            probes: 0,
            live_mode: None,
            frees: 0,
            silence: target.silence,
            runtimes: Vec::new(),
        };
        // What resolving it found about its files: a rescan of its maps examines only
        // files mapped since (dlopen).
        self.images.cache = target.cache;
        // Its runtimes look before its probes go in (`observe` attaches nothing yet).
        self.observe(target.pid);
        for image in target.images {
            let links = match self.kernel().attach(&image) {
                Ok(links) => links,
                // Gone meanwhile: what the images attached so far saw is kept, and the
                // run stops at once (`StopReason::ExitedDuringAttach`).
                Err(_) if procfs::has_exited(attached.pid) => break,
                Err(error) => return Err(error.into()),
            };
            attached.probes += links.links.len();
            attached.frees += links.frees;
            if self.options.live.is_some() {
                attached.live_mode.get_or_insert(links.live_mode);
            }
            attached.images.push(image.clone());
            self.stats.images_attached += 1;
            self.images.insert(image, Some(links.links));
        }
        // The interval starts once every probe is attached (reading the target's
        // identity and maps below is not profiling time).
        self.cutter = IntervalCutter::new();
        let pid = attached.pid;
        let comm = attached.comm.clone();
        self.target = Some(attached);
        self.observe(pid);
        let sources: Vec<String> = (self.processes.tracked.get(&pid))
            .into_iter()
            .flat_map(|tracked| &tracked.info.runtimes)
            .filter_map(|found| found.source.clone())
            .collect();
        if let Some(target) = self.target.as_mut() {
            target.runtimes = sources;
        }
        if !self.processes.tracked.contains_key(&pid) {
            // Its identity could not be read (it may be exiting): its samples still
            // count, under what was read when it was resolved.
            let info = ProcessInfo {
                pid,
                comm,
                ..ProcessInfo::default()
            };
            self.processes
                .update(info, true, self.options.live.is_some());
        }
        if let Some(tracked) = self.processes.tracked.get_mut(&pid) {
            tracked.images = self.images.images.keys().copied().collect();
        }
        // Cache the target's maps while it surely lives: its last samples may be read
        // after it exits.
        self.stacks.prime(pid);
        if let (Some(options), Some(cost)) = (self.options.budget, calibration) {
            self.start_budget(options, cost);
        }
        Ok(())
    }

    /// [`Scope::Host`]: excludes allocbpf itself, attaches every image in use and (with
    /// a budget) measures the cost of a probe hit.
    fn attach_host(&mut self) -> Result<(), CollectError> {
        let started = Instant::now();
        let me = std::process::id();
        self.kernel().set_gate(me, GateState::Excluded)?;
        let budget = self.options.budget;
        // The unprobed cost of the calibration loop, before anything is attached.
        let baseline = match budget {
            Some(_) => {
                let mut runs = Vec::new();
                for _ in 0..3 {
                    runs.push(self.calibration_run(GateState::Open)?);
                }
                allocbpf_profile::estimate::median(&runs)
            }
            None => 0.0,
        };
        // Our own libc is the host's: attach it whatever the filters say, so the
        // calibration below measures a real probe.
        self.attach_images_of(me, &procfs::read_maps(me));
        self.scan_all();
        if self.stats.images_attached == 0 {
            return Err(CollectError::NoImage);
        }
        if let Some(options) = budget {
            let cost = self.calibrate(baseline)?;
            self.start_budget(options, cost);
        }
        tracing::debug!("attached the host in {:?}", started.elapsed());
        Ok(())
    }

    /// Starts the overhead budget with a measured hit cost: every image probed full
    /// time until the first check says otherwise.
    pub(super) fn start_budget(&mut self, options: BudgetOptions, cost: HitCost) {
        let budget = BudgetController::new(options, cost, self.scope.pid().is_some());
        tracing::info!(
            "overhead budget: {:.1}% of a CPU per process, {:.2} CPUs for the host; a probe hit costs {:.0} ns, {:.0} ns more where the probed instruction is single-stepped; windows per {:.1}s period",
            options.process_cpu * 100.0,
            budget.host_cpu(),
            cost.hit_ns,
            cost.stepped_extra_ns,
            options.period.as_secs_f64(),
        );
        self.budget = Some(budget);
        // Windows in every period until moving probes is found to cost more.
        self.stats.budget_periods_with_windows_percent = 100;
    }
}
