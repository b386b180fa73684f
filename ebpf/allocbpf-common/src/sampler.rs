//! The sampling decision, shared by the eBPF program and userspace simulations.
//!
//! This is the ONE implementation of the countdown: the kernel probe calls [`decide`]
//! with an interval source that picks a random entry of the `INTERVALS` map, and the
//! accuracy harness (tests/) calls it with a source that picks from a table generated
//! by the same userspace code. Simulated trials therefore exercise the kernel's logic,
//! not a re-implementation of it.

/// The sampling decision for one allocation against a thread's byte countdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Not sampled: the countdown moved on by the allocation's size.
    Skip,
    /// Sampled by the countdown. `offset` bytes of the allocation preceded the sampled
    /// byte (the .NET document's `offset`; `size - offset` is its `u`), and
    /// `next_interval` is the fresh countdown that starts after the allocation.
    Sampled {
        /// Bytes of the allocation before the sampled byte.
        offset: u64,
        /// The interval drawn for the thread's next sample.
        next_interval: u64,
    },
    /// At least the certain threshold: recorded with probability 1, countdown untouched.
    Certain,
}

/// Runs the countdown for one allocation of `size` bytes.
///
/// `remaining` counts the bytes that still fail before the next sampled byte, so an
/// allocation is sampled when `remaining < size`, and the sampled byte is byte number
/// `remaining` of it. With `remaining` drawn as `floor(Exp(mean R))` every byte is a
/// Bernoulli trial with success probability `1 - exp(-1/R)`, and an allocation of `S`
/// bytes is sampled with probability `1 - exp(-S/R)`. After a sample the rest of the
/// allocation is skipped and `next_interval()` starts a new countdown
/// (docs/statistics.md).
///
/// Allocations of at least `certain_threshold` bytes are always recorded and leave the
/// countdown alone: by memorylessness the next small allocation sees a countdown with
/// the same law either way (heapprofd's large-allocation shortcut).
#[inline(always)]
pub fn decide(
    remaining: &mut u64,
    size: u64,
    certain_threshold: u64,
    next_interval: impl FnOnce() -> u64,
) -> Decision {
    if size >= certain_threshold {
        return Decision::Certain;
    }
    if *remaining < size {
        let offset = *remaining;
        let next = next_interval();
        *remaining = next;
        Decision::Sampled {
            offset,
            next_interval: next,
        }
    } else {
        *remaining -= size;
        Decision::Skip
    }
}

/// A countdown of mean `R << level >> window` from `base`, an entry of the exponential
/// table of mean `R`: shifted up with `level` random low bits from `low_bits`, so that
/// the countdown is not confined to multiples of `2^level` (a 1-byte allocation must
/// be `2^level` times less likely to be sampled, not as likely), then down by the
/// probe's window shift (`floor(floor(E)/2^w) = floor(E/2^w)`: exact). The kernel's
/// ring-pressure levels and observation-window shifts both draw through this.
#[inline(always)]
pub fn scaled_interval(base: u64, low_bits: u32, level: u32, window: u32) -> u64 {
    let shift = level & 15;
    let low = (low_bits as u64) & ((1u64 << shift) - 1);
    ((base << shift) | low) >> (window & 15)
}

/// `nmemb * size` for calloc and reallocarray, or 0 when the call must fail.
///
/// Not `checked_mul` nor a division test: LLVM turns both into a 128-bit multiply the
/// BPF backend cannot emit. When the two bit lengths add up to at most 63 the product is
/// exact; otherwise it is at least 2^62 bytes, which no x86-64 process (47-bit address
/// space) can allocate, so the call fails.
#[inline(always)]
pub fn array_bytes(nmemb: u64, size: u64) -> u64 {
    if nmemb.leading_zeros() + size.leading_zeros() >= 65 {
        nmemb * size
    } else {
        0
    }
}

/// `pvalloc(size)` allocates whole pages: `size` rounded up to 4 KiB (x86-64's page
/// size), or 0 if that overflows.
#[inline(always)]
pub fn pvalloc_bytes(size: u64) -> u64 {
    match size.checked_add(4095) {
        Some(s) => s & !4095,
        None => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn countdown_samples_the_crossing_allocation() {
        let mut remaining = 100;
        assert_eq!(decide(&mut remaining, 60, u64::MAX, || 7), Decision::Skip);
        assert_eq!(remaining, 40);
        // Byte 40 of the next 41-byte allocation is the sampled byte.
        assert_eq!(
            decide(&mut remaining, 41, u64::MAX, || 7),
            Decision::Sampled {
                offset: 40,
                next_interval: 7
            }
        );
        assert_eq!(remaining, 7);
        // Exactly `remaining` bytes all fail.
        assert_eq!(decide(&mut remaining, 7, u64::MAX, || 9), Decision::Skip);
        assert_eq!(remaining, 0);
        assert_eq!(
            decide(&mut remaining, 1000, 1000, || unreachable!()),
            Decision::Certain
        );
        assert_eq!(remaining, 0);
    }

    #[test]
    fn array_sizes() {
        assert_eq!(array_bytes(10, 24), 240);
        assert_eq!(array_bytes(u64::MAX, 2), 0);
        // Bit lengths 32 + 31 = 63: exact. 32 + 32 = 64: treated as failing (>= 2^62).
        assert_eq!(array_bytes(1 << 31, 1 << 30), 1 << 61);
        assert_eq!(array_bytes(1 << 31, 1 << 31), 0);
        assert_eq!(pvalloc_bytes(1), 4096);
        assert_eq!(pvalloc_bytes(4096), 4096);
        assert_eq!(pvalloc_bytes(u64::MAX), 0);
    }
}
