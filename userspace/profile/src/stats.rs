//! The aggregate's value types: the figures of a group of samples ([`StackStats`], a
//! stack's, the totals', a timeline point's) and what one sampled block weighs
//! ([`BlockWeight`]). On their own so that the timeline, which the aggregate records,
//! can sum samples without depending on the aggregate itself.

use crate::estimate::{weight, Confidence, Interval, IntervalInputs};

/// What a sampled block weighs, as [`StackStats::add`] takes it: kept with a live
/// block, so that it can leave the figures it entered.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockWeight {
    /// Requested bytes.
    pub size: u64,
    /// Bytes before the sampling point.
    pub offset: u64,
    /// Mean sampling interval it was drawn at.
    pub rate: u64,
    /// Recorded with probability 1.
    pub certain: bool,
    /// Its time weight (1 observed full time).
    pub time_weight: f64,
}

impl BlockWeight {
    /// Its unbiased weight before time weighting.
    pub(super) fn observed(&self) -> crate::estimate::Weight {
        weight(self.size, self.rate, self.certain)
    }
}

/// Estimates for one stack.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StackStats {
    /// Raw number of samples.
    pub samples: u64,
    /// Sum of the samples' unbiased byte weights.
    pub estimated_bytes: f64,
    /// Sum of the samples' unbiased object weights.
    pub estimated_objects: f64,
    /// Sum of the samples' byte weights before time weighting (equal to
    /// `estimated_bytes` when observed full time): the byte-sampling interval is
    /// computed on these and scaled up.
    pub observed_bytes: f64,
    /// What the confidence interval on `estimated_bytes` needs.
    pub interval_inputs: IntervalInputs,
    /// Byte weights of the samples still live (live tracking; filled by
    /// [`Aggregate::finish`](crate::aggregate::Aggregate::finish)).
    pub inuse_bytes: f64,
    /// Object weights of the samples still live.
    pub inuse_objects: f64,
    /// What the interval on `inuse_bytes` needs: the inputs of the samples still live
    /// (empty where in-use bytes come without them, as read back from a store).
    pub inuse_inputs: IntervalInputs,
    /// Byte weights of the samples still live before time weighting (and before a
    /// pace correction): the in-use interval is computed on these and scaled up to
    /// `inuse_bytes`, as `bytes_interval` is.
    pub inuse_observed_bytes: f64,
}

impl StackStats {
    /// Adds another stack's figures (merging stacks that symbolize alike).
    pub fn merge(&mut self, other: &StackStats) {
        self.samples += other.samples;
        self.estimated_bytes += other.estimated_bytes;
        self.estimated_objects += other.estimated_objects;
        self.observed_bytes += other.observed_bytes;
        self.interval_inputs.merge(&other.interval_inputs);
        self.inuse_bytes += other.inuse_bytes;
        self.inuse_objects += other.inuse_objects;
        self.inuse_inputs.merge(&other.inuse_inputs);
        self.inuse_observed_bytes += other.inuse_observed_bytes;
    }

    /// The confidence interval on `inuse_bytes`; `None` for in-use bytes that came
    /// without their inputs (read back from a store). The sampled blocks still live
    /// are a group like any other: their bytes were tried byte by byte, and whether a
    /// block is live does not depend on its sampling. With no sampled block live the
    /// interval still reaches up: unsampled blocks may be.
    pub fn inuse_interval(&self, rate: u64, confidence: Confidence) -> Option<Interval> {
        if self.inuse_inputs == IntervalInputs::default() && self.inuse_bytes > 0.0 {
            return None;
        }
        let interval = self.inuse_inputs.interval(rate, confidence);
        if self.inuse_observed_bytes <= 0.0 || self.inuse_bytes == self.inuse_observed_bytes {
            return Some(interval);
        }
        let scale = self.inuse_bytes / self.inuse_observed_bytes;
        Some(Interval {
            lo: interval.lo * scale,
            hi: interval.hi * scale,
        })
    }

    /// Accounts for `count` samples of `size` bytes (`offset` bytes before each sampled
    /// byte) taken at `rate`, observed full time.
    pub fn add_repeated(&mut self, size: u64, offset: u64, rate: u64, count: u64) {
        let w = weight(size, rate, false);
        let n = count as f64;
        self.samples = self.samples.saturating_add(count);
        self.estimated_bytes += w.bytes * n;
        self.estimated_objects += w.objects * n;
        self.observed_bytes += w.bytes * n;
        self.interval_inputs.add_repeated(size, offset, rate, count);
    }

    /// Accounts for one sample of `size` bytes (`offset` bytes before the sampled byte)
    /// taken at `rate`; `certain` samples were recorded with probability 1. Its weights
    /// are multiplied by `time_weight` (1 when observed full time).
    pub fn add(&mut self, size: u64, offset: u64, rate: u64, certain: bool, time_weight: f64) {
        // Unbias this sample on its own, then sum (never sum sizes, then unbias).
        let w = weight(size, rate, certain);
        self.samples += 1;
        self.estimated_bytes += w.bytes * time_weight;
        self.estimated_objects += w.objects * time_weight;
        self.observed_bytes += w.bytes;
        self.interval_inputs.add(size, offset, rate, certain);
    }

    /// [`StackStats::add`] of `block`.
    pub fn add_block(&mut self, block: &BlockWeight) {
        let b = block;
        self.add(b.size, b.offset, b.rate, b.certain, b.time_weight);
    }

    /// Takes back `block`, which [`StackStats::add_block`] accounted for (a block
    /// freed: the figures of what is still in use).
    pub fn remove_block(&mut self, block: &BlockWeight) {
        let BlockWeight {
            size,
            offset,
            rate,
            certain,
            time_weight,
        } = *block;
        let w = block.observed();
        self.samples = self.samples.saturating_sub(1);
        self.interval_inputs.remove(size, offset, rate, certain);
        if self.samples == 0 {
            // Exactly nothing, not the float residue of adding and taking back.
            self.estimated_bytes = 0.0;
            self.estimated_objects = 0.0;
            self.observed_bytes = 0.0;
        } else {
            self.estimated_bytes = (self.estimated_bytes - w.bytes * time_weight).max(0.0);
            self.estimated_objects = (self.estimated_objects - w.objects * time_weight).max(0.0);
            self.observed_bytes = (self.observed_bytes - w.bytes).max(0.0);
        }
    }

    /// Accounts for `count` sampled blocks like `block` still in use: their weights in
    /// the in-use figures, their interval inputs in those of the in-use interval.
    pub(super) fn hold(&mut self, block: &BlockWeight, count: u64) {
        let w = block.observed();
        let n = count as f64;
        self.inuse_bytes += w.bytes * block.time_weight * n;
        self.inuse_objects += w.objects * block.time_weight * n;
        self.inuse_observed_bytes += w.bytes * n;
        let inputs = &mut self.inuse_inputs;
        match block.certain {
            true => inputs.certain_bytes += block.size.saturating_mul(count),
            false => inputs.add_repeated(block.size, block.offset, block.rate, count),
        }
    }

    /// Multiplies the estimates (bytes and objects, allocated and in use) by `factor`
    /// (a pace correction), leaving samples and observed byte weights: the intervals
    /// scale with the ratio of the two.
    pub fn scale(&mut self, factor: f64) {
        self.estimated_bytes *= factor;
        self.estimated_objects *= factor;
        self.inuse_bytes *= factor;
        self.inuse_objects *= factor;
    }

    /// The confidence interval on `estimated_bytes` for byte sampling. Under time
    /// sampling it is the observed windows' interval scaled up by the mean time weight:
    /// it does not cover the time sampling ([`crate::report::Report::time_sampling`]
    /// gives the total's interval that does).
    pub fn bytes_interval(&self, rate: u64, confidence: Confidence) -> Interval {
        let interval = self.interval_inputs.interval(rate, confidence);
        if self.observed_bytes <= 0.0 || self.estimated_bytes == self.observed_bytes {
            return interval;
        }
        let scale = self.estimated_bytes / self.observed_bytes;
        Interval {
            lo: interval.lo * scale,
            hi: interval.hi * scale,
        }
    }
}
