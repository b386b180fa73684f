//! The ring-buffer records: what the eBPF program sends and userspace decodes.

use crate::{
    python::{PythonFrameRecord, MAX_PYTHON_FRAMES},
    MAX_STACK_DEPTH,
};

/// Set in [`SampleEvent::flags`] when the allocation was at least the large-allocation
/// threshold and was therefore recorded with probability 1 (heapprofd's shortcut).
pub const SAMPLE_FLAG_CERTAIN: u32 = 1;

/// Set in [`SampleEvent::flags`] when the record ends with a [`PythonStack`] (samples
/// of registered Python processes only: the others do not carry its bytes).
pub const SAMPLE_FLAG_PYTHON: u32 = 2;

/// `SampleEvent::flags`: the probe sat inside the allocating function (an inlined
/// allocator's site), not at a function's entry: the sampled instruction's own function
/// is a frame of the stack (`caller` is that instruction's address plus one, read as a
/// return address), and `[sp]` is no return address.
pub const SAMPLE_FLAG_INLINED: u32 = 4;

/// `SampleEvent::flags`: the record ends with a [`JavaCapture`](crate::java::JavaCapture)
/// (samples of a registered JVM's Java heap: the record has no native stack).
pub const SAMPLE_FLAG_JAVA: u32 = 8;

/// The interpreter frames of a sampled thread: the last bytes of a sample record whose
/// flags have [`SAMPLE_FLAG_PYTHON`].
#[repr(C)]
#[derive(Clone, Copy)]
pub struct PythonStack {
    /// A [`PythonStatus`](crate::python::PythonStatus).
    pub status: u32,
    /// Valid records in `frames`.
    pub len: u32,
    /// Innermost first.
    pub frames: [PythonFrameRecord; MAX_PYTHON_FRAMES],
}

/// The first field of every ring-buffer record: which record it is.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// A [`SampleEvent`].
    Sample = 1,
    /// A [`LiveEvent`]: a tracked sampled allocation was freed (or moved by realloc).
    Freed = 2,
    /// A [`LiveEvent`]: a sampled allocation could not be tracked (the call failed, or
    /// the `LIVE` map was full); it is not part of the live heap.
    Untracked = 3,
    /// A [`ProcessEvent`]: a process called execve (system-wide mode): it may map a
    /// libc image not probed yet.
    Exec = 4,
    /// A [`ProcessEvent`]: a process's main thread exited (system-wide mode).
    Exit = 5,
    /// A [`LostSample`] (in the `LOST` ring): a sample the full `EVENTS` ring could
    /// not take, kept without its stack so that its weight still counts.
    Lost = 6,
}

/// A sample the `EVENTS` ring buffer had no room for, as written to the small `LOST`
/// ring: what the estimator needs (size, offset, rate, epoch, time), without a stack.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LostSample {
    /// [`EventKind::Lost`].
    pub kind: u32,
    /// The epoch the call was counted in (low 32 bits; [`EpochCounts`](crate::EpochCounts)).
    pub epoch: u32,
    /// As [`SampleEvent::sample_id`].
    pub sample_id: u64,
    /// `bpf_ktime_get_ns()` at the probe (CLOCK_MONOTONIC).
    pub timestamp_ns: u64,
    /// Requested size in bytes.
    pub size: u64,
    /// As [`SampleEvent::offset`].
    pub offset: u64,
    /// Mean sampling interval in bytes that was in force.
    pub rate: u64,
    /// Process id (tgid).
    pub pid: u32,
    /// Thread id.
    pub tid: u32,
    /// Which [`AllocFn`](crate::AllocFn) was called.
    pub alloc_fn: u32,
    /// `SAMPLE_FLAG_*` bits.
    pub flags: u32,
}

/// A process starting a new program or ending, as written to the ring buffer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcessEvent {
    /// [`EventKind::Exec`] or [`EventKind::Exit`].
    pub kind: u32,
    /// Process id (tgid).
    pub pid: u32,
    /// `bpf_ktime_get_ns()` at the event.
    pub timestamp_ns: u64,
}

/// A change in a sampled allocation's life (live tracking), as written to the ring buffer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct LiveEvent {
    /// An [`EventKind`] discriminant.
    pub kind: u32,
    /// Process id (tgid).
    pub pid: u32,
    /// The sample's id ([`SampleEvent::sample_id`]).
    pub sample_id: u64,
    /// `bpf_ktime_get_ns()` at the free.
    pub timestamp_ns: u64,
}

/// One sampled allocation, as written to the ring buffer.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct SampleEvent {
    /// [`EventKind::Sample`].
    pub kind: u32,
    /// The epoch the call was counted in (low 32 bits; [`EpochCounts`](crate::EpochCounts)).
    pub epoch: u32,
    /// Unique per session: identifies the sample in later [`LiveEvent`]s.
    pub sample_id: u64,
    /// `bpf_ktime_get_ns()` at the probe (CLOCK_MONOTONIC).
    pub timestamp_ns: u64,
    /// Requested size in bytes.
    pub size: u64,
    /// Bytes of the allocation that fell before the sampling point (the .NET document's
    /// `offset`); `size - offset` is its `u_i`. Zero for certain samples.
    pub offset: u64,
    /// Mean sampling interval in bytes that was in force.
    pub rate: u64,
    /// The countdown drawn for the thread's next sample (0 for certain samples). It lets
    /// tests check the kernel's picks from the interval table (law, independence).
    pub next_interval: u64,
    /// The return address at `[sp]` on function entry: the immediate caller, which a
    /// frame-pointer walk from a function-entry probe misses. Zero if unreadable.
    pub caller: u64,
    /// Process id (tgid).
    pub pid: u32,
    /// Thread id.
    pub tid: u32,
    /// Which [`AllocFn`](crate::AllocFn) was called.
    pub alloc_fn: u32,
    /// `SAMPLE_FLAG_*` bits.
    pub flags: u32,
    /// Valid frames in `stack`; 0 when the stack could not be read.
    pub stack_len: u32,
    /// The negative errno from `bpf_get_stack` when `stack_len` is 0, else 0.
    pub stack_error: i32,
    /// Userspace unwinding: bytes of user stack copied after this header (from `regs[1]`
    /// up), 0 otherwise.
    pub user_stack_len: u32,
    /// Reserved; keeps the layout free of implicit padding.
    pub reserved2: u32,
    /// Userspace unwinding: `ip`, `sp`, `bp` at the probe, what the unwinder starts from.
    pub regs: [u64; 3],
    /// User stack from `bpf_get_stack(BPF_F_USER_STACK)`: `stack[0]` is the probed
    /// function itself, then return addresses found through frame pointers.
    pub stack: [u64; MAX_STACK_DEPTH],
}
