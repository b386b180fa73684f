//! When a ring-buffer record wakes the reader.
//!
//! With flags 0 the kernel wakes the reader for a record whenever the reader has
//! consumed everything before it, which for a reader that keeps up is every record. A
//! wakeup (an irq_work, then waking the agent's thread, often on the other CPU) is
//! paid by the traced thread: ~10 us per sample measured here (mimalloc's `pvalloc`
//! at 512 KiB samples one call in 128 and cost 70-80 ns more per call with a wakeup
//! per record than without; docs/benchmarks.md; docs/design.md, "Ring-buffer wakeups").
//!
//! So a record wakes the reader only if no record on this CPU did in the last
//! [`RING_WAKEUP_INTERVAL_NS`]; the others are left for the reader to find, which it
//! does at that wakeup's read or at its own poll (`RING_POLL_EVERY` in userspace,
//! 50 ms). The first record after a quiet interval still wakes at once, so a
//! short-lived process's first sample reaches userspace while its maps are readable.
//! And a record always wakes the reader once a quarter of the ring is waiting: under a
//! flood (thousands of samples per millisecond) the ring would otherwise fill between
//! two wakeups of a reader that has caught up and sleeps.

use allocbpf_common::RING_WAKEUP_INTERVAL_NS;
use aya_ebpf::{
    bindings::{BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP, BPF_RB_RING_SIZE},
    macros::map,
    maps::PerCpuArray,
};

use crate::EVENTS;

/// When this CPU's records last woke the reader (`bpf_ktime_get_ns`).
#[map]
static LAST_WAKEUP: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// The flags for submitting a record written at `now_ns`.
#[inline(always)]
pub(crate) fn wakeup_flags(now_ns: u64) -> u64 {
    let Some(last) = LAST_WAKEUP.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: a per-CPU slot; a program runs to completion on its CPU, so nothing else
    // touches it meanwhile.
    unsafe {
        if now_ns.wrapping_sub(*last) < RING_WAKEUP_INTERVAL_NS {
            let waiting = EVENTS.query(BPF_RB_AVAIL_DATA as u64);
            let size = EVENTS.query(BPF_RB_RING_SIZE as u64);
            if waiting < size / 4 {
                return BPF_RB_NO_WAKEUP as u64;
            }
        }
        *last = now_ns;
    }
    // Forced: after records that did not wake it, the reader is behind, and the
    // default (wake only a reader that is caught up) would not wake it.
    BPF_RB_FORCE_WAKEUP as u64
}
