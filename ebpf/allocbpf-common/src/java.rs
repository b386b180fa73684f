//! Java frames: what the eBPF program captures of a HotSpot thread at a sample of its
//! Java heap (a TLAB refill or an allocation outside a TLAB), for userspace to walk. The
//! program only reads the thread's last Java frame (its `JavaFrameAnchor`) with the
//! offsets userspace put in the process's [`JavaWalk`], and copies the stack from
//! there up; what the words mean (interpreted or compiled frames, methods, lines) is
//! decided in userspace, from the JVM's own `gHotSpotVMStructs` tables.

/// Most processes whose Java frames are captured at once (`JAVA` map).
pub const MAX_JAVA_PROCESSES: u32 = 4096;

/// Bytes of a Java thread's stack a sample copies, from its last Java frame up: the
/// Java frames beyond it are cut (a deep stack keeps its innermost frames).
pub const JAVA_STACK_BYTES: usize = 16384;

/// Where one process's threads keep their last Java frame, keyed by its pid in the
/// `JAVA` map: byte offsets in HotSpot's `JavaThread` and `JavaFrameAnchor`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct JavaWalk {
    /// `JavaThread::_anchor`.
    pub anchor: u32,
    /// `JavaFrameAnchor::_last_Java_sp`.
    pub last_sp: u32,
    /// `JavaFrameAnchor::_last_Java_pc`.
    pub last_pc: u32,
    /// `JavaFrameAnchor::_last_Java_fp`.
    pub last_fp: u32,
    /// `Thread::_tlab` plus `ThreadLocalAllocBuffer::_start`: where the thread's TLAB
    /// starts (a new TLAB's first object is the one that took it)...
    pub tlab_start: u32,
    /// ...and plus `ThreadLocalAllocBuffer::_top`: where its free space starts.
    pub tlab_top: u32,
    /// `JavaThread::_stack_base`: the top of the thread's stack, where a copy can stop.
    pub stack_base: u32,
}

/// What a Java capture holds ([`JavaCapture::status`]).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JavaStatus {
    /// The anchor was read and the stack copied from it.
    Captured = 0,
    /// The thread's anchor could not be read.
    AnchorUnreadable = 1,
    /// The thread has no last Java frame (an allocation made by the VM itself, outside
    /// any Java call): only the class is known.
    NoJavaFrame = 2,
    /// The stack at the anchor could not be read.
    StackUnreadable = 3,
}

/// The Java side of one sample: the last bytes of a sample record whose flags have
/// [`SAMPLE_FLAG_JAVA`](crate::SAMPLE_FLAG_JAVA).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct JavaCapture {
    /// A [`JavaStatus`].
    pub status: u32,
    /// Valid bytes in `stack`.
    pub copied: u32,
    /// The allocated object's `Klass*` (the probed call's first argument).
    pub klass: u64,
    /// A new TLAB's sample: the bytes of the object that took it (its TLAB's top less
    /// its start, right after the allocation); 0 when unreadable or outside a TLAB.
    pub object_bytes: u64,
    /// The allocating `JavaThread*`.
    pub thread: u64,
    /// The anchor's `_last_Java_sp`, `_last_Java_pc` and `_last_Java_fp`.
    pub anchor: [u64; 3],
    /// The address `stack` was copied from: one word below `_last_Java_sp`, so that the
    /// return address a compiled frame's anchor leaves out is in the copy.
    pub base: u64,
    /// The stack from `base` up.
    pub stack: [u8; JAVA_STACK_BYTES],
}
