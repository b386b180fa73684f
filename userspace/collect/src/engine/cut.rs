//! The one stop/drain/cut/report path: an interval's profiles are built from exactly
//! the calls and samples of its window, whether it is cut while probing goes on (the
//! agent) or at stop (every mode).

use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

use allocbpf_common::Totals;
use allocbpf_images::procfs;
use allocbpf_profile::report::{Counters, KernelFigures, Observed, ProcessSummary, Report};
use allocbpf_runtime::Departure;
use allocbpf_stacks::{resolve::StackResolver, symbolize::FrameSymbolizer};

use super::{
    budget_control::BudgetController, interval::IntervalEnd, Collector, ImageSet, ProcessProfile,
    Tracked, LOST_FREE_MIN_AGE,
};
use crate::{identity, kernel::Kernel, options::CollectOptions};

/// Which of the processes that had a pid in one interval (a pid reused after an exit)
/// gets the kernel's totals of that pid, which count them all: the one with most of
/// the pid's samples, the later on a tie (`position`: in the pid's departed list;
/// `None`: the process followed now). Counted once, not in each profile.
fn totals_rank(tracked: &Tracked, position: Option<usize>) -> (u64, usize) {
    (
        tracked.aggregate.totals.samples,
        position.unwrap_or(usize::MAX),
    )
}

impl Collector {
    /// Exact kernel totals and counters of `epoch`, which has ended (or, at stop, is
    /// the current one with every probe detached), after running programs are waited
    /// for. A failed read costs those figures (reported as 0, with a warning), never
    /// the samples.
    fn kernel_figures(&mut self, epoch: u64) -> (Counters, HashMap<u32, Totals>) {
        let kernel = self.kernel();
        let counters = kernel.counters_of(epoch).unwrap_or_else(|error| {
            tracing::warn!("kernel counters unavailable: {error}");
            Counters::default()
        });
        let totals = kernel.totals_of(epoch).unwrap_or_else(|error| {
            tracing::warn!("exact totals unavailable: {error}");
            HashMap::new()
        });
        (counters, totals)
    }

    /// Cuts one profile per profiled process for the interval that ends now, and starts
    /// the next; processes that exited are forgotten after their last profile. See
    /// `interval` for how the interval's records are told from the next one's.
    pub fn cut(&mut self) -> Vec<ProcessProfile> {
        let end = self.cutter.end_now();
        let ended = match self.kernel().next_epoch() {
            Ok(ended) => ended,
            Err(error) => {
                // Reading a running epoch would count its calls again at the next
                // cut: the interval stays open instead, and is cut next time.
                tracing::warn!("interval not cut, the epoch could not advance: {error}");
                return Vec::new();
            }
        };
        self.kernel().wait_for_running_programs();
        let figures = self.kernel_figures(ended);
        self.cutter.begin(ended);
        self.drain_ring();
        let profiles = self.cut_with(figures, end);
        let mut held = self.cutter.end();
        self.handle(&mut held);
        profiles
    }

    /// Builds the ended interval's profiles, forgets what exited and starts the next
    /// interval.
    fn cut_with(
        &mut self,
        figures: (Counters, HashMap<u32, Totals>),
        end: IntervalEnd,
    ) -> Vec<ProcessProfile> {
        let (profiles, gone) = self.build_profiles(figures, end);
        self.forget(gone);
        self.stats.processes_tracked = self.processes.tracked.len() as u64;
        self.cutter.restart(end);
        profiles
    }

    /// One profile per admitted process that allocated in the interval (and always the
    /// target's, in process scope), those that exited in it included (their last, under
    /// their own labels, even if a later process has their pid now); every aggregate
    /// starts its next interval. Returns the profiles and the followed processes found
    /// to have exited (those that departed before are dropped here).
    fn build_profiles(
        &mut self,
        (counters, totals): (Counters, HashMap<u32, Totals>),
        end: IntervalEnd,
    ) -> (Vec<ProcessProfile>, HashSet<u32>) {
        let IntervalEnd {
            wall: ended,
            duration,
            monotonic_ns: now_ns,
            ..
        } = end;
        let leaks_min_age = self.options.live.and_then(|l| l.leaks_min_age);
        // The one process of a process scope always gets its profile, empty or not.
        let always = self.scope.pid();
        let symbolizer = if self.options.symbolize {
            FrameSymbolizer::new()
        } else {
            FrameSymbolizer::unsymbolized()
        };
        // What the runtimes' own samplers counted up to now belongs to this interval.
        self.poll_runtimes(true);
        let symbolizing = Instant::now();
        let mut profiles = Vec::new();
        let mut gone = HashSet::new();
        self.forget_expired_blocks();
        let kernel_live = self.kernel_live_blocks();
        let settled_before = now_ns.saturating_sub(LOST_FREE_MIN_AGE.as_nanos() as u64);
        // The processes that exited in the interval (their entries dropped after this
        // cut), then those followed.
        let mut departed = std::mem::take(&mut self.processes.departed);
        let totals_owners = totals_owners(&departed, &self.processes.tracked);
        let entries = departed
            .values_mut()
            .flat_map(|list| list.iter_mut().enumerate().map(|(i, t)| (t, Some(i))))
            .chain(self.processes.tracked.values_mut().map(|t| (t, None)));
        let mut reports = Reports {
            stacks: &self.stacks,
            symbolizer,
            options: &self.options,
            counters,
            duration,
            now_ns,
        };
        for (tracked, position) in entries {
            let pid = tracked.info.pid;
            if let Some(kernel_live) = &kernel_live {
                self.stats.lost_frees += forget_lost_frees(tracked, kernel_live, settled_before);
            }
            settle_exit(tracked, self.kernel.as_deref_mut(), &self.images);
            // The window's own totals (one epoch), not a running sum; a reused pid's
            // once ([`totals_rank`]).
            let exact = match totals_owners.get(&pid) == Some(&totals_rank(tracked, position)) {
                true => totals.get(&pid).copied().unwrap_or_default(),
                false => Default::default(),
            };
            let allocated = !tracked.aggregate.is_empty() || exact.calls > 0;
            let target = always == Some(pid) && position.is_none();
            if tracked.admitted && (allocated || target) {
                tracked.aggregate.finish(now_ns, leaks_min_age);
                let observed = self
                    .budget
                    .as_ref()
                    .map(|budget| observed_of(budget, tracked, now_ns));
                // Why the one process of a process scope made no probed call, said in
                // its profile (the first: the process followed).
                let silence = self
                    .target
                    .as_ref()
                    .filter(|_| profiles.is_empty())
                    .map(|target| target.silence.to_string());
                let report = reports.report(tracked, exact, observed, silence.as_deref());
                profiles.push(ProcessProfile {
                    info: tracked.info.clone(),
                    report,
                    started: self.cutter.started,
                    ended,
                    exited: tracked.exited,
                });
            }
            tracked.aggregate.start_interval();
            tracked.observed = Default::default();
            tracked.pace.tally = Default::default();
            if tracked.exited && position.is_none() {
                gone.insert(pid);
            }
        }
        // Their kernel entries go with `untracked_exits` (unless a later process with
        // their pid is followed), their cached stacks went at their exit.
        drop(departed);
        self.log_observed(&profiles);
        log_symbolized(
            &profiles,
            always.is_some(),
            symbolizing.elapsed().as_secs_f64(),
        );
        (profiles, gone)
    }

    /// Under a budget: how much of the interval each profile observed (debug, per
    /// process part time) and in all (info), with what the probes cost now.
    fn log_observed(&self, profiles: &[ProcessProfile]) {
        let Some(budget) = &self.budget else {
            return;
        };
        let mut least = 1.0f64;
        let mut part_time = 0;
        for profile in profiles {
            let Some(time) = &profile.report.time_sampling else {
                continue;
            };
            if time.observed_fraction >= 1.0 {
                continue;
            }
            part_time += 1;
            least = least.min(time.observed_fraction);
            let cost = budget
                .costs
                .get(&profile.info.pid)
                .copied()
                .unwrap_or_default();
            let pace = time
                .pace
                .map(|pace| {
                    format!(
                        "; worked at {:.3} of its pace while probed (estimates scaled by {:.3})",
                        pace.ratio, pace.factor
                    )
                })
                .unwrap_or_default();
            tracing::debug!(
                "pid {} ({}): observed {:.2}% of the interval; ~{:.2}% of a CPU in probes now, ~{:.0}% were it probed full time{pace}",
                profile.info.pid,
                profile.info.comm_text(),
                time.observed_fraction * 100.0,
                cost.overhead_cpu * 100.0,
                cost.full_time_cpu * 100.0
            );
        }
        let overhead: f64 = budget.costs.values().map(|c| c.overhead_cpu).sum();
        tracing::info!(
            "interval: {} profile(s), {part_time} observed part time (least {:.2}%); probes cost ~{:.3} CPUs now (host budget {:.2})",
            profiles.len(),
            least * 100.0,
            overhead,
            budget.host_cpu()
        );
    }

    /// Under a budget with live tracking: removes the kernel's entries of the blocks
    /// that left the in-use set as their window closed (the `LIVE` map is bounded and
    /// host-wide: they would hold it until their process exits).
    fn forget_expired_blocks(&mut self) {
        let processes = &mut self.processes;
        let expired: HashSet<(u32, u64)> = processes
            .tracked
            .values_mut()
            .chain(processes.departed.values_mut().flatten())
            .flat_map(|tracked| {
                let pid = tracked.info.pid;
                std::mem::take(&mut tracked.expired_blocks)
                    .into_iter()
                    .map(move |id| (pid, id))
            })
            .collect();
        if let Some(kernel) = self.kernel.as_mut() {
            kernel.forget_live_blocks(&expired);
        }
    }

    /// Live tracking: the sampled blocks the kernel still tracks, by pid (`None` at
    /// stop, or without live tracking). Blocks whose Freed event was lost (a full ring)
    /// would stay live for good: those the kernel no longer tracks, allocated long
    /// enough ago that their call has returned (a sample is sent at the call, its block
    /// tracked at the return), are retired at the cut.
    fn kernel_live_blocks(&mut self) -> Option<HashMap<u32, HashSet<u64>>> {
        let kernel_live = match (&self.kernel, self.options.live.is_some()) {
            (Some(kernel), true) => Some(kernel.live_sample_ids()),
            _ => None,
        };
        if let Some(kernel_live) = &kernel_live {
            self.stats.kernel_live_blocks = kernel_live.values().map(|ids| ids.len() as u64).sum();
        }
        kernel_live
    }

    /// Forgets the processes in `gone` (exited) and, in the kernel, those and every
    /// process that exited without being followed; then lets go of the images and
    /// module files no remaining process uses.
    fn forget(&mut self, mut gone: HashSet<u32>) {
        for pid in &gone {
            self.processes.tracked.remove(pid);
            self.forget_process(*pid, Departure::Released);
        }
        // Processes never tracked are in no report, and those that departed had their
        // last: their entries go too (a pid reused since has sampled and is tracked,
        // and is left alone).
        for pid in std::mem::take(&mut self.processes.untracked_exits) {
            if !self.processes.tracked.contains_key(&pid) {
                gone.insert(pid);
            }
        }
        let Some(kernel) = self.kernel.as_mut() else {
            // At stop: everything is let go of with the collector.
            return;
        };
        // Backstop for exit events lost to a full ring: kernel entries of processes
        // neither tracked nor alive.
        let kernel_pids = kernel.kernel_pids();
        let tracked = &self.processes.tracked;
        gone.extend(
            kernel_pids
                .iter()
                .filter(|pid| !tracked.contains_key(pid) && !procfs::is_alive(**pid)),
        );
        kernel.forget_processes(&gone);
        self.stats.kernel_processes =
            kernel_pids.iter().filter(|pid| !gone.contains(pid)).count() as u64;
        self.release_unused_images();
        self.release_unreferenced();
    }

    /// Detaches everything, reads what is still in the ring buffer and cuts the last
    /// profiles: nothing collected is lost. The exact totals are read after every
    /// probe is detached and no program run is in flight, so they and the samples
    /// cover the same calls (docs/statistics.md, "One window").
    pub fn stop(mut self) -> Vec<ProcessProfile> {
        // The interval ends when stopping starts: detaching takes a while, and calls
        // made meanwhile are counted, but that is not time spent profiling.
        let end = self.cutter.end_now();
        let links = self.images.take_links();
        if let Some(kernel) = self.kernel.as_mut() {
            // Each link's close waits for a grace period once its breakpoints are out:
            // closed on a thread each, they all go at once, and stopping takes one
            // wait rather than one per link.
            // The processes' own links too (a light process beside a heavy one).
            let own = self
                .processes
                .tracked
                .values_mut()
                .flat_map(|tracked| std::mem::take(&mut tracked.own.links));
            let parts: Vec<_> = links
                .into_iter()
                .chain(own)
                .flat_map(|image| kernel.detach_later(image))
                .collect();
            std::thread::scope(|scope| {
                for part in parts {
                    scope.spawn(move || drop(part));
                }
            });
        }
        // Windows closed just before may still be closing on other threads.
        self.images
            .wait_for_detaches(std::time::Duration::from_secs(2));
        self.kernel().wait_for_running_programs();
        let epoch = self.kernel().epoch();
        let figures = self.kernel_figures(epoch);
        if let Some(mut kernel) = self.kernel.take() {
            kernel.flush_logs();
        }
        self.drain_ring();
        if self.stats.malformed_records > 0 {
            tracing::warn!(
                "{} malformed ring-buffer records skipped",
                self.stats.malformed_records
            );
        }
        if let Some(log) = self.intake.raw_samples.as_mut() {
            log.finish();
        }
        if let Some(unwinder) = &self.stacks.unwinder {
            tracing::info!(
                "unwound {} stacks in {:.6}s ({} bytes of unwind sections cached, {} files evicted)",
                unwinder.unwound,
                unwinder.elapsed.as_secs_f64(),
                unwinder.cached_bytes(),
                unwinder.evicted_files(),
            );
        }
        self.cut_with(figures, end)
    }
}

/// What the reports of one cut are built with besides each process's figures: the
/// engine's parts borrowed one by one, since the cut walks its processes mutably
/// meanwhile.
struct Reports<'a> {
    /// Resolves the stacks' frames.
    stacks: &'a StackResolver,
    /// Symbolizes them, one cache for every report of the cut.
    symbolizer: FrameSymbolizer,
    /// The sampling rate and confidence the estimates are given with.
    options: &'a CollectOptions,
    /// The kernel's counters of the interval.
    counters: Counters,
    /// How long the interval lasted.
    duration: Duration,
    /// The interval's end (CLOCK_MONOTONIC).
    now_ns: u64,
}

impl Reports<'_> {
    /// The report of `tracked` (its aggregate finished) for the interval, with its
    /// `exact` kernel totals, what the budget `observed` of it and why it was
    /// `silence`d, its timeline if recorded and its line in the processes table.
    fn report(
        &mut self,
        tracked: &mut Tracked,
        exact: Totals,
        observed: Option<Observed>,
        silence: Option<&str>,
    ) -> Report {
        let pid = tracked.info.pid;
        let now_ns = self.now_ns;
        let mut report = Report::build(
            &tracked.aggregate,
            &mut self.stacks.symbolizer(&mut self.symbolizer),
            self.options.rate,
            self.options.confidence,
            KernelFigures {
                duration: self.duration,
                exact,
                counters: self.counters,
                observed,
            },
            silence,
        );
        if let Some(timeline) = tracked.aggregate.timeline(now_ns) {
            let origin_ns = now_ns.saturating_sub(self.duration.as_nanos() as u64);
            report.add_timeline(
                pid,
                timeline,
                origin_ns,
                &tracked.aggregate,
                &mut self.stacks.symbolizer(&mut self.symbolizer),
            );
        }
        report.processes.insert(
            pid,
            ProcessSummary {
                name: tracked.info.comm_text().to_string(),
                exact_bytes: exact.bytes,
                exact_calls: exact.calls,
                observed: report.time_sampling.as_ref().map(|t| t.observed_fraction),
            },
        );
        report
    }
}

/// What the budget observed of `tracked` over the interval ending at `now_ns`: its
/// observed fraction, the periods it spans, its pace, and the share of its CPU its
/// probes took (measured while probed where it could be; else the cost estimate).
fn observed_of(budget: &BudgetController, tracked: &Tracked, now_ns: u64) -> Observed {
    let pid = tracked.info.pid;
    let last_period = budget.schedule.period_of(now_ns);
    let first_period = [
        tracked.observed.first_period,
        tracked.aggregate.periods.first(),
    ]
    .into_iter()
    .flatten()
    .min()
    .unwrap_or(last_period)
    .min(last_period);
    let tally = tracked.pace.tally;
    tracing::trace!("pid {pid}: {tally:?}");
    let probe_share = tally.trap_share().or_else(|| {
        let cost = budget.costs.get(&pid)?;
        Some(cost.full_time_cpu.min(1.0))
    });
    Observed {
        fraction: tracked.observed.fraction(),
        first_period,
        last_period,
        pace: tally.correction(),
        probe_share,
        tally,
    }
}

/// Per pid, the rank of the entry whose kernel totals its profile carries
/// ([`totals_rank`]): among the entries that departed in the interval and the one
/// followed, a reused pid's totals go to one of them only.
fn totals_owners(
    departed: &HashMap<u32, Vec<Tracked>>,
    followed: &HashMap<u32, Tracked>,
) -> HashMap<u32, (u64, usize)> {
    let mut owners: HashMap<u32, (u64, usize)> = HashMap::new();
    for (tracked, position) in departed
        .values()
        .flat_map(|list| list.iter().enumerate().map(|(i, t)| (t, Some(i))))
        .chain(followed.values().map(|t| (t, None)))
    {
        let rank = totals_rank(tracked, position);
        let owner = owners.entry(tracked.info.pid).or_insert(rank);
        *owner = rank.max(*owner);
    }
    owners
}

/// Logs how many stacks of how many samples were symbolized in `seconds`: once per run
/// for one process (info), once per interval for the agent, which logs at info (debug).
fn log_symbolized(profiles: &[ProcessProfile], one_process: bool, seconds: f64) {
    let stacks: usize = profiles.iter().map(|p| p.report.stacks.len()).sum();
    let samples: u64 = profiles.iter().map(|p| p.report.totals.samples).sum();
    match one_process {
        true => tracing::info!("symbolized {stacks} stacks of {samples} samples in {seconds:.6}s"),
        false => {
            tracing::debug!("symbolized {stacks} stacks of {samples} samples in {seconds:.6}s")
        }
    }
}

/// Forgets the sampled blocks of `tracked` that the kernel's live table no longer
/// holds (their frees were lost) among those older than `settled_before`; how many.
fn forget_lost_frees(
    tracked: &mut Tracked,
    kernel_live: &HashMap<u32, HashSet<u64>>,
    settled_before: u64,
) -> u64 {
    let known = kernel_live.get(&tracked.info.pid);
    (tracked.aggregate).forget_lost_frees(settled_before, |id| {
        known.is_some_and(|ids| ids.contains(&id))
    })
}

/// A process whose exit event was lost (full ring) is taken as exited; an exited one's
/// own links go.
fn settle_exit(tracked: &mut Tracked, kernel: Option<&mut (dyn Kernel + '_)>, images: &ImageSet) {
    let pid = tracked.info.pid;
    if !tracked.exited && !identity::is_alive(pid, tracked.info.start_time) {
        // Same outcome as its exit. A later process with its pid is not taken for it
        // (the start time differs), but its samples until now are in this profile.
        tracked.exited = true;
    }
    if let Some(kernel) = kernel.filter(|_| tracked.exited) {
        super::own_links::take_own_links(kernel, images, pid, tracked);
    }
}
