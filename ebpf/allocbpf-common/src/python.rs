//! Python frames: how the eBPF program walks a CPython thread's interpreter frames at a
//! sample, and what it sends back. The walk only follows pointers with the offsets
//! userspace put in the process's [`PythonWalk`]; what the words mean (code objects,
//! instruction pointers, entry frames) is decided in userspace, per version.

/// Most interpreter frames one sample carries (innermost first); deeper Python stacks
/// keep their innermost frames.
pub const MAX_PYTHON_FRAMES: usize = 48;

/// Most processes whose Python frames are walked at once (`PYTHON` map).
pub const MAX_PYTHON_PROCESSES: u32 = 4096;

/// An offset that is absent in this CPython version.
pub const NO_OFFSET: u32 = u32::MAX;

/// Most thread states the eBPF program looks through for a sampled thread that does not
/// hold the GIL; a process with more Python threads may get no frames for the rest.
pub const MAX_PYTHON_THREADS: usize = 32;

/// pymalloc's pool header (`struct pool_header`, the same from 3.9 on): where a pool
/// keeps the head of its free list...
pub const POOL_FREEBLOCK: u64 = 8;

/// ...and its next pool in its size class's list (a pool that is its own next is the
/// empty list's head).
pub const POOL_NEXTPOOL: u64 = 16;

/// `PyThreadState.interp` (after `prev` and `next`, the same from 3.9 on).
pub const THREAD_INTERP: u64 = 16;

/// log2 of pymalloc's size-class granularity on 64-bit builds (`ALIGNMENT_SHIFT`).
pub const PYMALLOC_ALIGNMENT_SHIFT: u64 = 4;

/// How to find and walk one process's Python frames, keyed by its pid in the `PYTHON`
/// map. Every field but `holder`, `threads_head`, `usedpools` and `interpreter` is an
/// offset in bytes, or [`NO_OFFSET`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PythonWalk {
    /// Address in the process of the pointer to the thread state holding the GIL
    /// (`_PyRuntime.gilstate.tstate_current` up to 3.11, the main interpreter's
    /// `gil->last_holder` from 3.12).
    pub holder: u64,
    /// Address in the process of the main interpreter's list of thread states
    /// (`tstate_head`, `threads.head`): where a thread that allocates without the GIL
    /// (in a C call that released it) finds its own.
    pub threads_head: u64,
    /// Address in the process of pymalloc's `usedpools` (the main interpreter's), or 0:
    /// where `--live` predicts the block an inlined small-object site is handed.
    pub usedpools: u64,
    /// Address in the process of the main interpreter (whose `usedpools` that is).
    pub interpreter: u64,
    /// `PyThreadState.next`: the next thread state in that list.
    pub thread_next: u32,
    /// `PyThreadState.native_thread_id` (3.11+): compared with the sampled thread's id,
    /// so that a thread allocating without the GIL never gets another thread's frames.
    pub thread_native_id: u32,
    /// `PyThreadState.thread_id` (the `pthread_t`, the address of libc's thread
    /// descriptor): the check before 3.11, with `pthread_tid`.
    pub thread_pthread: u32,
    /// Where libc's thread descriptor keeps the kernel thread id.
    pub pthread_tid: u32,
    /// `PyThreadState.frame` (<= 3.10), `.cframe` (3.11, 3.12), `.current_frame` (3.13+).
    pub thread_frame: u32,
    /// `_PyCFrame.current_frame` (3.11, 3.12: a second hop), else [`NO_OFFSET`].
    pub cframe_current_frame: u32,
    /// The frame's code object.
    pub frame_code: u32,
    /// The calling frame.
    pub frame_back: u32,
    /// `f_lasti` (<= 3.10), or the instruction pointer (3.11+).
    pub frame_instruction: u32,
    /// `is_entry` (3.11) or `owner` (3.12+): a byte sent with the frame.
    pub frame_owner: u32,
}

/// One interpreter frame as the eBPF program read it: unvalidated words of the target's
/// memory, which userspace checks before believing.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PythonFrameRecord {
    /// The frame's code object (or executable) pointer.
    pub code: u64,
    /// The 8 bytes at the frame's instruction field (a pointer from 3.11, an `int`
    /// `f_lasti` in the low half before).
    pub instruction: u64,
    /// The byte at `frame_owner`, 0 when the version has none.
    pub owner: u8,
    /// Reserved; keeps the layout free of implicit padding.
    pub reserved: [u8; 7],
}

/// Why a sample of a Python process carries no Python frames ([`PythonStatus`] values
/// in `SampleEvent::python_status`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PythonStatus {
    /// Not a process whose frames are walked.
    NotPython = 0,
    /// Frames were walked (possibly none: the thread runs no Python code).
    Walked = 1,
    /// No thread state names the sampled thread: neither the GIL holder's nor any of
    /// the first [`MAX_PYTHON_THREADS`] of the interpreter's list (a thread Python does
    /// not know, or one of a process with more threads).
    NotHolder = 2,
    /// A pointer on the way could not be read.
    Unreadable = 3,
}
