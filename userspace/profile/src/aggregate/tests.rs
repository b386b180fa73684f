use super::*;

fn key(frame: u64) -> StackKey {
    StackKey {
        pid: 1,
        frames: vec![Frame::Unknown(frame)],
    }
}

fn sample(id: u64, size: u64, rate: u64, certain: bool, at: u64) -> SampledAllocation {
    SampledAllocation {
        sample_id: id,
        size,
        offset: 0,
        rate,
        certain,
        timestamp_ns: at,
        window: None,
    }
}

/// jemalloc's example: many small samples and one huge one. Unbiasing per sample
/// keeps the small stack's estimate near its truth; unbiasing a summed size would
/// shrink it by orders of magnitude.
#[test]
fn samples_are_unbiased_before_summing() {
    let rate = 512 * 1024;
    let mut aggregate = Aggregate::default();
    for i in 0..8 {
        aggregate.add(key(1), &sample(i, 8, rate, false, 0));
    }
    aggregate.add(key(2), &sample(9, 8 << 20, rate, true, 0));
    let small = aggregate.stacks().find(|(k, _)| *k == &key(1)).unwrap().1;
    assert_eq!(small.samples, 8);
    let per_sample = weight(8, rate, false).bytes;
    assert!((small.estimated_bytes - 8.0 * per_sample).abs() < 1e-6);
    // Each 8-byte sample stands for ~rate bytes.
    assert!(small.estimated_bytes > 7.9 * rate as f64);
    assert_eq!(aggregate.totals.samples, 9);
    assert!(
        (aggregate.totals.estimated_bytes - small.estimated_bytes - (8 << 20) as f64).abs() < 1e-3
    );
}

#[test]
fn blocks_the_kernel_no_longer_tracks_are_freed_once_old_enough() {
    let mut aggregate = Aggregate::with_live_tracking();
    for (id, at) in [(1, 100), (2, 100), (3, 900)] {
        aggregate.add(key(1), &sample(id, 4096, 4096, false, at));
    }
    // The kernel still tracks 1; 2 is gone (its Freed was lost); 3 is too recent
    // to judge (its allocation may not have returned when the map was read).
    assert_eq!(aggregate.forget_lost_frees(500, |id| id == 1), 1);
    aggregate.finish(1000, None);
    assert_eq!(aggregate.live_counts.live_samples, 2);
    assert_eq!(aggregate.live_counts.freed_samples, 1);
}

#[test]
fn a_new_interval_keeps_live_blocks_only() {
    let rate = 4096;
    let mut aggregate = Aggregate::with_live_tracking();
    aggregate.add(key(1), &sample(1, 4096, rate, false, 0));
    aggregate.add(key(2), &sample(2, 4096, rate, false, 0));
    aggregate.add(key(3), &sample(3, 4096, rate, false, 0));
    aggregate.freed(2);
    aggregate.start_interval();
    // Stacks 1 and 3 hold live blocks: kept with zero allocation figures.
    assert_eq!(aggregate.stacks().count(), 2);
    assert!(aggregate.stacks().all(|(_, s)| s.samples == 0));
    aggregate.add(key(3), &sample(4, 4096, rate, false, 0));
    aggregate.freed(1);
    aggregate.finish(0, None);
    let w = weight(4096, rate, false).bytes;
    let third = aggregate.stacks().find(|(k, _)| *k == &key(3)).unwrap().1;
    assert_eq!(third.samples, 1);
    assert!((third.inuse_bytes - 2.0 * w).abs() < 1e-6);
    assert!((aggregate.totals.inuse_bytes - 2.0 * w).abs() < 1e-6);
    aggregate.start_interval();
    assert_eq!(aggregate.stacks().count(), 1);
    let mut plain = Aggregate::default();
    plain.add(key(1), &sample(1, 64, rate, false, 0));
    plain.start_interval();
    assert!(plain.is_empty());
}

#[test]
fn live_blocks_count_until_freed_and_old_ones_are_leaks() {
    let rate = 4096;
    let mut aggregate = Aggregate::with_live_tracking();
    aggregate.add(key(1), &sample(1, 4096, rate, false, 1_000));
    aggregate.add(key(1), &sample(2, 4096, rate, false, 5_000));
    aggregate.add(key(2), &sample(3, 1 << 20, rate, true, 1_000));
    aggregate.add(key(2), &sample(4, 64, rate, false, 1_000));
    aggregate.freed(3);
    aggregate.untracked(4);
    aggregate.freed(12345); // unknown ids (lost samples) are ignored
    aggregate.finish(10_000, Some(std::time::Duration::from_nanos(6_000)));
    let w = weight(4096, rate, false);
    let first = aggregate.stacks().find(|(k, _)| *k == &key(1)).unwrap().1;
    assert!((first.inuse_bytes - 2.0 * w.bytes).abs() < 1e-6);
    let second = aggregate.stacks().find(|(k, _)| *k == &key(2)).unwrap().1;
    assert_eq!(second.inuse_bytes, 0.0);
    assert_eq!(
        aggregate.live_counts,
        LiveCounts {
            live_samples: 2,
            freed_samples: 1,
            untracked_samples: 1,
            expired_samples: 0,
        }
    );
    // Only sample 1 is at least 6 us old.
    let leaks: Vec<_> = aggregate.leaks().collect();
    assert_eq!(leaks.len(), 1);
    assert_eq!(leaks[0].1.samples, 1);
    assert_eq!(leaks[0].1.max_age_ns, 9_000);
}

/// A runtime's counted samples and in-use objects (the Go runtime's heap profile):
/// weighted as ours, in use without live tracking, and never turning live tracking
/// on for the process's other samples (a cgo program's malloc samples).
#[test]
fn runtime_counts_and_in_use() {
    let rate = 524_288;
    let mut aggregate = Aggregate::default();
    aggregate.add_counted(key(1), 4096, rate, 3);
    let w = weight(4096, rate, false);
    let in_use = HashMap::from([
        (key(1), vec![(4096, 2, rate)]),
        (key(2), vec![(64, 1, rate)]),
    ]);
    aggregate.set_runtime_in_use(in_use);
    aggregate.finish(0, None);
    let stats = |a: &Aggregate, k: u64| {
        a.stacks()
            .find(|(s, _)| **s == key(k))
            .map(|(_, stats)| *stats)
            .unwrap_or_default()
    };
    assert_eq!(stats(&aggregate, 1).samples, 3);
    assert!((stats(&aggregate, 1).estimated_bytes - 3.0 * w.bytes).abs() < 1e-6);
    assert!((stats(&aggregate, 1).inuse_bytes - 2.0 * w.bytes).abs() < 1e-6);
    // A stack that only holds objects still has its entry.
    assert!(stats(&aggregate, 2).inuse_bytes > 0.0);
    // A probed sample of the same process, next interval: not tracked as live.
    aggregate.start_interval();
    aggregate.add(key(3), &sample(1, 100, 65536, false, 0));
    aggregate.set_runtime_in_use(HashMap::new());
    assert!(!aggregate.is_empty());
    aggregate.finish(0, None);
    assert_eq!(stats(&aggregate, 3).inuse_bytes, 0.0);
    assert_eq!(aggregate.live_counts.live_samples, 0);
    // Only objects in use: not empty (its profile shows what it holds).
    let mut holding = Aggregate::default();
    holding.set_runtime_in_use(HashMap::from([(key(4), vec![(64, 1, rate)])]));
    assert!(!holding.is_empty());
}
