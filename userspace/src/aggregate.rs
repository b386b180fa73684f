//! Aggregation of samples per (process, stack), with each sample unbiased first.

use std::collections::HashMap;

use crate::{
    estimate::{weight, Confidence, Interval, IntervalInputs},
    normalize::Frame,
};

/// A process and a normalized stack (innermost frame first).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StackKey {
    /// Process id.
    pub pid: u32,
    /// Normalized frames, innermost first.
    pub frames: Vec<Frame>,
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
    /// What the confidence interval on `estimated_bytes` needs.
    pub interval_inputs: IntervalInputs,
}

impl StackStats {
    /// Adds another stack's figures (merging stacks that symbolize alike).
    pub fn merge(&mut self, other: &StackStats) {
        self.samples += other.samples;
        self.estimated_bytes += other.estimated_bytes;
        self.estimated_objects += other.estimated_objects;
        self.interval_inputs.merge(&other.interval_inputs);
    }

    /// Accounts for one sample of `size` bytes (`offset` bytes before the sampled byte)
    /// taken at `rate`; `certain` samples were recorded with probability 1.
    pub fn add(&mut self, size: u64, offset: u64, rate: u64, certain: bool) {
        // Unbias this sample on its own, then sum (never sum sizes, then unbias).
        let w = weight(size, rate, certain);
        self.samples += 1;
        self.estimated_bytes += w.bytes;
        self.estimated_objects += w.objects;
        self.interval_inputs.add(size, offset, certain);
    }

    /// The confidence interval on `estimated_bytes`.
    pub fn bytes_interval(&self, rate: u64, confidence: Confidence) -> Interval {
        self.interval_inputs.interval(rate, confidence)
    }
}

/// Samples aggregated per stack.
#[derive(Debug, Default)]
pub struct Aggregate {
    stacks: HashMap<StackKey, StackStats>,
    /// All samples together.
    pub totals: StackStats,
}

impl Aggregate {
    /// Adds one sample of `size` bytes (`offset` bytes before the sampled byte) taken at
    /// `rate` (certain: recorded with probability 1).
    pub fn add(&mut self, key: StackKey, size: u64, offset: u64, rate: u64, certain: bool) {
        self.stacks
            .entry(key)
            .or_default()
            .add(size, offset, rate, certain);
        self.totals.add(size, offset, rate, certain);
    }

    /// The stacks and their figures.
    pub fn stacks(&self) -> impl Iterator<Item = (&StackKey, &StackStats)> {
        self.stacks.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(frame: u64) -> StackKey {
        StackKey {
            pid: 1,
            frames: vec![Frame::Unknown(frame)],
        }
    }

    /// jemalloc's example: many small samples and one huge one. Unbiasing per sample
    /// keeps the small stack's estimate near its truth; unbiasing a summed size would
    /// shrink it by orders of magnitude.
    #[test]
    fn samples_are_unbiased_before_summing() {
        let rate = 512 * 1024;
        let mut aggregate = Aggregate::default();
        for _ in 0..8 {
            aggregate.add(key(1), 8, 0, rate, false);
        }
        aggregate.add(key(2), 8 << 20, 0, rate, true);
        let small = aggregate.stacks().find(|(k, _)| *k == &key(1)).unwrap().1;
        assert_eq!(small.samples, 8);
        let per_sample = weight(8, rate, false).bytes;
        assert!((small.estimated_bytes - 8.0 * per_sample).abs() < 1e-6);
        // Each 8-byte sample stands for ~rate bytes.
        assert!(small.estimated_bytes > 7.9 * rate as f64);
        assert_eq!(aggregate.totals.samples, 9);
        assert!(
            (aggregate.totals.estimated_bytes - small.estimated_bytes - (8 << 20) as f64).abs()
                < 1e-3
        );
    }
}
