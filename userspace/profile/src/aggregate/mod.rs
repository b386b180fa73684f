//! Aggregation of samples per (process, stack), with each sample unbiased first, and
//! (with live tracking) the sampled blocks still live.

use std::collections::HashMap;

use crate::estimate::{
    weight,
    windows::{PeriodTotals, SampleWindow},
    IntervalInputs,
};
use crate::frame::Frame;
use crate::timeline::{Timeline, TimelineRecorder};

pub use crate::stats::{BlockWeight, StackStats};

/// What the estimator needs of one sampled allocation (the ring buffer's sample, less
/// its stack, which is the [`StackKey`] it is added under).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampledAllocation {
    /// Unique id, which live tracking's `Freed` events name.
    pub sample_id: u64,
    /// Requested bytes.
    pub size: u64,
    /// Bytes of the allocation that fell before the sampling point (the .NET document's
    /// `offset`); `size - offset` is its `u_i`. Zero for certain samples.
    pub offset: u64,
    /// Mean sampling interval in force.
    pub rate: u64,
    /// Recorded with probability 1 (at or above the certain threshold).
    pub certain: bool,
    /// CLOCK_MONOTONIC nanoseconds of the call (the age of a live block).
    pub timestamp_ns: u64,
    /// Under time sampling (an overhead budget), the window it was taken in: its byte
    /// weight is divided by the window's inclusion probability. `None`: observed full time.
    pub window: Option<SampleWindow>,
}

impl SampledAllocation {
    /// What its byte weight is multiplied by for the time it was not observed.
    fn time_weight(&self) -> f64 {
        self.window.map_or(1.0, |w| w.time_weight())
    }
}

/// A process and a normalized stack (innermost frame first).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StackKey {
    /// Process id.
    pub pid: u32,
    /// Normalized frames, innermost first.
    pub frames: Vec<Frame>,
}

/// A sampled block not known to be freed.
#[derive(Clone, Copy, Debug)]
struct LiveBlock {
    stack: usize,
    allocated_ns: u64,
    /// What it weighs.
    weight: BlockWeight,
}

/// Sampled blocks still live, grouped by stack, older than a minimum age.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LeakStats {
    /// Sampled blocks.
    pub samples: u64,
    /// Their byte weights: the estimated leaked bytes.
    pub estimated_bytes: f64,
    /// Their object weights.
    pub estimated_objects: f64,
    /// Age of the youngest block.
    pub min_age_ns: u64,
    /// Age of the oldest block.
    pub max_age_ns: u64,
}

impl LeakStats {
    /// Adds another group (stacks that symbolize alike).
    pub fn merge(&mut self, other: &LeakStats) {
        self.samples += other.samples;
        self.estimated_bytes += other.estimated_bytes;
        self.estimated_objects += other.estimated_objects;
        self.min_age_ns = self.min_age_ns.min(other.min_age_ns);
        self.max_age_ns = self.max_age_ns.max(other.max_age_ns);
    }
}

/// What live tracking saw.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct LiveCounts {
    /// Sampled blocks still live at the end.
    pub live_samples: u64,
    /// Sampled blocks seen freed.
    pub freed_samples: u64,
    /// Samples that could not be tracked (failed call, full live map): not in inuse.
    pub untracked_samples: u64,
    /// Under time sampling: blocks still live when their observation window closed,
    /// no longer followed (their frees are not seen outside windows): not in inuse.
    pub expired_samples: u64,
}

/// Samples aggregated per stack.
#[derive(Debug, Default)]
pub struct Aggregate {
    index: HashMap<StackKey, usize>,
    stacks: Vec<(StackKey, StackStats)>,
    /// All samples together.
    pub totals: StackStats,
    live: Option<HashMap<u64, LiveBlock>>,
    /// Live-tracking counts.
    pub live_counts: LiveCounts,
    /// Leak groups by stack index, filled by [`Aggregate::finish`] when leaks are asked for.
    leaks: Vec<(usize, LeakStats)>,
    /// The minimum age those groups were cut at.
    leak_min_age: Option<std::time::Duration>,
    /// Under time sampling: time-weighted bytes per period, for the total's variance.
    pub periods: PeriodTotals,
    /// Objects in use per stack as a runtime's own sampler counts them (the Go
    /// runtime's buckets): (size, sampled objects in use, rate), replaced at each read.
    runtime_in_use: HashMap<StackKey, Vec<(u64, u64, u64)>>,
    /// The timeline, when recorded ([`Aggregate::record_timeline`]).
    timeline: Option<TimelineRecorder>,
}

impl Aggregate {
    /// An aggregate that also tracks sampled blocks until they are freed.
    pub fn with_live_tracking() -> Self {
        Self {
            live: Some(HashMap::new()),
            ..Self::default()
        }
    }

    /// Records the timeline from now on (what [`Aggregate::timeline`] returns).
    pub fn record_timeline(&mut self) {
        self.timeline = Some(TimelineRecorder::new(self.live.is_some()));
    }

    /// The timeline recorded so far, ending at `now_ns` (CLOCK_MONOTONIC); `None` when
    /// not recorded. Its stacks are indexes for [`Aggregate::stack_key`].
    pub fn timeline(&mut self, now_ns: u64) -> Option<Timeline<usize>> {
        self.timeline.as_mut().map(|t| t.finish(now_ns))
    }

    /// The key of stack `index` (as the timeline names stacks).
    pub fn stack_key(&self, index: usize) -> Option<&StackKey> {
        self.stacks.get(index).map(|(key, _)| key)
    }

    /// Distinct stacks held now.
    pub fn stack_count(&self) -> usize {
        self.stacks.len()
    }

    /// True if `key` has a stack here.
    pub fn holds(&self, key: &StackKey) -> bool {
        self.index.contains_key(key)
    }

    /// Adds one sample under `key`.
    pub fn add(&mut self, key: StackKey, sample: &SampledAllocation) {
        let next = self.stacks.len();
        let stack = *self.index.entry(key.clone()).or_insert(next);
        if stack == next {
            self.stacks.push((key, StackStats::default()));
        }
        let time_weight = sample.time_weight();
        let stats = &mut self.stacks[stack].1;
        stats.add(
            sample.size,
            sample.offset,
            sample.rate,
            sample.certain,
            time_weight,
        );
        self.totals.add(
            sample.size,
            sample.offset,
            sample.rate,
            sample.certain,
            time_weight,
        );
        let w = weight(sample.size, sample.rate, sample.certain);
        if let Some(window) = sample.window {
            self.periods.add(window.period, w.bytes * time_weight);
        }
        let block = BlockWeight {
            size: sample.size,
            offset: sample.offset,
            rate: sample.rate,
            certain: sample.certain,
            time_weight,
        };
        if let Some(timeline) = self.timeline.as_mut() {
            timeline.allocated(stack, sample.timestamp_ns, &block);
        }
        if let Some(live) = self.live.as_mut() {
            live.insert(
                sample.sample_id,
                LiveBlock {
                    stack,
                    allocated_ns: sample.timestamp_ns,
                    weight: block,
                },
            );
        }
    }

    /// Adds `count` samples of `size` bytes taken by a runtime's own sampler at mean
    /// interval `rate` (the Go runtime's heap profile), under `key`. Such a sampler
    /// does not say where in each allocation its countdown ran out: each sample counts
    /// the expected offset ([`crate::estimate::expected_offset`]), which centres the
    /// interval on the estimate.
    pub fn add_counted(&mut self, key: StackKey, size: u64, rate: u64, count: u64) {
        if count == 0 {
            return;
        }
        let offset = crate::estimate::expected_offset(size, rate);
        let next = self.stacks.len();
        let stack = *self.index.entry(key.clone()).or_insert(next);
        if stack == next {
            self.stacks.push((key, StackStats::default()));
        }
        self.stacks[stack].1.add_repeated(size, offset, rate, count);
        self.totals.add_repeated(size, offset, rate, count);
    }

    /// Replaces the objects in use that a runtime's own sampler counts
    /// ([`Aggregate::add_counted`]): per stack, (size, sampled objects, rate).
    pub fn set_runtime_in_use(&mut self, in_use: HashMap<StackKey, Vec<(u64, u64, u64)>>) {
        self.runtime_in_use = in_use;
    }

    /// A tracked block died.
    pub fn freed(&mut self, sample_id: u64) {
        if self.retire(sample_id, None) {
            self.live_counts.freed_samples += 1;
        }
    }

    /// A tracked block died at `timestamp_ns` (CLOCK_MONOTONIC): the timeline places
    /// the fall of the heap in use then.
    pub fn freed_at(&mut self, sample_id: u64, timestamp_ns: u64) {
        if self.retire(sample_id, Some(timestamp_ns)) {
            self.live_counts.freed_samples += 1;
        }
    }

    /// A sample could not be tracked: it is not part of the live heap.
    pub fn untracked(&mut self, sample_id: u64) {
        if self.retire(sample_id, None) {
            self.live_counts.untracked_samples += 1;
        }
    }

    /// Drops live blocks allocated before `before_ns` (CLOCK_MONOTONIC) whose sample id
    /// `tracked` rejects: the kernel no longer tracks them, so they were freed and the
    /// `Freed` event was lost (a full ring buffer). Returns how many went.
    pub fn forget_lost_frees(&mut self, before_ns: u64, tracked: impl Fn(u64) -> bool) -> u64 {
        let Some(live) = self.live.as_mut() else {
            return 0;
        };
        let gone: Vec<u64> = live
            .iter()
            .filter(|(&id, block)| block.allocated_ns < before_ns && !tracked(id))
            .map(|(&id, _)| id)
            .collect();
        for &id in &gone {
            self.retire(id, None);
        }
        self.live_counts.freed_samples += gone.len() as u64;
        gone.len() as u64
    }

    /// Under time sampling, at the end of an observation window: the blocks sampled
    /// before `before_ns` (CLOCK_MONOTONIC) leave the live set, since their frees can
    /// no longer be seen. Returns their sample ids (counted as `expired_samples`), so
    /// the kernel's entries can go too.
    pub fn expire_live(&mut self, before_ns: u64) -> Vec<u64> {
        let Some(live) = self.live.as_mut() else {
            return Vec::new();
        };
        let expired: Vec<u64> = live
            .iter()
            .filter(|(_, block)| block.allocated_ns < before_ns)
            .map(|(&id, _)| id)
            .collect();
        for &id in &expired {
            self.retire(id, None);
        }
        self.live_counts.expired_samples += expired.len() as u64;
        expired
    }

    /// Drops a sample from the live set (and the timeline's heap in use, at
    /// `timestamp_ns` if known); false if it was not there (a lost sample).
    fn retire(&mut self, sample_id: u64, timestamp_ns: Option<u64>) -> bool {
        let Some(block) = self.live.as_mut().and_then(|live| live.remove(&sample_id)) else {
            return false;
        };
        if let Some(timeline) = self.timeline.as_mut() {
            timeline.released(block.stack, timestamp_ns, &block.weight);
        }
        true
    }

    /// Computes in-use figures per stack, and with `min_age` the leak groups: blocks
    /// still live at `now_ns` (CLOCK_MONOTONIC) and allocated at least `min_age` before.
    pub fn finish(&mut self, now_ns: u64, min_age: Option<std::time::Duration>) {
        self.add_runtime_in_use();
        for (_, stats) in &mut self.stacks {
            stats.inuse_bytes = 0.0;
            stats.inuse_objects = 0.0;
            stats.inuse_inputs = IntervalInputs::default();
            stats.inuse_observed_bytes = 0.0;
        }
        self.totals.inuse_bytes = 0.0;
        self.totals.inuse_objects = 0.0;
        self.totals.inuse_inputs = IntervalInputs::default();
        self.totals.inuse_observed_bytes = 0.0;
        self.finish_runtime_in_use();
        let Some(live) = self.live.as_ref() else {
            return;
        };
        self.live_counts.live_samples = live.len() as u64;
        let mut leaks: HashMap<usize, LeakStats> = HashMap::new();
        for block in live.values() {
            self.stacks[block.stack].1.hold(&block.weight, 1);
            self.totals.hold(&block.weight, 1);
            let age = now_ns.saturating_sub(block.allocated_ns);
            if min_age.is_some_and(|min_age| u128::from(age) >= min_age.as_nanos()) {
                let w = block.weight.observed();
                let one = LeakStats {
                    samples: 1,
                    estimated_bytes: w.bytes * block.weight.time_weight,
                    estimated_objects: w.objects * block.weight.time_weight,
                    min_age_ns: age,
                    max_age_ns: age,
                };
                leaks
                    .entry(block.stack)
                    .and_modify(|leak| leak.merge(&one))
                    .or_insert(one);
            }
        }
        self.leaks = leaks.into_iter().collect();
        self.leak_min_age = min_age;
    }

    /// Adds the objects in use by a runtime's own count to the in-use figures.
    fn finish_runtime_in_use(&mut self) {
        for (key, counted) in &self.runtime_in_use {
            let Some(&stack) = self.index.get(key) else {
                continue;
            };
            for &(size, count, rate) in counted {
                let block = BlockWeight {
                    size,
                    offset: crate::estimate::expected_offset(size, rate),
                    rate,
                    certain: false,
                    time_weight: 1.0,
                };
                self.stacks[stack].1.hold(&block, count);
                self.totals.hold(&block, count);
            }
        }
    }

    /// Gives every stack with objects in use by a runtime's count an entry (one that
    /// allocated nothing in the interval still shows what it holds).
    fn add_runtime_in_use(&mut self) {
        for key in self.runtime_in_use.keys() {
            if !self.index.contains_key(key) {
                self.index.insert(key.clone(), self.stacks.len());
                self.stacks.push((key.clone(), StackStats::default()));
            }
        }
    }

    /// Starts a new interval (the agent's periodic profiles): allocation figures start
    /// from zero, blocks still live are kept (they are the next in-use profile), and
    /// stacks that hold neither are dropped, so memory follows the live heap, not the
    /// history.
    pub fn start_interval(&mut self) {
        let old = std::mem::take(&mut self.stacks);
        self.index.clear();
        self.totals = StackStats::default();
        self.leaks.clear();
        self.live_counts.freed_samples = 0;
        self.live_counts.untracked_samples = 0;
        self.live_counts.expired_samples = 0;
        self.periods.clear();
        if let Some(timeline) = self.timeline.as_mut() {
            timeline.restart();
        }
        let Some(live) = self.live.as_mut() else {
            return;
        };
        let mut remap: HashMap<usize, usize> = HashMap::new();
        for block in live.values_mut() {
            let next = remap.len();
            let new = *remap.entry(block.stack).or_insert(next);
            block.stack = new;
        }
        if let Some(timeline) = self.timeline.as_mut() {
            timeline.renumber(&remap);
        }
        let mut kept: Vec<Option<(StackKey, StackStats)>> = vec![None; remap.len()];
        for (old_index, (key, _)) in old.into_iter().enumerate() {
            if let Some(&new) = remap.get(&old_index) {
                kept[new] = Some((key, StackStats::default()));
            }
        }
        for (new, entry) in kept.into_iter().enumerate() {
            let (key, stats) = entry.expect("every remapped stack existed");
            self.index.insert(key.clone(), new);
            self.stacks.push((key, stats));
        }
    }

    /// True if nothing was sampled this interval and no block is live.
    pub fn is_empty(&self) -> bool {
        self.stacks.is_empty() && self.runtime_in_use.is_empty()
    }

    /// The minimum age [`Aggregate::finish`] cut leaks at (`None`: no leak report).
    pub fn leak_min_age(&self) -> Option<std::time::Duration> {
        self.leak_min_age
    }

    /// True if blocks are tracked until freed.
    pub fn tracks_live(&self) -> bool {
        self.live.is_some() || !self.runtime_in_use.is_empty()
    }

    /// The stacks and their figures.
    pub fn stacks(&self) -> impl Iterator<Item = (&StackKey, &StackStats)> {
        self.stacks.iter().map(|(key, stats)| (key, stats))
    }

    /// Every stack this aggregate refers to: its stacks, and those of a runtime's
    /// count of objects in use (kept until its next read).
    pub fn keys(&self) -> impl Iterator<Item = &StackKey> {
        (self.stacks.iter().map(|(key, _)| key)).chain(self.runtime_in_use.keys())
    }

    /// Leak groups (after [`Aggregate::finish`] with a minimum age).
    pub fn leaks(&self) -> impl Iterator<Item = (&StackKey, &LeakStats)> {
        self.leaks
            .iter()
            .map(|(stack, leak)| (&self.stacks[*stack].0, leak))
    }
}

#[cfg(test)]
mod tests;
