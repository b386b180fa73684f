//! Samples that stand for a chunk of bytes charged to the one object that took it: a
//! JVM's new TLAB (docs/statistics.md, "JVM").

use super::{expected_offset, weight};

/// A sample that stands for a chunk of bytes charged to the one object that took it
/// (a JVM's new TLAB: `chunk` bytes, sampled by the countdown at mean interval `rate`,
/// or with certainty), as the estimator takes it: that object's `object` bytes sampled
/// at the mean interval that gives it the chunk's unbiased weight `W = chunk / p(chunk)`.
///
/// The object that crosses a chunk's end is, in a well-mixed allocation stream, each
/// object with probability proportional to its bytes: each byte is charged with
/// probability `1 / chunk`, and sampled with `p(chunk) / chunk`, a byte sampling
/// process of mean interval `W` (docs/statistics.md, "JVM"). Taken as a sample of the
/// object at mean interval `R'` with `S / (1 - exp(-S / R')) = W`, i.e.
/// `R' = -S / ln(1 - S / W)`, its weight is `W` exactly, its object estimate `W / S`,
/// and its interval that of a sampling process of mean interval about `W`. Returns
/// `(size, offset, rate, certain)`; an object of at least `W` bytes (or not known)
/// is the chunk's weight itself, known exactly.
pub fn attributed_sample(
    chunk: u64,
    object: u64,
    rate: u64,
    certain: bool,
) -> (u64, u64, u64, bool) {
    let w = match certain {
        true => chunk as f64,
        false => weight(chunk, rate, false).bytes,
    };
    if object == 0 || object as f64 >= w {
        return (w.round() as u64, 0, 0, true);
    }
    let s = object as f64;
    let equivalent = (-s / (-s / w).ln_1p()).round() as u64;
    (
        object,
        expected_offset(object, equivalent),
        equivalent,
        false,
    )
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::estimate::{Confidence, IntervalInputs};

    /// An attributed sample's weight is its chunk's, its object estimate the chunk's
    /// weight over the object's size.
    #[test]
    fn an_attributed_sample_weighs_its_chunk() {
        for (chunk, object, rate) in [
            (2 << 20, 1040, 512 << 10),
            (65_536, 40, 4096),
            (1 << 20, 1 << 16, 1 << 19),
        ] {
            let (size, offset, equivalent, certain) = attributed_sample(chunk, object, rate, false);
            assert!(!certain && size == object && offset <= object);
            let expected = weight(chunk, rate, false).bytes;
            let got = weight(size, equivalent, false);
            assert!(
                (got.bytes / expected - 1.0).abs() < 1e-6,
                "{chunk} {object}: {} {expected}",
                got.bytes
            );
            assert!((got.objects * object as f64 / expected - 1.0).abs() < 1e-6);
        }
        // Certain chunks weigh their bytes; an object as large as its chunk is the chunk.
        let (size, _, equivalent, _) = attributed_sample(1 << 20, 100, 1, true);
        assert!((weight(size, equivalent, false).bytes / (1u64 << 20) as f64 - 1.0).abs() < 1e-6);
        assert_eq!(
            attributed_sample(4096, 8192, 1 << 30, true),
            (4096, 0, 0, true)
        );
        assert_eq!(
            attributed_sample(4096, 0, 1 << 30, true),
            (4096, 0, 0, true)
        );
    }

    /// Coverage of the intervals of attributed samples: a thread's mixed stream of
    /// 1040-byte and 40-byte objects (15% and 85%) cut into 64 KiB TLABs, each taken
    /// by the object that did not fit, sampled by a countdown at 16 KiB. Over 600 runs
    /// of 60 TLABs, each site's 95% interval must cover its share of the TLABs' bytes
    /// (the estimand: the TLABs' unused tails are charged with them) in all but a
    /// binomial 5 sd of 5% of the runs (the interval is the Poisson one, wider than the
    /// binomial law it covers).
    #[test]
    fn attributed_intervals_cover_their_sites() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(38);
        let (tlab, rate, runs, tlabs_per_run) = (65_536u64, 16_384u64, 600, 60);
        let sizes = [1040u64, 40];
        let mut misses = [0u32; 2];
        for _ in 0..runs {
            let draw = |rng: &mut rand_chacha::ChaCha8Rng| {
                (-(rate as f64) * (1.0 - rng.random::<f64>()).ln()).floor() as u64
            };
            let mut remaining = draw(&mut rng);
            // A random phase: the run starts inside a TLAB not counted.
            let mut used = rng.random_range(0..tlab);
            let (mut refills, mut counting) = (0, false);
            let mut bytes = [0u64; 2];
            let mut inputs = [IntervalInputs::default(); 2];
            while refills <= tlabs_per_run {
                let site = usize::from(rng.random_range(0..100) >= 15);
                let size = sizes[site];
                if used + size > tlab {
                    refills += 1;
                    used = 0;
                    if refills > tlabs_per_run {
                        break;
                    }
                    counting = true;
                    if remaining < tlab {
                        let (s, offset, r, certain) = attributed_sample(tlab, size, rate, false);
                        inputs[site].add(s, offset, r, certain);
                        remaining = draw(&mut rng);
                    } else {
                        remaining -= tlab;
                    }
                }
                used += size;
                if counting {
                    bytes[site] += size;
                }
            }
            let taken = (tlabs_per_run * tlab) as f64;
            let objects = (bytes[0] + bytes[1]) as f64;
            for site in 0..2 {
                let truth = bytes[site] as f64 * taken / objects;
                if !inputs[site]
                    .interval(rate, Confidence::DEFAULT)
                    .contains(truth)
                {
                    misses[site] += 1;
                }
            }
        }
        let limit = 0.05 * runs as f64 + 5.0 * (runs as f64 * 0.05 * 0.95).sqrt();
        eprintln!("misses of {runs}: {misses:?} (limit {limit:.0})");
        for (site, missed) in misses.iter().enumerate() {
            assert!(
                f64::from(*missed) < limit,
                "site {site}: {missed} misses of {runs}"
            );
        }
    }
}
