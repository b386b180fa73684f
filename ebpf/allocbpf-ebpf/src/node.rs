//! The V8 heap of registered Node.js processes: at V8's allocation-observer step, the
//! bytes the space's linear allocation buffer handed out since the previous step, read
//! with the offsets userspace found in the process's own build (`NODE` map). A process
//! without an entry is not sampled at V8's probes: userspace registers only what it
//! checked to be V8.
//!
//! Every read is a bounded helper read of the calling process's memory; nothing read is
//! believed beyond the bounds in `allocbpf_common::node`.

use allocbpf_common::node::{V8Heap, MAX_LAB_CHUNK, MAX_LARGE_OBJECT, MAX_NODE_PROCESSES};
use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user},
    macros::map,
    maps::HashMap,
};

/// Each registered Node.js process's V8 offsets, by pid; written by userspace.
#[map]
static NODE: HashMap<u32, V8Heap> = HashMap::with_max_entries(MAX_NODE_PROCESSES, 0);

/// The calling process's V8 offsets, if it is registered.
#[inline(always)]
fn registered() -> Option<V8Heap> {
    let pid = (bpf_get_current_pid_tgid() >> 32) as u32;
    // SAFETY: a live map value, written whole by userspace.
    Some(unsafe { *NODE.get_ptr(&pid)? })
}

/// The word at `address` in the calling process.
#[inline(always)]
fn read_word(address: u64) -> Option<u64> {
    // SAFETY: a user-memory read through the helper, which faults safely.
    unsafe { bpf_probe_read_user(address as *const u64) }.ok()
}

/// The bytes a LAB step of the space (or allocator) at `space` reports: its LAB's top
/// less its start, when the step counts them (the step returns at once for a LAB not
/// set up or empty, and while the collector has observers paused moves objects of its
/// own); `None` when nothing is counted.
#[inline(always)]
pub(crate) fn lab_chunk(space: u64) -> Option<u64> {
    let heap = registered()?;
    if heap.lab == 0 {
        // A build whose LAB steps are not read (large objects only).
        return None;
    }
    if heap.gate != 0 {
        // SAFETY: a user-memory read through the helper, which faults safely.
        let reports = unsafe { bpf_probe_read_user((space + heap.gate as u64) as *const u8) };
        if reports.ok()? == 0 {
            return None;
        }
    }
    let lab = read_word(space + heap.lab as u64)?;
    let start = read_word(lab)?;
    let top = read_word(lab + 8)?;
    if top == 0 || top <= start || top - start > MAX_LAB_CHUNK {
        return None;
    }
    let owner = read_word(space + heap.heap as u64)?;
    // SAFETY: as above.
    let paused = unsafe { bpf_probe_read_user((owner + heap.pause as u64) as *const u32) };
    match paused.ok()? {
        0 => Some(top - start),
        _ => None,
    }
}

/// A large-object allocation's size as counted: its `int` argument's low half, in a
/// registered process and within V8's bound.
#[inline(always)]
pub(crate) fn large_object(size: u64) -> Option<u64> {
    registered()?;
    let size = size & 0xffff_ffff;
    (size != 0 && size < MAX_LARGE_OBJECT).then_some(size)
}
