//! The timeline of one process: what it allocated in each stretch of time and what it
//! held at its end, with the stacks that held memory at the peak (memray's high-water
//! mark), recorded while samples arrive at a bounded cost.
//!
//! Cost: at most [`MAX_POINTS`] points per process (fixed size each): when a run
//! outgrows them, adjacent points merge pairwise and the stretch each covers doubles.
//! The peak's stacks are copied when the heap in use falls back from a new high that
//! is at least [`PEAK_STEP`] above the last copy, so copies are few (a logarithm of the
//! heap's growth, not one per sample) and each costs the stacks holding memory then.
//!
//! The points' figures are [`StackStats`], so their intervals are the estimator's
//! own: an allocation point's bytes are a group of samples like a stack's; the bytes
//! in use at a point's end are the group of sampled blocks live then, whose bytes were
//! tried byte by byte like any other (liveness does not depend on the sampling), so the
//! same interval covers them (docs/statistics.md, "Timeline").

use crate::stats::{BlockWeight, StackStats};

#[cfg(test)]
mod tests;

/// Points kept per process; more merge pairwise.
pub const MAX_POINTS: usize = 240;
/// The stretch of time one point covers at first (doubled as points merge).
pub const FIRST_STRETCH_NS: u64 = 50_000_000;
/// A new high of the heap in use is copied (its stacks) only if it exceeds the last
/// copy by this factor: the stacks shown at the peak are those of a moment within this
/// factor of it.
pub const PEAK_STEP: f64 = 1.02;

/// One stretch of time of one process.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TimelinePoint {
    /// Its start: CLOCK_MONOTONIC nanoseconds while recording; in a report,
    /// nanoseconds since the report's start.
    pub start_ns: u64,
    /// Its end, alike.
    pub end_ns: u64,
    /// What was allocated in it (samples taken in it).
    pub alloc: StackStats,
    /// What was in use at its end (sampled blocks live then): `estimated_bytes` are the
    /// bytes held. All zero without live tracking.
    pub inuse: StackStats,
    /// The highest estimate of bytes in use within it.
    pub inuse_high: f64,
}

impl TimelinePoint {
    /// This point followed by `next`, as one: allocations summed, the heap in use at
    /// `next`'s end, the highest of both.
    pub fn then(mut self, next: &TimelinePoint) -> TimelinePoint {
        self.end_ns = next.end_ns;
        self.alloc.merge(&next.alloc);
        self.inuse = next.inuse;
        self.inuse_high = self.inuse_high.max(next.inuse_high);
        self
    }
}

/// Stacks kept in a copy of the peak, the largest (the rest are counted).
pub const MAX_PEAK_STACKS: usize = 50;

/// The stacks that held memory at (or within [`PEAK_STEP`] of) the peak.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PeakCopy<S> {
    /// When they were copied (same clock as the points).
    pub at_ns: u64,
    /// In use then, in all: `estimated_bytes` are the bytes held.
    pub inuse: StackStats,
    /// The stacks holding most memory then (at most [`MAX_PEAK_STACKS`]), with what
    /// each held (`estimated_bytes`: bytes held), largest first.
    pub stacks: Vec<(S, StackStats)>,
    /// Stacks that held memory then but are left out.
    pub omitted: usize,
}

impl<S> PeakCopy<S> {
    /// The copy at `at_ns` of the heap in use `inuse`, held by `stacks`: the
    /// [`MAX_PEAK_STACKS`] that held most are kept, largest first, the rest counted.
    pub fn of_largest(at_ns: u64, inuse: StackStats, mut stacks: Vec<(S, StackStats)>) -> Self {
        stacks.sort_by(|a, b| b.1.estimated_bytes.total_cmp(&a.1.estimated_bytes));
        let omitted = stacks.len().saturating_sub(MAX_PEAK_STACKS);
        stacks.truncate(MAX_PEAK_STACKS);
        PeakCopy {
            at_ns,
            inuse,
            stacks,
            omitted,
        }
    }
}

/// A finished timeline of one process.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timeline<S> {
    /// The points, oldest first, back to back.
    pub points: Vec<TimelinePoint>,
    /// True if the points' in-use figures were tracked (live tracking, observed full
    /// time).
    pub live: bool,
    /// True if the points were observed part time (an overhead budget): each is scaled
    /// up from its observation windows and has no interval of its own (one stretch
    /// holds too few windows to tell time sampling's variance; the report's total
    /// interval includes it). The heap in use is then not followed (`live` false): a
    /// block leaves the followed set when its window closes, not when it is freed.
    pub time_sampled: bool,
    /// The highest estimate of bytes in use, and when it was reached.
    pub high: Option<(u64, f64)>,
    /// The stacks at the peak (live tracking, something held).
    pub peak: Option<PeakCopy<S>>,
}

impl<S> Timeline<S> {
    /// The same timeline with its stacks mapped (stack indexes to symbolized
    /// locations) and its times made relative to `origin_ns`.
    pub fn map<T>(self, origin_ns: u64, mut stack: impl FnMut(S) -> T) -> Timeline<T> {
        let at = |ns: u64| ns.saturating_sub(origin_ns);
        Timeline {
            points: self
                .points
                .into_iter()
                .map(|p| TimelinePoint {
                    start_ns: at(p.start_ns),
                    end_ns: at(p.end_ns),
                    ..p
                })
                .collect(),
            live: self.live,
            time_sampled: self.time_sampled,
            high: self.high.map(|(ns, bytes)| (at(ns), bytes)),
            peak: self.peak.map(|peak| PeakCopy {
                at_ns: at(peak.at_ns),
                inuse: peak.inuse,
                stacks: peak
                    .stacks
                    .into_iter()
                    .map(|(s, stats)| (stack(s), stats))
                    .collect(),
                omitted: peak.omitted,
            }),
        }
    }
}

impl<S> Timeline<S> {
    /// Marks the timeline observed part time: no per-point interval, no heap in use
    /// ([`Timeline::time_sampled`]).
    pub fn observed_part_time(&mut self) {
        self.time_sampled = true;
        self.live = false;
        self.high = None;
        self.peak = None;
    }

    /// Multiplies every estimate by `factor` (a pace correction), leaving samples and
    /// observed byte weights (the intervals follow the ratio).
    pub fn scale(&mut self, factor: f64) {
        for point in &mut self.points {
            point.alloc.scale(factor);
            point.inuse.scale(factor);
            point.inuse_high *= factor;
        }
        if let Some((_, high)) = self.high.as_mut() {
            *high *= factor;
        }
        if let Some(peak) = self.peak.as_mut() {
            peak.inuse.scale(factor);
            peak.stacks
                .iter_mut()
                .for_each(|(_, stats)| stats.scale(factor));
        }
    }
}

/// Records one process's timeline as its samples and frees arrive.
#[derive(Clone, Debug)]
pub struct TimelineRecorder {
    stretch_ns: u64,
    /// The index (time / stretch) of `points[0]`.
    first: u64,
    points: Vec<TimelinePoint>,
    live: bool,
    /// In use now, in all and per stack index.
    running: StackStats,
    per_stack: Vec<StackStats>,
    high: Option<(u64, f64)>,
    /// A new high not yet copied.
    pending: bool,
    peak: Option<PeakCopy<usize>>,
}

impl TimelineRecorder {
    /// A recorder; `live`: frees are reported, so the heap in use is followed.
    pub fn new(live: bool) -> Self {
        Self {
            stretch_ns: FIRST_STRETCH_NS,
            first: 0,
            points: Vec::new(),
            live,
            running: StackStats::default(),
            per_stack: Vec::new(),
            high: None,
            pending: false,
            peak: None,
        }
    }

    /// A block of stack `stack` was sampled at `timestamp_ns` (and, live, is followed
    /// until freed).
    pub fn allocated(&mut self, stack: usize, timestamp_ns: u64, block: &BlockWeight) {
        let point = self.point_at(timestamp_ns);
        self.points[point].alloc.add_block(block);
        if !self.live {
            return;
        }
        self.running.add_block(block);
        if self.per_stack.len() <= stack {
            self.per_stack.resize(stack + 1, StackStats::default());
        }
        self.per_stack[stack].add_block(block);
        let now = self.running.estimated_bytes;
        if self.high.is_none_or(|(_, high)| now > high) {
            self.high = Some((timestamp_ns.max(self.last_start()), now));
            self.pending = true;
        }
        self.set_inuse();
    }

    /// A followed block of stack `stack` left the heap in use (freed, or no longer
    /// followed), at `timestamp_ns` if known (else now, the latest point).
    pub fn released(&mut self, stack: usize, timestamp_ns: Option<u64>, block: &BlockWeight) {
        if !self.live {
            return;
        }
        self.copy_peak();
        if let Some(ns) = timestamp_ns {
            self.point_at(ns);
        }
        self.running.remove_block(block);
        if let Some(stats) = self.per_stack.get_mut(stack) {
            stats.remove_block(block);
        }
        self.set_inuse();
    }

    /// The timeline as it stands at `now_ns` (the end of the last point).
    pub fn finish(&mut self, now_ns: u64) -> Timeline<usize> {
        self.copy_peak();
        let mut points = self.points.clone();
        // The last point ends now, unless now is not past its start (a clock read
        // before the last event's): then it keeps its stretch.
        if let Some(last) = points.last_mut().filter(|last| now_ns > last.start_ns) {
            last.end_ns = last.end_ns.min(now_ns);
        }
        Timeline {
            points,
            live: self.live,
            time_sampled: false,
            high: self.high,
            peak: self.peak.clone(),
        }
    }

    /// Renumbers per-stack figures after the aggregate renumbered its stacks
    /// (`remap[old] = new`), dropping those not kept.
    pub fn renumber(&mut self, remap: &std::collections::HashMap<usize, usize>) {
        let mut per_stack = vec![StackStats::default(); remap.len()];
        for (old, stats) in self.per_stack.drain(..).enumerate() {
            if let Some(&new) = remap.get(&old) {
                per_stack[new] = stats;
            }
        }
        self.per_stack = per_stack;
        self.peak = None;
        self.pending = false;
    }

    /// Starts afresh (a new interval), keeping the heap in use.
    pub fn restart(&mut self) {
        self.points.clear();
        self.first = 0;
        self.stretch_ns = FIRST_STRETCH_NS;
        self.high = None;
        self.peak = None;
        self.pending = false;
    }

    fn last_start(&self) -> u64 {
        self.points.last().map_or(0, |p| p.start_ns)
    }

    /// Records the heap in use now as the latest point's end figure.
    fn set_inuse(&mut self) {
        if let Some(last) = self.points.last_mut() {
            last.inuse = self.running;
            last.inuse_high = last.inuse_high.max(self.running.estimated_bytes);
        }
    }

    /// Copies the stacks in use if the heap is at a new high far enough above the last
    /// copy (before it falls, or at the end).
    fn copy_peak(&mut self) {
        if !std::mem::take(&mut self.pending) {
            return;
        }
        let now = self.running.estimated_bytes;
        if self
            .peak
            .as_ref()
            .is_some_and(|peak| now < peak.inuse.estimated_bytes * PEAK_STEP)
        {
            return;
        }
        let stacks: Vec<(usize, StackStats)> = self
            .per_stack
            .iter()
            .enumerate()
            .filter(|(_, stats)| stats.samples > 0)
            .map(|(stack, stats)| (stack, *stats))
            .collect();
        let at_ns = self.high.map_or(0, |(at, _)| at);
        self.peak = Some(PeakCopy::of_largest(at_ns, self.running, stacks));
    }

    /// The index in `points` of the point holding `timestamp_ns`, made if needed (the
    /// points between carry the heap in use forward); earlier than the first point:
    /// the first.
    fn point_at(&mut self, timestamp_ns: u64) -> usize {
        let mut index = timestamp_ns / self.stretch_ns;
        if self.points.is_empty() {
            self.first = index;
            self.push_point(index);
            return 0;
        }
        while index >= self.first + MAX_POINTS as u64 {
            self.coarsen();
            index = timestamp_ns / self.stretch_ns;
        }
        let last = self.first + self.points.len() as u64 - 1;
        for next in last + 1..=index {
            self.push_point(next);
        }
        index.saturating_sub(self.first) as usize
    }

    fn push_point(&mut self, index: u64) {
        self.points.push(TimelinePoint {
            start_ns: index * self.stretch_ns,
            end_ns: (index + 1) * self.stretch_ns,
            alloc: StackStats::default(),
            inuse: self.running,
            inuse_high: self.running.estimated_bytes,
        });
    }

    /// Doubles the stretch of every point, merging them pairwise.
    fn coarsen(&mut self) {
        self.stretch_ns *= 2;
        let new_first = self.first / 2;
        let mut merged: Vec<TimelinePoint> = Vec::with_capacity(self.points.len() / 2 + 1);
        for (i, point) in self.points.drain(..).enumerate() {
            let index = (self.first + i as u64) / 2;
            let last_index = (new_first + merged.len() as u64).checked_sub(1);
            match merged.last_mut() {
                Some(last) if last_index == Some(index) => *last = last.then(&point),
                _ => merged.push(TimelinePoint {
                    start_ns: index * self.stretch_ns,
                    end_ns: (index + 1) * self.stretch_ns,
                    ..point
                }),
            }
        }
        // The first point's stretch now begins before it: its start is the stretch's.
        self.first = new_first;
        self.points = merged;
        if let Some(last) = self.points.last_mut() {
            last.end_ns = last.start_ns + self.stretch_ns;
        }
    }
}
