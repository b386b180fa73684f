use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::aggregate::{Aggregate, SampledAllocation, StackKey};
use crate::estimate::Confidence;
use crate::frame::Frame;

use super::*;

const MS: u64 = 1_000_000;

fn key(frame: u64) -> StackKey {
    StackKey {
        pid: 1,
        frames: vec![Frame::Unknown(frame)],
    }
}

fn sample(id: u64, size: u64, at_ns: u64) -> SampledAllocation {
    SampledAllocation {
        sample_id: id,
        size,
        offset: 0,
        rate: 1,
        certain: true,
        timestamp_ns: at_ns,
        window: None,
    }
}

/// Certain samples weigh their size: the points are exact, and show where the heap
/// rose and fell; the peak's copy names the stacks held at the high.
#[test]
fn points_follow_allocation_and_the_heap_in_use() {
    let mut aggregate = Aggregate::with_live_tracking();
    aggregate.record_timeline();
    aggregate.add(key(1), &sample(1, 1000, 10 * MS));
    aggregate.add(key(2), &sample(2, 500, 60 * MS));
    aggregate.freed_at(1, 120 * MS);
    aggregate.add(key(1), &sample(3, 100, 130 * MS));
    let timeline = aggregate.timeline(200 * MS).unwrap();
    let points = &timeline.points;
    assert_eq!(points.len(), 3);
    assert_eq!((points[0].start_ns, points[0].end_ns), (0, 50 * MS));
    assert_eq!(points[0].alloc.estimated_bytes, 1000.0);
    assert_eq!(points[1].alloc.estimated_bytes, 500.0);
    assert_eq!(points[1].inuse.estimated_bytes, 1500.0);
    assert_eq!(points[2].alloc.estimated_bytes, 100.0);
    assert_eq!(points[2].inuse.estimated_bytes, 600.0);
    assert_eq!(points[2].inuse_high, 1500.0);
    assert_eq!(timeline.high, Some((60 * MS, 1500.0)));
    let peak = timeline.peak.unwrap();
    assert_eq!(peak.inuse.estimated_bytes, 1500.0);
    let held: Vec<(usize, f64)> = peak
        .stacks
        .iter()
        .map(|(s, stats)| (*s, stats.estimated_bytes))
        .collect();
    assert_eq!(held, [(0, 1000.0), (1, 500.0)]);
    assert_eq!(aggregate.stack_key(0), Some(&key(1)));
}

/// A long run keeps at most MAX_POINTS points: they merge pairwise and keep their sums.
#[test]
fn long_runs_merge_points_and_keep_their_sums() {
    let mut aggregate = Aggregate::default();
    aggregate.record_timeline();
    let n = 10 * MAX_POINTS as u64;
    for i in 0..n {
        aggregate.add(key(1), &sample(i, 10, i * FIRST_STRETCH_NS + 1));
    }
    let timeline = aggregate.timeline(n * FIRST_STRETCH_NS).unwrap();
    assert!(timeline.points.len() <= MAX_POINTS);
    assert!(timeline.points.len() > MAX_POINTS / 4);
    let sum: f64 = timeline
        .points
        .iter()
        .map(|p| p.alloc.estimated_bytes)
        .sum();
    assert_eq!(sum, 10.0 * n as f64);
    for pair in timeline.points.windows(2) {
        assert_eq!(pair[0].end_ns, pair[1].start_ns, "points are back to back");
    }
    assert!(!timeline.live && timeline.peak.is_none());
}

/// A gap of hours costs no more points than MAX_POINTS.
#[test]
fn a_long_gap_is_bounded() {
    let mut aggregate = Aggregate::default();
    aggregate.record_timeline();
    aggregate.add(key(1), &sample(1, 10, 0));
    aggregate.add(key(1), &sample(2, 10, 3600 * 1000 * MS));
    let timeline = aggregate.timeline(3600 * 1000 * MS).unwrap();
    assert!(timeline.points.len() <= MAX_POINTS);
    assert_eq!(timeline.points.last().unwrap().alloc.estimated_bytes, 10.0);
}

/// Coverage of the intervals of every point, allocated and in use, in a bursty
/// process sampled as the kernel samples (a countdown of exponential intervals; a
/// sampled allocation's offset is where the countdown ran out in it).
///
/// Each point's 95% interval should miss its truth at most 5% of the time (the
/// estimator's intervals are conservative: docs/statistics.md). Over `n` intervals the
/// misses of a correct estimator are at most Binomial(n, 0.05), mean 0.05 n and
/// standard deviation sqrt(0.0475 n): the test fails beyond the mean plus 5 of those,
/// which a correct estimator passes with probability above 1 - 3e-7 (fixed seeds
/// besides). Empty points (truth 0, interval from 0) are not counted.
#[test]
fn point_intervals_cover_their_truth_in_a_bursty_process() {
    let rate = 64 * 1024u64;
    let confidence = Confidence::DEFAULT;
    let (mut intervals, mut misses) = (0u64, 0u64);
    for seed in 0..12u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut aggregate = Aggregate::with_live_tracking();
        aggregate.record_timeline();
        // The truth: per point (index = time / stretch), bytes allocated, and the live
        // blocks (id -> (size, point of the allocation)).
        let mut allocated: Vec<f64> = Vec::new();
        let mut live: Vec<(u64, u64, bool)> = Vec::new();
        let mut inuse_at_end: Vec<f64> = Vec::new();
        let mut countdown = -(rate as f64) * (1.0 - rng.random::<f64>()).ln();
        let mut id = 0u64;
        let points = 100u64;
        for point in 0..points {
            // Bursts: most points quiet, some allocate a hundred times more.
            let calls = match rng.random_range(0..10) {
                0 => 20_000,
                1..=3 => 200,
                _ => 0,
            };
            let mut bytes = 0.0;
            for call in 0..calls {
                let size = match rng.random_range(0..100) {
                    0 => rng.random_range(20_000..200_000u64),
                    _ => rng.random_range(16..2048u64),
                };
                let at = point * FIRST_STRETCH_NS + call * FIRST_STRETCH_NS / (calls + 1);
                bytes += size as f64;
                id += 1;
                let sampled = (size as f64) > countdown;
                if sampled {
                    let offset = countdown.floor() as u64;
                    aggregate.add(
                        key(size % 7),
                        &SampledAllocation {
                            sample_id: id,
                            size,
                            offset,
                            rate,
                            certain: false,
                            timestamp_ns: at,
                            window: None,
                        },
                    );
                    countdown = -(rate as f64) * (1.0 - rng.random::<f64>()).ln();
                } else {
                    countdown -= size as f64;
                }
                live.push((id, size, sampled));
                // Frees: about half the blocks, soon after.
                if rng.random_bool(0.5) {
                    let i = rng.random_range(0..live.len());
                    let (gone, _, was_sampled) = live.swap_remove(i);
                    if was_sampled {
                        aggregate.freed_at(gone, at + 1);
                    }
                }
            }
            allocated.push(bytes);
            inuse_at_end.push(live.iter().map(|&(_, size, _)| size as f64).sum());
        }
        let timeline = aggregate.timeline(points * FIRST_STRETCH_NS).unwrap();
        let first = (timeline.points[0].start_ns / FIRST_STRETCH_NS) as usize;
        for (i, point) in timeline.points.iter().enumerate() {
            let index = first + i;
            for (truth, stats) in [
                (allocated[index], &point.alloc),
                (inuse_at_end[index], &point.inuse),
            ] {
                if truth == 0.0 {
                    continue;
                }
                let interval = stats.bytes_interval(rate, confidence);
                intervals += 1;
                misses += u64::from(truth < interval.lo || truth > interval.hi);
            }
        }
    }
    let n = intervals as f64;
    let bound = 0.05 * n + 5.0 * (0.0475 * n).sqrt();
    assert!(intervals > 1000, "{intervals} intervals");
    eprintln!("{misses} of {intervals} point intervals missed their truth (bound {bound:.0})");
    assert!(
        (misses as f64) <= bound,
        "{misses} of {intervals} intervals missed their truth (bound {bound:.0})"
    );
}
