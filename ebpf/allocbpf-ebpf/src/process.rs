//! System-wide mode (`TARGET_PID` 0): per-process gates and process lifecycle events.
//!
//! Every probe hit of a process is counted in its `PROCESS_GATES` entry (per CPU, so
//! without atomics); userspace turns the counts into an estimated CPU cost for the
//! overhead budget, and closes the gate of processes it must not sample (itself, those
//! filtered out, those over budget). Exec and exit events tell userspace when to look
//! for new libc images and when a process's profile is complete.

use core::ptr::read_volatile;

use allocbpf_common::{
    EventKind, GateState, ProcessEvent, ProcessGate, MAX_COARSENING, MAX_GATED_PROCESSES,
};
use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns},
    macros::{map, raw_tracepoint},
    maps::LruPerCpuHashMap,
    programs::RawTracePointContext,
};

use crate::{wakeup::wakeup_flags, COUNT_HITS, EVENTS, SELF_TGID, TARGET_PID};

/// Probe hits and sampling state per process (system-wide mode). LRU: on a host with
/// more processes than entries, the least recently allocating lose their counts (and a
/// closed gate, which userspace closes again at the next sample it drops; allocbpf's
/// own exclusion does not depend on it: `SELF_TGID`).
#[map]
static PROCESS_GATES: LruPerCpuHashMap<u32, ProcessGate> =
    LruPerCpuHashMap::with_max_entries(MAX_GATED_PROCESSES, 0);

/// True when the loader set no target pid: every process is probed.
#[inline(always)]
pub(crate) fn system_wide() -> bool {
    // SAFETY: reading a `.rodata` global the loader set (constant to the verifier).
    unsafe { read_volatile(&TARGET_PID) == 0 }
}

/// True when hits are counted in single-process mode (a budget on one process).
#[inline(always)]
fn count_hits() -> bool {
    // SAFETY: reading a `.rodata` global the loader set (constant to the verifier).
    unsafe { read_volatile(&COUNT_HITS) != 0 }
}

/// Counts one probe hit of `pid` (`stepped`: at a single-stepped instruction) and says
/// whether the hit may be sampled: `None` if not, else the process's coarsening (the
/// shift its sampling interval is raised by, `ProcessGate::coarsening`). In
/// single-process mode without a budget the verifier drops this whole path
/// (`TARGET_PID` and `COUNT_HITS` are constant); with one, the hit is counted and
/// always sampled (the kernel filters on the pid).
///
/// `own_link`: the run comes from one of the process's own links. A trap at an offset
/// both a shared link and an own link probe runs both programs, one after the other:
/// only the run of the links the gate names counts (`GateState::OwnLinks`: the own
/// ones; else the shared ones), so that every call is counted and sampled once.
#[inline(always)]
pub(crate) fn admit(pid: u32, stepped: bool, own_link: bool) -> Option<u32> {
    let wide = system_wide();
    if !wide && !count_hits() {
        return Some(0);
    }
    if PROCESS_GATES.get_ptr_mut(&pid).is_none() {
        // A racing creator on another CPU wins; the entry exists either way.
        let _ = PROCESS_GATES.insert(&pid, &ProcessGate::default(), BPF_NOEXIST as u64);
    }
    let Some(gate) = PROCESS_GATES.get_ptr_mut(&pid) else {
        // Cannot happen with an LRU map; sample rather than lose data.
        return Some(0);
    };
    // SAFETY: this CPU's copy of a live map value; programs do not migrate while running.
    let (open, coarsening) = unsafe {
        let state = (*gate).state;
        if (state == GateState::OwnLinks as u32) != own_link {
            // The other links' run of this very trap (or an own link not switched to
            // yet): counted and sampled by that run.
            return None;
        }
        (*gate).hits += 1;
        (*gate).stepped_hits += stepped as u64;
        (
            !wide || state != GateState::Excluded as u32,
            (*gate).coarsening.min(MAX_COARSENING),
        )
    };
    // allocbpf itself, whatever the LRU map did to its gate.
    // SAFETY: reading a `.rodata` global the loader set.
    let admitted = open && !(wide && pid == unsafe { read_volatile(&SELF_TGID) });
    admitted.then_some(coarsening)
}

/// Adds `ns` spent recording a sample to `pid`'s gate, where hits are counted (the
/// entry exists: `admit` made it for this very hit, unless evicted since).
#[inline(always)]
pub(crate) fn add_sample_time(pid: u32, ns: u64) {
    if !system_wide() && !count_hits() {
        return;
    }
    if let Some(gate) = PROCESS_GATES.get_ptr_mut(&pid) {
        // SAFETY: this CPU's copy of a live map value; programs do not migrate.
        unsafe { (*gate).sample_ns += ns };
    }
}

/// Sends an exec or exit event for `pid` (best effort: a full ring only delays the
/// discovery of a new image until userspace's periodic scan).
#[inline(always)]
fn emit_process_event(kind: EventKind, pid: u32) {
    // SAFETY: helper without arguments.
    let timestamp_ns = unsafe { bpf_ktime_get_ns() };
    let event = ProcessEvent {
        kind: kind as u32,
        pid,
        timestamp_ns,
    };
    let _ = EVENTS.output::<ProcessEvent>(&event, wakeup_flags(timestamp_ns));
}

/// A process replaced its program: its new libc may be an image no probe covers yet.
#[raw_tracepoint(tracepoint = "sched_process_exec")]
pub fn process_exec(_ctx: RawTracePointContext) -> i32 {
    if system_wide() {
        emit_process_event(EventKind::Exec, (bpf_get_current_pid_tgid() >> 32) as u32);
    }
    0
}

/// Called from the thread-exit tracepoint: the main thread's exit ends the process's
/// profile (its other threads are gone or going; their samples are already queued).
#[inline(always)]
pub(crate) fn on_thread_exit(pid: u32, tid: u32) {
    if system_wide() && pid == tid {
        emit_process_event(EventKind::Exit, pid);
    }
}
