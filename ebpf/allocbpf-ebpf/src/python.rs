//! Python frames at sample time: the sampled thread's interpreter frames, read from the
//! interpreter's heap (they are not on the copied stack), for samples of processes
//! userspace registered in `PYTHON`. Only samples pay for the walk.
//!
//! The walk believes nothing: the thread state must name the sampled thread, every
//! read is bounded, and the loops stop at `MAX_PYTHON_THREADS` thread states and
//! `MAX_PYTHON_FRAMES` frames, so a forged thread list or frame chain (a cycle, garbage
//! pointers) costs at most that many reads and yields records that userspace then
//! validates.

use core::ptr::addr_of_mut;

use allocbpf_common::{
    python::{
        PythonFrameRecord, PythonStatus, PythonWalk, MAX_PYTHON_FRAMES, MAX_PYTHON_PROCESSES,
        MAX_PYTHON_THREADS, NO_OFFSET, POOL_FREEBLOCK, POOL_NEXTPOOL, PYMALLOC_ALIGNMENT_SHIFT,
        THREAD_INTERP,
    },
    PythonStack, SampleEvent, SAMPLE_FLAG_PYTHON,
};
use aya_ebpf::{helpers::bpf_probe_read_user, macros::map, maps::HashMap};

use crate::header::Header;

/// How to walk each Python process's frames, by pid; written by userspace.
#[map]
static PYTHON: HashMap<u32, PythonWalk> = HashMap::with_max_entries(MAX_PYTHON_PROCESSES, 0);

/// The word at `address + offset` in the current process.
#[inline(always)]
fn read_word(address: u64, offset: u32) -> Option<u64> {
    // SAFETY: a user-memory read through the helper, which faults safely.
    unsafe { bpf_probe_read_user((address.wrapping_add(offset as u64)) as *const u64) }.ok()
}

/// The block pymalloc's inlined fast path is about to hand out for `size` bytes (1 to
/// 512) to thread `tid` of `pid`: the head of the free list of its size class's first
/// used pool. The thread must hold the main interpreter's GIL (it is the holder, and
/// its thread state is the main interpreter's), so no other thread takes the block
/// first and the pools are the main interpreter's. `None` when the class has no used
/// pool (a new one will serve it), when the process's `usedpools` is not known, when
/// the thread is not the main interpreter's holder (a subinterpreter's), or a read
/// fails: the sample is then not tracked.
#[inline(always)]
pub(crate) fn predicted_block(pid: u32, tid: u32, size: u64) -> Option<u64> {
    // SAFETY: a live map value, written whole by userspace.
    let walk = unsafe { &*PYTHON.get_ptr(&pid)? };
    if walk.usedpools == 0 || size == 0 {
        return None;
    }
    let holder = read_word(walk.holder, 0)?;
    if thread_id(walk, holder)? != tid
        || read_word(holder.wrapping_add(THREAD_INTERP), 0)? != walk.interpreter
    {
        return None;
    }
    let class = (size - 1) >> PYMALLOC_ALIGNMENT_SHIFT;
    let pool = read_word(walk.usedpools.wrapping_add(16 * class), 0)?;
    let next = read_word(pool.wrapping_add(POOL_NEXTPOOL), 0)?;
    if next == pool {
        return None;
    }
    let block = read_word(pool.wrapping_add(POOL_FREEBLOCK), 0)?;
    (block != 0).then_some(block)
}

/// Whether `pid`'s samples carry Python frames (a [`PythonStack`] at their end).
#[inline(always)]
pub(crate) fn is_python(pid: u32) -> bool {
    PYTHON.get_ptr(&pid).is_some()
}

/// Fills the `PythonStack` a sample record ends with for the thread that `header` names
/// (`P`: how many the record has, 0 or 1) and flags the event as carrying it.
///
/// # Safety
/// `event` and `python` must point into the same reserved, exclusively owned record.
#[inline(always)]
pub(crate) unsafe fn fill<const P: usize>(
    event: *mut SampleEvent,
    python: *mut [PythonStack; P],
    header: &Header,
) {
    if P == 1 {
        unsafe {
            walk(
                python.cast::<PythonStack>(),
                (header.pid_tgid >> 32) as u32,
                header.pid_tgid as u32,
            );
            addr_of_mut!((*event).flags).write(header.flags | SAMPLE_FLAG_PYTHON);
        }
    }
}

/// Fills `stack` with the Python frames of thread `tid` of process `pid`.
///
/// # Safety
/// `stack` must point into a reserved, exclusively owned ring-buffer record.
#[inline(always)]
unsafe fn walk(stack: *mut PythonStack, pid: u32, tid: u32) {
    let (status, len) = match PYTHON.get_ptr(&pid) {
        // SAFETY: a live map value; userspace writes it whole before the process's
        // samples can need it.
        Some(walk) => unsafe { walk_frames(stack, &*walk, tid) },
        None => (PythonStatus::NotPython, 0),
    };
    unsafe {
        addr_of_mut!((*stack).status).write(status as u32);
        addr_of_mut!((*stack).len).write(len);
    }
}

/// The thread id that thread state `tstate` names.
#[inline(always)]
fn thread_id(walk: &PythonWalk, tstate: u64) -> Option<u32> {
    let id = if walk.thread_native_id != NO_OFFSET {
        read_word(tstate, walk.thread_native_id)?
    } else {
        let pthread = read_word(tstate, walk.thread_pthread)?;
        read_word(pthread, walk.pthread_tid)?
    };
    Some(id as u32)
}

/// The thread state of `tid`: the GIL holder's (the thread running Python code, the
/// common case), else the one in the interpreter's list that names it (a thread that
/// released the GIL around a C call that allocates, such as a `ctypes` call), looked
/// for among the first [`MAX_PYTHON_THREADS`].
#[inline(always)]
fn thread_state(walk: &PythonWalk, tid: u32) -> Result<u64, PythonStatus> {
    let holder = read_word(walk.holder, 0).ok_or(PythonStatus::Unreadable)?;
    if holder != 0 && thread_id(walk, holder) == Some(tid) {
        return Ok(holder);
    }
    let mut tstate = read_word(walk.threads_head, 0).ok_or(PythonStatus::Unreadable)?;
    for _ in 0..MAX_PYTHON_THREADS {
        if tstate == 0 {
            break;
        }
        if tstate != holder && thread_id(walk, tstate) == Some(tid) {
            return Ok(tstate);
        }
        match read_word(tstate, walk.thread_next) {
            Some(next) => tstate = next,
            None => break,
        }
    }
    Err(PythonStatus::NotHolder)
}

/// Walks from the thread state to at most `MAX_PYTHON_FRAMES` frames.
///
/// # Safety
/// As [`walk`].
#[inline(always)]
unsafe fn walk_frames(stack: *mut PythonStack, walk: &PythonWalk, tid: u32) -> (PythonStatus, u32) {
    let tstate = match thread_state(walk, tid) {
        Ok(tstate) => tstate,
        Err(status) => return (status, 0),
    };
    let Some(mut frame) = read_word(tstate, walk.thread_frame) else {
        return (PythonStatus::Unreadable, 0);
    };
    if walk.cframe_current_frame != NO_OFFSET && frame != 0 {
        match read_word(frame, walk.cframe_current_frame) {
            Some(current) => frame = current,
            None => return (PythonStatus::Unreadable, 0),
        }
    }
    let mut len = 0u32;
    for index in 0..MAX_PYTHON_FRAMES {
        if frame == 0 {
            break;
        }
        let (Some(code), Some(instruction)) = (
            read_word(frame, walk.frame_code),
            read_word(frame, walk.frame_instruction),
        ) else {
            break;
        };
        let owner = if walk.frame_owner != NO_OFFSET {
            read_word(frame, walk.frame_owner).unwrap_or(0) as u8
        } else {
            0
        };
        let record = PythonFrameRecord {
            code,
            instruction,
            owner,
            reserved: [0; 7],
        };
        // SAFETY: index < MAX_PYTHON_FRAMES, inside the record.
        unsafe { addr_of_mut!((*stack).frames[index]).write(record) };
        len = index as u32 + 1;
        match read_word(frame, walk.frame_back) {
            Some(back) => frame = back,
            None => break,
        }
    }
    (PythonStatus::Walked, len)
}
