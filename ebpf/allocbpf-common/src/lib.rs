//! The `#[repr(C)]` types and constants shared by allocbpf's eBPF program and its
//! userspace agent.
//!
//! This is the one place where the kernel/user contract lives: map value layouts,
//! ring-buffer event layout, counter indices and the names of `.rodata` globals.
//! Both sides compile this crate, so a layout change cannot drift between them.
#![no_std]
#![deny(missing_docs)]

pub mod cookie;
mod events;
pub mod java;
pub mod node;
pub mod python;
pub mod runtime_entry;
pub mod sampler;

pub use events::{
    EventKind, LiveEvent, LostSample, ProcessEvent, PythonStack, SampleEvent, SAMPLE_FLAG_CERTAIN,
    SAMPLE_FLAG_INLINED, SAMPLE_FLAG_JAVA, SAMPLE_FLAG_PYTHON,
};

/// Number of user stack frames captured per sample by `bpf_get_stack`.
///
/// 127 is the kernel's default `perf_event_max_stack`; a deeper request fails with
/// `-EINVAL` on default-configured hosts.
pub const MAX_STACK_DEPTH: usize = 127;

/// Entries in the precomputed table of exponential intervals (a power of two so an
/// index is `random & (len - 1)`). 65,536 u64 entries = 512 KiB of kernel memory.
pub const INTERVAL_TABLE_LEN: u32 = 1 << 16;

/// Slots in the direct-mapped thread table (`THREAD_SLOTS`, indexed by
/// `tid & (THREAD_SLOTS_LEN - 1)`): an array lookup the verifier inlines, where a hash
/// lookup costs ~30 ns per call. 65,536 x 152 bytes = 9.5 MiB, memory-mapped by userspace
/// (`BPF_F_MMAPABLE`) so the exact totals are read without 65,536 system calls.
pub const THREAD_SLOTS_LEN: u32 = 1 << 16;

/// Entries in the overflow hash (`THREADS`) for threads whose slot is taken by another
/// live thread. Threads beyond both fall back to a per-CPU countdown: sampling stays
/// unbiased (the exponential is memoryless) and totals stay exact; see docs/design.md.
pub const MAX_OVERFLOW_THREADS: u32 = 16_384;

/// Maximum number of processes whose fallback totals (`PROCESS_TOTALS`) are kept.
pub const MAX_PROCESSES: u32 = 16_384;

/// Size of the sample ring buffer in bytes (a power of two multiple of the page size).
pub const RING_BUFFER_BYTES: u32 = 8 << 20;

/// Size of the sample ring buffer when samples carry stack copies (userspace
/// unwinding, ~17.5 KB per sample at the default 16 KiB): ~475 samples in flight. The
/// kernel maps the data pages twice into the reader (resident at once), so this costs
/// twice its size in the agent's RSS for good, while userspace's queue behind the
/// reader thread (up to 16 MiB) is resident only while a burst lasts; docs/operations.md
/// ("Overhead and sizing") has the measured need behind the choice.
pub const RING_BUFFER_BYTES_WITH_STACKS: u32 = 8 << 20;

/// A ring-buffer record wakes the reader only if no record on its CPU did in this many
/// nanoseconds (the others wait for the reader's next read or poll): a wakeup costs the
/// traced thread ~10 us here. Userspace polls the ring at least every 50 ms.
pub const RING_WAKEUP_INTERVAL_NS: u64 = 5_000_000;

/// Sampled allocations tracked until freed (live tracking): the `LIVE` hash map. At the
/// default 512 KiB rate this covers ~32 GiB of sampled live heap; beyond it new samples
/// are counted as untracked (`Counter::LiveMapFull`) and reported, never guessed.
pub const MAX_LIVE_SAMPLES: u32 = 1 << 16;

/// The allocation entry points allocbpf probes, across allocator families.
///
/// The discriminant is what [`SampleEvent::alloc_fn`] carries and what a probe's
/// attach cookie names ([`cookie::ProbeCookie::function`]). Which symbols of which
/// family map to which variant is userspace's catalogue (`userspace/images/src/allocators.rs`);
/// how the probe reads the call's arguments is its [`Shape`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AllocFn {
    /// `malloc(size)`
    Malloc = 0,
    /// `calloc(nmemb, size)`: `nmemb * size` bytes, or nothing on overflow.
    Calloc = 1,
    /// `realloc(ptr, size)`: `size` new bytes (`realloc(NULL, n)` is left to `malloc`).
    Realloc = 2,
    /// `reallocarray(ptr, nmemb, size)`
    Reallocarray = 3,
    /// `posix_memalign(memptr, alignment, size)`
    PosixMemalign = 4,
    /// `aligned_alloc(alignment, size)`
    AlignedAlloc = 5,
    /// `memalign(alignment, size)`
    Memalign = 6,
    /// `valloc(size)`
    Valloc = 7,
    /// `pvalloc(size)`: `size` rounded up to the page size.
    Pvalloc = 8,
    /// C++ `operator new(size_t)`, with or without `nothrow_t` / `align_val_t`.
    New = 9,
    /// C++ `operator new[](size_t)`, with or without `nothrow_t` / `align_val_t`.
    NewArray = 10,
    /// jemalloc `mallocx(size, flags)` (flags carry alignment and zeroing).
    Mallocx = 11,
    /// jemalloc `rallocx(ptr, size, flags)`.
    Rallocx = 12,
    /// jemalloc `xallocx(ptr, size, extra, flags)`: resizes in place, returns a size.
    Xallocx = 13,
    /// An allocator's own aligned or zeroing variant with the size first
    /// (mimalloc `mi_malloc_aligned`, `mi_zalloc`, `mi_new_aligned`, ...).
    SizedVariant = 14,
    /// An allocator's own resizing variant (`mi_realloc_aligned`, `mi_rezalloc`, ...).
    ResizeVariant = 15,
    /// `free(ptr)` and every deallocation entry (`operator delete` in all its forms,
    /// `sdallocx`, `dallocx`, `free_sized`, `free_aligned_sized`, `mi_free`...).
    Free = 16,
    /// A HotSpot thread took a new TLAB (`AllocTracer::send_allocation_in_new_tlab`): the
    /// size is the TLAB's, charged to the object whose allocation refilled it.
    JavaTlab = 17,
    /// A HotSpot object allocated outside any TLAB
    /// (`AllocTracer::send_allocation_outside_tlab`): the size is the object's.
    JavaOutsideTlab = 18,
    /// V8's allocation-observer step on a Node.js heap space (its LAB handed out these
    /// bytes since the previous step): the chunk, charged to the allocation that
    /// reached the step.
    JsHeapChunk = 19,
    /// A V8 object in a large-object space: the size is the object's.
    JsLargeObject = 20,
}

/// Number of [`AllocFn`] variants.
pub const ALLOC_FN_COUNT: usize = 21;

impl AllocFn {
    /// Every entry kind, in discriminant order.
    pub const ALL: [AllocFn; ALLOC_FN_COUNT] = [
        AllocFn::Malloc,
        AllocFn::Calloc,
        AllocFn::Realloc,
        AllocFn::Reallocarray,
        AllocFn::PosixMemalign,
        AllocFn::AlignedAlloc,
        AllocFn::Memalign,
        AllocFn::Valloc,
        AllocFn::Pvalloc,
        AllocFn::New,
        AllocFn::NewArray,
        AllocFn::Mallocx,
        AllocFn::Rallocx,
        AllocFn::Xallocx,
        AllocFn::SizedVariant,
        AllocFn::ResizeVariant,
        AllocFn::Free,
        AllocFn::JavaTlab,
        AllocFn::JavaOutsideTlab,
        AllocFn::JsHeapChunk,
        AllocFn::JsLargeObject,
    ];

    /// A short name for logs and reports.
    pub const fn name(self) -> &'static str {
        match self {
            AllocFn::Malloc => "malloc",
            AllocFn::Calloc => "calloc",
            AllocFn::Realloc => "realloc",
            AllocFn::Reallocarray => "reallocarray",
            AllocFn::PosixMemalign => "posix_memalign",
            AllocFn::AlignedAlloc => "aligned_alloc",
            AllocFn::Memalign => "memalign",
            AllocFn::Valloc => "valloc",
            AllocFn::Pvalloc => "pvalloc",
            AllocFn::New => "operator new",
            AllocFn::NewArray => "operator new[]",
            AllocFn::Mallocx => "mallocx",
            AllocFn::Rallocx => "rallocx",
            AllocFn::Xallocx => "xallocx",
            AllocFn::SizedVariant => "sized variant",
            AllocFn::ResizeVariant => "resize variant",
            AllocFn::Free => "free",
            AllocFn::JavaTlab => "java new TLAB",
            AllocFn::JavaOutsideTlab => "java outside TLAB",
            AllocFn::JsHeapChunk => "js heap chunk",
            AllocFn::JsLargeObject => "js large object",
        }
    }

    /// Converts an event's `alloc_fn` field back, if it is in range.
    pub fn from_u32(value: u32) -> Option<AllocFn> {
        AllocFn::ALL.get(value as usize).copied()
    }
}

/// How a probe reads an entry's arguments: one eBPF program per shape. The registers
/// holding each input at the probed instruction come from the attach cookie.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Shape {
    /// One input: the size (`malloc`, `operator new`, `mallocx`, `aligned_alloc`...).
    Size = 0,
    /// Two inputs multiplied, with overflow meaning no allocation (`calloc`).
    Array = 1,
    /// The old block, then the new size (`realloc`, `rallocx`).
    Resize = 2,
    /// The old block, then two inputs multiplied (`reallocarray`).
    ResizeArray = 3,
    /// The out-pointer, then the size (`posix_memalign`).
    PosixMemalign = 4,
    /// The size, rounded up to whole pages (`pvalloc`).
    Pvalloc = 5,
    /// The size of an in-place resize (`xallocx`): counted, never tracked as a block.
    InPlace = 6,
    /// The block being freed (live tracking only).
    Free = 7,
    /// A small object allocated where CPython's `PyObject_Malloc` was inlined (a
    /// link-time optimised interpreter): the size is one input times the cookie's
    /// code-size field (1, or a size class's bytes when the size is a constant the
    /// compiler folded into the site). Counted up to [`PYMALLOC_SMALL_MAX`] bytes only
    /// (larger requests reach `malloc`, which counts them), never tracked as a block
    /// (the site has no return to read the block from), never a wrapper's nested call.
    SmallObject = 8,
    /// HotSpot's Java heap, at its allocation tracer (`AllocTracer`): the bytes taken
    /// (a TLAB's, or an object's outside one), the allocated object's `Klass*` and the
    /// allocating `JavaThread*`. Counted and sampled like any size; never tracked as a
    /// block (the garbage collector frees Java objects, no probed call does); the
    /// sample carries the thread's Java stack instead of its native one.
    JavaHeap = 9,
    /// V8's allocation-observer step (`SpaceWithLinearArea::AdvanceAllocationObservers`
    /// in V8 11, `MainAllocator::AdvanceAllocationObservers` in V8 12): one input, the
    /// space or allocator; the program reads the bytes its LAB handed out since the
    /// previous step with the process's [`node::V8Heap`] offsets, and counts them as
    /// one chunk. Never tracked as a block (the collector frees JS objects).
    V8Lab = 10,
    /// A V8 large-object space's `AllocateRaw`: one input, the object's size (a C
    /// `int`, so its high half is not read). Counted only in processes with a
    /// [`node::V8Heap`] entry; never tracked as a block.
    V8Large = 11,
}

/// The largest request CPython's small-object allocator (pymalloc) serves itself
/// (`SMALL_REQUEST_THRESHOLD`, 512 since 3.8); larger ones go to `malloc`.
pub const PYMALLOC_SMALL_MAX: u64 = 512;

impl Shape {
    /// The eBPF program that serves this shape.
    pub const fn program(self) -> &'static str {
        match self {
            Shape::Size => "probe_size",
            Shape::Array => "probe_array",
            Shape::Resize => "probe_resize",
            Shape::ResizeArray => "probe_resize_array",
            Shape::PosixMemalign => "probe_posix_memalign",
            Shape::Pvalloc => "probe_pvalloc",
            Shape::InPlace => "probe_in_place",
            Shape::Free => "probe_free",
            Shape::SmallObject => "probe_small_object",
            Shape::JavaHeap => "probe_java_heap",
            Shape::V8Lab => "probe_v8_lab",
            Shape::V8Large => "probe_v8_large",
        }
    }

    /// Number of register inputs the program reads (at most [`cookie::MAX_INPUTS`]).
    pub const fn inputs(self) -> usize {
        match self {
            Shape::Size
            | Shape::Pvalloc
            | Shape::InPlace
            | Shape::Free
            | Shape::SmallObject
            | Shape::V8Lab
            | Shape::V8Large => 1,
            Shape::Array | Shape::Resize | Shape::PosixMemalign => 2,
            Shape::ResizeArray | Shape::JavaHeap => 3,
        }
    }
}

/// Size of the `LOST` ring buffer: records of [`LostSample`] (64 bytes, 72 with the
/// kernel's header), so ~3,600 lost samples in flight between two reads.
pub const LOST_RING_BYTES: u32 = 256 << 10;

/// Highest ring-pressure level: the sampling interval is at most `RATE << 10`.
pub const MAX_PRESSURE_LEVEL: u32 = 10;

/// The mean sampling interval at pressure `level` through a probe of window shift
/// `window` ([`cookie::ProbeCookie::window_shift`]): `rate << level >> window`.
#[inline(always)]
pub const fn sampling_rate(rate: u64, level: u32, window: u32) -> u64 {
    (rate << (level & 15)) >> (window & 15)
}

/// What a countdown was drawn at, as [`ThreadState::level`] keeps it: the pressure
/// level and the probe's window shift.
#[inline(always)]
pub const fn drawn_scale(level: u32, window: u32) -> u32 {
    (level & 0xff) | (window & 0xff) << 8
}

/// The pressure level rises when more than `PRESSURE_RAISE_EIGHTHS` eighths of the
/// `EVENTS` ring wait for the reader at a sample: only near an overflow, so that a
/// reader that merely lags (a cold start, a cut) changes no interval...
pub const PRESSURE_RAISE_EIGHTHS: u64 = 7;
/// ...and falls when less than `1/PRESSURE_LOWER_FRACTION` does, looked at by every
/// call while the level is up (not only at samples, which a high level makes rare).
pub const PRESSURE_LOWER_FRACTION: u64 = 8;
/// At most one rise per this many nanoseconds: a burst that fills the ring in a few
/// milliseconds is met within them, and one reading does not jump several levels.
pub const PRESSURE_RAISE_SPACING_NS: u64 = 200_000;
/// At most one fall per this many nanoseconds: the level comes down gently once the
/// reader has caught up, rather than oscillating with each drained read.
pub const PRESSURE_LOWER_SPACING_NS: u64 = 20_000_000;
/// Name of the two-entry `PRESSURE` array map (u64): the level in force, and when it
/// last changed (`bpf_ktime_get_ns`).
pub const PRESSURE_MAP: &str = "PRESSURE";
/// Name of the `LOST` ring buffer map.
pub const LOST_MAP: &str = "LOST";

/// Value of the `PROCESS_GATES` map (system-wide mode), keyed by tgid, one per CPU:
/// probe hits counted in the kernel for the overhead budget, whether the process is
/// sampled at all, and how much coarser.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcessGate {
    /// Probe hits (traps into the kernel) by this process on this CPU.
    pub hits: u64,
    /// Of those, hits at probes on an instruction the kernel single-steps (~30x the
    /// trap of an emulated one): the budget weighs them by their measured cost.
    pub stepped_hits: u64,
    /// Nanoseconds its sampled hits spent recording their sample (stack copy and ring
    /// buffer), measured in the program: the part of a hit's cost the calibration,
    /// whose hits are almost never sampled, does not see.
    pub sample_ns: u64,
    /// A [`GateState`] discriminant, written by userspace.
    pub state: u32,
    /// Its sampling interval is raised `2^coarsening` times, on top of the pressure
    /// level (written by userspace, at most [`MAX_COARSENING`]): a process whose
    /// samples cost the agent more than its budget allows gets fewer, each weighed at
    /// the interval it was drawn at, as under pressure.
    pub coarsening: u32,
}

/// Largest [`ProcessGate::coarsening`]: with the largest pressure level, the interval's
/// shift stays within the 4 bits [`sampling_rate`] keeps.
pub const MAX_COARSENING: u32 = 15 - MAX_PRESSURE_LEVEL;

/// Whether a process's probe hits are sampled ([`ProcessGate::state`]).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateState {
    /// Sampled (the default for a new process).
    Open = 0,
    /// Never sampled: allocbpf itself, or filtered out by command name or cgroup.
    Excluded = 1,
    /// Sampled through its own links only (probes filtered on this process, attached
    /// full time on images the overhead budget probes part time for the others): the
    /// shared links' runs of the same trap do nothing, and before this state the own
    /// links' runs do nothing, so every call is counted once.
    OwnLinks = 2,
}

/// Processes whose gates are kept (an LRU map: the least recently active go first).
pub const MAX_GATED_PROCESSES: u32 = 16_384;

/// Key of the `LIVE` map: a sampled block by process and address.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LiveKey {
    /// Process id (tgid).
    pub pid: u32,
    /// Reserved; keeps the layout free of implicit padding.
    pub reserved: u32,
    /// The block's address.
    pub address: u64,
}

/// How live tracking learns a sampled allocation's address (the `LIVE_MODE` global).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LiveMode {
    /// No live tracking.
    Off = 0,
    /// uprobe session links: the entry program decides whether the return runs.
    Session = 1,
    /// A uretprobe on every call (kernels without session links).
    Uretprobe = 2,
}

/// Per-thread sampler state: a `THREAD_SLOTS` entry, or a `THREADS` value keyed by tid.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ThreadState {
    /// Bytes left before the next sample point.
    pub remaining: u64,
    /// Exact calls and bytes of this thread in the current epoch and the one before,
    /// at index `epoch & 1` ([`EpochCounts`]).
    pub counts: [EpochCounts; 2],
    /// Stack pointer at entry of the last wrapper call (calloc, realloc, ...) that may
    /// forward to another probed function; 0 when none is pending.
    pub forward_sp: u64,
    /// Return address at entry of that wrapper call.
    pub forward_return: u64,
    /// Code range `[forward_lo, forward_hi)` of that wrapper in the process.
    pub forward_lo: u64,
    /// End of the wrapper's code range.
    pub forward_hi: u64,
    /// Owning process (tgid).
    pub pid: u32,
    /// Bytes from that wrapper's stack pointer down to its forward's at the forward's
    /// entry, when the forward is the first code it calls; 0 when not known.
    pub forward_call_depth: u32,
    /// Owning thread; 0 marks a free slot.
    pub tid: u32,
    /// The [`AllocFn`] of the call whose return is awaited (live tracking).
    pub pending_fn: u32,
    /// Stack pointer at entry of the call whose return is awaited; 0 when none. At the
    /// return `sp` is this plus 8 and `ip` is [`ThreadState::pending_return`].
    pub pending_sp: u64,
    /// Return address of that call.
    pub pending_return: u64,
    /// Sample id of that call, or 0 if it was not sampled (a realloc of a live block).
    pub pending_id: u64,
    /// `posix_memalign`'s `memptr` out-parameter.
    pub pending_out: u64,
    /// For realloc/reallocarray: the old block, if it is a tracked live sample.
    pub pending_old: u64,
    /// Non-zero once the thread has exited: the entry is frozen until userspace has
    /// collected its counts and freed it (`tid` 0, or deleted from `THREADS`).
    pub exited: u32,
    /// What `remaining` was drawn at ([`drawn_scale`]: the pressure level and the
    /// window shift): its mean is [`sampling_rate`]. A countdown drawn at another scale
    /// than the one in force is drawn again before the next allocation.
    pub level: u32,
}

/// Exact calls and bytes counted in one epoch.
///
/// The agent cuts its intervals without stopping the probes by flipping the `EPOCH`
/// global: every probe run reads it once and counts into the half `epoch & 1`,
/// resetting a half still holding an older epoch; its samples carry the epoch too.
/// After a flip and a wait for running programs, the closed epoch's halves no longer
/// change, and the interval's totals and samples are exactly that epoch's
/// (docs/statistics.md, "One window").
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EpochCounts {
    /// The epoch these counts belong to.
    pub epoch: u64,
    /// Probed calls.
    pub calls: u64,
    /// Requested bytes.
    pub bytes: u64,
}

impl EpochCounts {
    /// Counts one call of `bytes` in `epoch` into a pair of halves.
    #[inline(always)]
    pub fn add(halves: &mut [EpochCounts; 2], epoch: u64, calls: u64, bytes: u64) {
        let half = &mut halves[(epoch & 1) as usize];
        if half.epoch != epoch {
            *half = EpochCounts {
                epoch,
                calls: 0,
                bytes: 0,
            };
        }
        half.calls += calls;
        half.bytes += bytes;
    }
}

/// Value of the `PROCESS_TOTALS` map (per CPU, keyed by pid): calls counted without a
/// thread entry (the per-CPU fallback), by epoch.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcessCounts {
    /// Indexed by `epoch & 1`.
    pub halves: [EpochCounts; 2],
}

/// Name of the one-entry `EPOCH` array map (u64) that userspace flips at interval cuts.
pub const EPOCH_MAP: &str = "EPOCH";

/// Exact call and byte totals of a process over a window (summed by userspace).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Probed calls.
    pub calls: u64,
    /// Requested bytes.
    pub bytes: u64,
}

/// Indices into the per-CPU `COUNTERS` array.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// Samples taken (whether or not they reached the ring buffer).
    Samples = 0,
    /// Samples lost because the ring buffer was full.
    RingBufferDrops = 1,
    /// Samples whose user stack could not be read (the event still carries `caller`).
    StackErrors = 2,
    /// Calls by threads that found their slot taken and the overflow map full (they use
    /// a per-CPU countdown).
    ThreadMapFull = 3,
    /// Thread exits whose totals could not be kept because the process map was full.
    ProcessMapFull = 4,
    /// Calls skipped because a probed wrapper forwarded them (counted once, by the wrapper).
    ForwardedCalls = 5,
    /// Sampled allocations not tracked because the `LIVE` map was full.
    LiveMapFull = 6,
    /// Tracked sampled allocations freed (free, realloc).
    LiveFrees = 7,
    /// Returns of tracked calls (session or uretprobe) that were handled.
    LiveReturns = 8,
    /// Samples that neither ring buffer could take: lost without a trace of their
    /// weight (the report says what they may exclude).
    LostUnrecorded = 9,
    /// Times the ring-pressure level rose: the reader fell behind and every sampling
    /// interval was doubled until it caught up.
    PressureRaises = 10,
    /// Thread exits that froze a thread entry for userspace to collect: userspace
    /// scans the thread table for frozen entries only when this has moved.
    ThreadsFrozen = 11,
}

/// Number of [`Counter`] slots.
pub const COUNTER_COUNT: u32 = 12;

/// Length of the `COUNTERS` array: one set of [`Counter`]s per epoch parity, at
/// `(epoch & 1) * COUNTER_COUNT + counter`, so an interval's sample counter covers
/// exactly its epoch's samples ([`EpochCounts`]).
pub const COUNTER_SLOTS: u32 = 2 * COUNTER_COUNT;

/// `.rodata` global: only this tgid is profiled; 0 profiles every process.
pub const TARGET_PID_GLOBAL: &str = "TARGET_PID";
/// Name of the global that makes a single-process sampler count probe hits in
/// `PROCESS_GATES` too (an overhead budget on one process; nonzero: count).
pub const COUNT_HITS_GLOBAL: &str = "COUNT_HITS";
/// `.rodata` global: allocbpf's own tgid, never sampled (system-wide mode). A constant
/// rather than a gate entry: the gates live in an LRU map that may evict any entry.
pub const SELF_TGID_GLOBAL: &str = "SELF_TGID";
/// `.rodata` global: the mean sampling interval in bytes.
pub const RATE_GLOBAL: &str = "RATE";
/// `.rodata` global: allocations of at least this many bytes are always recorded.
pub const CERTAIN_THRESHOLD_GLOBAL: &str = "CERTAIN_THRESHOLD";
/// `.rodata` global: `THREAD_SLOTS` length minus one (the length is a power of two).
pub const THREAD_SLOT_MASK_GLOBAL: &str = "THREAD_SLOT_MASK";
/// `.rodata` global: a [`LiveMode`] discriminant.
pub const LIVE_MODE_GLOBAL: &str = "LIVE_MODE";
/// `.rodata` global: bytes of user stack copied per sample for DWARF unwinding (one of
/// [`STACK_COPY_SIZES`]), or 0 for frame-pointer stacks walked in the kernel.
pub const STACK_COPY_BYTES_GLOBAL: &str = "STACK_COPY_BYTES";

/// The user-stack copy sizes the probe supports: each is a distinct,
/// constant ring-buffer record size, which the verifier requires.
pub const STACK_COPY_SIZES: [u32; 4] = [4096, 8192, 16384, 32768];

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all types are #[repr(C)], Copy, and made only of integers with no implicit
    // padding, so every bit pattern is valid.
    unsafe impl aya::Pod for super::ThreadState {}
    unsafe impl aya::Pod for super::ProcessCounts {}
    unsafe impl aya::Pod for super::LiveKey {}
    unsafe impl aya::Pod for super::ProcessGate {}
    unsafe impl aya::Pod for super::python::PythonWalk {}
    unsafe impl aya::Pod for super::java::JavaWalk {}
    unsafe impl aya::Pod for super::node::V8Heap {}
}
