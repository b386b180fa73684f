//! Per-thread state (countdown and exact totals): its slot or overflow entry, and the
//! per-process fallback totals of calls counted without one.

use core::ptr::read_volatile;

use allocbpf_common::{drawn_scale, Counter, EpochCounts, ProcessCounts, ThreadState};
use aya_ebpf::bindings::BPF_NOEXIST;

use crate::{bump_in, pressure, PROCESS_TOTALS, THREADS, THREAD_SLOTS, THREAD_SLOT_MASK};

/// Adds one call to a process's fallback totals, creating the entry if needed.
#[inline(always)]
pub(crate) fn add_process_totals(pid: u32, epoch: u64, bytes: u64) -> bool {
    if PROCESS_TOTALS.get_ptr_mut(&pid).is_none() {
        // BPF_NOEXIST: a racing creator wins and we add to its entry below.
        let _ = PROCESS_TOTALS.insert(&pid, &ProcessCounts::default(), BPF_NOEXIST as u64);
    }
    let Some(totals) = PROCESS_TOTALS.get_ptr_mut(&pid) else {
        bump_in(epoch, Counter::ProcessMapFull);
        return false;
    };
    // SAFETY: this CPU's slot of a live map value; programs do not migrate while running.
    EpochCounts::add(unsafe { &mut (*totals).halves }, epoch, 1, bytes);
    true
}

/// The `THREAD_SLOTS` slot that thread `tid` maps to (whoever holds it).
#[inline(always)]
pub(crate) fn slot_of(tid: u32) -> Option<&'static mut ThreadState> {
    let index = tid & unsafe { read_volatile(&THREAD_SLOT_MASK) };
    // SAFETY: array values live as long as the map; a slot is only written by the thread
    // that owns it (or claims it while it is free).
    THREAD_SLOTS
        .get_ptr_mut(index)
        .map(|slot| unsafe { &mut *slot })
}

/// This thread's state: its slot, claimed if free, else its overflow-map entry, created
/// if needed. `None` only when the slot is taken and the overflow map is full.
#[inline(always)]
pub(crate) fn thread_state(
    pid: u32,
    tid: u32,
    level: u32,
    window: u32,
) -> Option<&'static mut ThreadState> {
    let fresh = || ThreadState {
        remaining: pressure::interval_at(level, window),
        level: drawn_scale(level, window),
        pid,
        tid,
        ..ThreadState::default()
    };
    if let Some(slot) = slot_of(tid) {
        if slot.tid == tid && slot.exited == 0 {
            return Some(slot);
        }
        if slot.tid == 0 {
            // A freed slot keeps the last holder's `exited` (userspace frees it frozen):
            // cleared before our tid lands, so that a scan seeing our tid never takes
            // the slot for frozen and frees it under us.
            // SAFETY: a field of the slot, which a free slot has no other writer of.
            unsafe { core::ptr::write_volatile(&mut slot.exited, 0) };
            core::sync::atomic::compiler_fence(core::sync::atomic::Ordering::SeqCst);
            *slot = fresh();
            return Some(slot);
        }
    }
    if let Some(state) = THREADS.get_ptr_mut(&tid) {
        // SAFETY: only this thread touches its entry; it is frozen at its exit. A frozen
        // entry of an earlier thread with this tid (not collected yet) is not ours.
        let state = unsafe { &mut *state };
        return (state.exited == 0).then_some(state);
    }
    THREADS.insert(&tid, &fresh(), BPF_NOEXIST as u64).ok()?;
    // SAFETY: as above.
    THREADS
        .get_ptr_mut(&tid)
        .map(|state| unsafe { &mut *state })
}

/// This thread's state if it has one (no slot is claimed, no entry created).
#[inline(always)]
pub(crate) fn existing_thread_state(tid: u32) -> Option<&'static mut ThreadState> {
    if let Some(slot) = slot_of(tid) {
        if slot.tid == tid && slot.exited == 0 {
            return Some(slot);
        }
    }
    // SAFETY: only this thread touches its entry; it is frozen at its exit.
    THREADS
        .get_ptr_mut(&tid)
        .map(|state| unsafe { &mut *state })
        .filter(|state| state.exited == 0)
}
