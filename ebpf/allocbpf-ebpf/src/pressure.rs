//! Sampling under ring pressure: when the reader falls behind, every thread's mean
//! sampling interval is doubled, level by level, and halved again once it has caught
//! up (docs/statistics.md, "Overload").
//!
//! The same mechanism serves time sampling: a probe whose image is observed in
//! windows only carries a window shift in its cookie, and its countdowns have mean
//! `RATE << level >> shift`, so that a process observed a small fraction of the time
//! still gets about the samples it would get probed full time.
//!
//! Why this stays unbiased: a sample carries the mean interval of the countdown it
//! ended, and a countdown drawn at one level is drawn again, fresh, at the first
//! allocation after the level changed. The level depends on the ring, never on the
//! countdown being replaced, so by memorylessness every allocation is sampled with
//! probability `1 - exp(-S/R)` for the `R` in force when it is made, and its sample's
//! weight `S / (1 - exp(-S/R))` uses that `R`.

use allocbpf_common::{
    drawn_scale, sampler::scaled_interval, MAX_PRESSURE_LEVEL, PRESSURE_LOWER_FRACTION,
    PRESSURE_LOWER_SPACING_NS, PRESSURE_RAISE_EIGHTHS, PRESSURE_RAISE_SPACING_NS,
};
use aya_ebpf::{
    bindings::{BPF_RB_AVAIL_DATA, BPF_RB_RING_SIZE},
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
    macros::map,
    maps::Array,
};

use crate::{bump, EVENTS, INTERVALS, RATE};
use allocbpf_common::{Counter, INTERVAL_TABLE_LEN};
use core::ptr::read_volatile;

/// `[0]`: the pressure level in force; `[1]`: when it last changed (ns).
#[map]
static PRESSURE: Array<u64> = Array::with_max_entries(2, 0);

/// The pressure level in force (0 when the reader keeps up). While it is up, every
/// call looks whether the reader has caught up and lowers it (at most one step per
/// `PRESSURE_LOWER_SPACING_NS`): at a high level samples are rare, and a level lowered
/// only at samples stayed up long after the reader had caught up.
#[inline(always)]
pub(crate) fn level() -> u32 {
    let Some(level) = PRESSURE.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: a live map value; a racing writer can only make the level off by a step.
    let current = unsafe { *level };
    if current == 0 {
        return 0;
    }
    if let Some(changed) = PRESSURE.get_ptr_mut(1) {
        // SAFETY: a helper without arguments; a live map value as above.
        unsafe {
            let now_ns = bpf_ktime_get_ns();
            if now_ns.wrapping_sub(*changed) >= PRESSURE_LOWER_SPACING_NS {
                let waiting = EVENTS.query(BPF_RB_AVAIL_DATA as u64);
                let size = EVENTS.query(BPF_RB_RING_SIZE as u64);
                if waiting < size / PRESSURE_LOWER_FRACTION {
                    *level = current - 1;
                    *changed = now_ns;
                    return ((current - 1) as u32).min(MAX_PRESSURE_LEVEL);
                }
            }
        }
    }
    (current as u32).min(MAX_PRESSURE_LEVEL)
}

/// Draws a countdown with mean `RATE << level >> window`: a random entry of the
/// exponential table (mean `RATE`), scaled up with random low bits so that the scaled
/// countdown is not confined to multiples of `2^level` (a 1-byte allocation must stay
/// `2^level` times less likely to be sampled, not as likely), then down by the
/// probe's window shift (`floor(floor(E)/2^w) = floor(E/2^w)`: exact).
#[inline(always)]
pub(crate) fn interval_at(level: u32, window: u32) -> u64 {
    // SAFETY: a plain helper call without arguments.
    let random = unsafe { bpf_get_prandom_u32() };
    let index = random & (INTERVAL_TABLE_LEN - 1);
    let base = match INTERVALS.get(index) {
        Some(interval) => *interval,
        // Unreachable (the index is masked); the mean keeps the sampler alive.
        None => unsafe { read_volatile(&RATE) },
    };
    scaled_interval(base, random >> 16, level, window)
}

/// Makes a countdown follow the level in force and the probe's window shift: one
/// drawn at another scale is drawn again (see the module docs for why that keeps
/// sampling unbiased).
#[inline(always)]
pub(crate) fn follow(remaining: &mut u64, drawn: &mut u32, level: u32, window: u32) {
    let scale = drawn_scale(level, window);
    if *drawn != scale {
        *remaining = interval_at(level, window);
        *drawn = scale;
    }
}

/// After a sample: raises the level if the reader has fallen behind (more than
/// `PRESSURE_RAISE_EIGHTHS` eighths of the ring waiting), lowers it once it has caught up
/// (less than `1/PRESSURE_LOWER_FRACTION`), each at most once per its spacing.
/// Racing updates from several CPUs can only move the level by one step more.
#[inline(always)]
pub(crate) fn observe_ring(now_ns: u64) {
    let waiting = EVENTS.query(BPF_RB_AVAIL_DATA as u64);
    let size = EVENTS.query(BPF_RB_RING_SIZE as u64);
    let (Some(level), Some(changed)) = (PRESSURE.get_ptr_mut(0), PRESSURE.get_ptr_mut(1)) else {
        return;
    };
    // SAFETY: live map values; a racing writer can only make the level off by a step.
    unsafe {
        let since = now_ns.wrapping_sub(*changed);
        if waiting > size / 8 * PRESSURE_RAISE_EIGHTHS {
            if *level < MAX_PRESSURE_LEVEL as u64 && since >= PRESSURE_RAISE_SPACING_NS {
                *level += 1;
                *changed = now_ns;
                bump(Counter::PressureRaises);
            }
        } else if waiting < size / PRESSURE_LOWER_FRACTION
            && *level > 0
            && since >= PRESSURE_LOWER_SPACING_NS
        {
            *level -= 1;
            *changed = now_ns;
        }
    }
}
