//! Samples the `EVENTS` ring had no room for: kept, without their stacks, in a small
//! ring of their own, so that their weight still counts (under a "lost samples" stack
//! of their process) and the estimate stays unbiased through an overflow.

use allocbpf_common::{EventKind, LostSample, LOST_RING_BYTES};
use aya_ebpf::{macros::map, maps::RingBuf};

use crate::{header::Header, wakeup::wakeup_flags};

/// Lost samples ([`LostSample`]).
#[map]
static LOST: RingBuf = RingBuf::with_byte_size(LOST_RING_BYTES, 0);

/// Records a sample the `EVENTS` ring refused; false if this ring is full too.
#[inline(always)]
pub(crate) fn record(header: &Header) -> bool {
    let lost = LostSample {
        kind: EventKind::Lost as u32,
        epoch: header.epoch as u32,
        sample_id: header.sample_id,
        timestamp_ns: header.timestamp_ns,
        size: header.size,
        offset: header.offset,
        rate: header.rate,
        pid: (header.pid_tgid >> 32) as u32,
        tid: header.pid_tgid as u32,
        alloc_fn: header.kind,
        flags: header.flags,
    };
    LOST.output::<LostSample>(&lost, wakeup_flags(header.timestamp_ns))
        .is_ok()
}
