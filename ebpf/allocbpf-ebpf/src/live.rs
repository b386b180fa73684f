//! `--live`: tracking sampled blocks from their allocation to their free.
//!
//! Only sampled allocations are tracked, so only they need their return value (the
//! block's address). With uprobe session links the entry program decides whether the
//! return runs (`RUN_RETURN`), so unsampled calls pay nothing extra. Without them every
//! call has a uretprobe (`probe_return`), which only does work for the awaited call.
//!
//! The thread's `pending_*` fields describe the awaited call. Its return is recognised
//! by registers, not by a helper (aya does not link kfuncs such as
//! `bpf_session_is_return`): after `ret`, `sp` is the entry `sp + 8` and `ip` is the
//! return address read at entry. No entry of a nested call can match both.
//!
//! Events: a tracked block that dies (free, a successful realloc) sends
//! `EventKind::Freed`; a sample that cannot be tracked (the call failed, the map is
//! full) sends `EventKind::Untracked`. Userspace keeps everything else live.

use allocbpf_common::{Counter, EventKind, LiveEvent, LiveKey, Shape, ThreadState};
use aya_ebpf::helpers::{bpf_ktime_get_ns, bpf_probe_read_user};

use crate::{
    bump,
    call::{is_return_trampoline, Now},
    python::predicted_block,
    wakeup::wakeup_flags,
    EVENTS, LIVE,
};

/// True if this program run is the return of the thread's awaited call.
///
/// Where another return probe (a uretprobe on the entry's first byte, ours in the
/// fallback mode or another tool's) hijacked the return address before our entry
/// probe read it, the entry saw the kernel's trampoline instead: then the stack
/// pointer alone identifies the return (no other probed return of this thread can
/// have it while the call is pending).
#[inline(always)]
pub(crate) fn is_awaited_return(state: &ThreadState, now: &Now) -> bool {
    state.pending_sp != 0
        && now.sp == state.pending_sp + 8
        && (now.ip == state.pending_return || is_return_trampoline(state.pending_return))
        // Read at entry; 0 means it was unreadable and nothing can match.
        && state.pending_return != 0
}

/// Entry of a counted call with live tracking on. Records what the return must do and
/// returns whether the return is needed (the caller then stores sp and return address).
#[inline(always)]
pub(crate) fn on_entry(
    state: &mut ThreadState,
    pid: u32,
    shape: Shape,
    size: u64,
    sample_id: u64,
    args: crate::CallArgs,
) -> bool {
    if matches!(
        shape,
        Shape::InPlace | Shape::JavaHeap | Shape::V8Lab | Shape::V8Large
    ) {
        // xallocx returns a size, not a block: the sampled bytes belong to a block
        // that keeps its identity, so the sample is not tracked on its own. Java and
        // JavaScript objects are freed by their garbage collectors, which no probe
        // sees.
        if sample_id != 0 {
            send(EventKind::Untracked, pid, sample_id);
        }
        return false;
    }
    let resizes = matches!(shape, Shape::Resize | Shape::ResizeArray);
    let old_tracked = resizes
        && args.old != 0
        && if size == 0 {
            // glibc's realloc(p, 0) frees p and returns NULL: the block dies now.
            free_block(pid, args.old);
            false
        } else {
            is_tracked(pid, args.old)
        };
    if sample_id == 0 && !old_tracked {
        return false;
    }
    state.pending_fn = shape as u32;
    state.pending_id = sample_id;
    state.pending_out = args.out;
    state.pending_old = if old_tracked { args.old } else { 0 };
    true
}

/// The awaited call returned `rax`.
#[inline(always)]
pub(crate) fn on_return(state: &mut ThreadState, pid: u32, rax: u64) {
    bump(Counter::LiveReturns);
    let (kind, id, out, old) = (
        state.pending_fn,
        state.pending_id,
        state.pending_out,
        state.pending_old,
    );
    state.pending_sp = 0;
    state.pending_return = 0;
    let address = if kind == Shape::PosixMemalign as u32 {
        // Returns 0 on success, the block's address went to *memptr.
        if rax == 0 {
            // SAFETY: a user-memory read through the helper; failure yields 0.
            unsafe { bpf_probe_read_user(out as *const u64) }.unwrap_or(0)
        } else {
            0
        }
    } else {
        rax
    };
    if old != 0 && address != 0 {
        // A successful realloc: the old block died, whether or not it moved.
        free_block(pid, old);
    }
    if id != 0 {
        track(pid, address, id);
    }
}

/// A sampled small object allocated at an inlined site (no return to read its block
/// from): tracked at the block its allocator is about to hand out.
#[inline(always)]
pub(crate) fn on_inlined_site(pid: u32, tid: u32, size: u64, id: u64) {
    track(pid, predicted_block(pid, tid, size).unwrap_or(0), id);
}

/// Tracks sample `id` of `pid` at block `address` (0: the block is not known).
#[inline(always)]
fn track(pid: u32, address: u64, id: u64) {
    if address == 0 {
        send(EventKind::Untracked, pid, id);
        return;
    }
    let key = live_key(pid, address);
    if let Some(previous) = LIVE.get_ptr(&key) {
        // The address was handed out again, so its previous block was freed by a path
        // we do not probe: retire it rather than leave it live forever.
        // SAFETY: valid map value pointer for this run.
        send(EventKind::Freed, pid, unsafe { *previous });
    }
    if LIVE.insert(&key, &id, 0).is_err() {
        bump(Counter::LiveMapFull);
        send(EventKind::Untracked, pid, id);
    }
}

/// True if `address` is a tracked block of `pid`.
#[inline(always)]
fn is_tracked(pid: u32, address: u64) -> bool {
    LIVE.get_ptr(&live_key(pid, address)).is_some()
}

#[inline(always)]
fn live_key(pid: u32, address: u64) -> LiveKey {
    LiveKey {
        pid,
        reserved: 0,
        address,
    }
}

/// Retires a tracked block, if `address` is one.
#[inline(always)]
pub(crate) fn free_block(pid: u32, address: u64) {
    let key = live_key(pid, address);
    let Some(id) = LIVE.get_ptr(&key) else {
        return;
    };
    // SAFETY: valid map value pointer for this run.
    let id = unsafe { *id };
    // Only the remover reports: a racing free of the same block (a double free in the
    // target) finds it gone.
    if LIVE.remove(&key).is_ok() {
        bump(Counter::LiveFrees);
        send(EventKind::Freed, pid, id);
    }
}

#[inline(always)]
fn send(kind: EventKind, pid: u32, sample_id: u64) {
    // SAFETY: a plain helper call.
    let timestamp_ns = unsafe { bpf_ktime_get_ns() };
    let event = LiveEvent {
        kind: kind as u32,
        pid,
        sample_id,
        timestamp_ns,
    };
    if EVENTS
        .output::<LiveEvent>(&event, wakeup_flags(timestamp_ns))
        .is_err()
    {
        bump(Counter::RingBufferDrops);
    }
}
