//! allocbpf's in-kernel sampler.
//!
//! One uprobe program per argument [`Shape`] (size, array, resize, ...), attached to
//! every allocation entry of every allocator family userspace found. The attach
//! cookie ([`ProbeCookie`]) says which entry a probe is on, which registers hold its
//! inputs at the probed instruction (the first one the kernel emulates, which may lie
//! past the entry) and where the entry's return address is. Each call:
//! 1. is filtered by process (`TARGET_PID`, in addition to the pid-scoped attach);
//! 2. is skipped if it is a call that another probed function forwarded (musl's
//!    `calloc` calls `malloc`, glibc's `realloc(NULL, n)` calls `malloc`, ...), so every
//!    allocation is counted once, by the function the program called;
//! 3. adds one call and its size to the thread's exact totals (its slot in a
//!    direct-mapped array, or an overflow hash entry on a slot collision);
//! 4. runs the .NET/heapprofd Poisson byte sampler: a per-thread countdown of bytes
//!    drawn from a precomputed table of exponential intervals; when an allocation
//!    crosses the countdown it is sampled and a fresh interval starts after it.
//!    Allocations of at least `CERTAIN_THRESHOLD` bytes are always recorded
//!    (heapprofd's large-allocation shortcut) without touching the countdown;
//! 5. sends sampled allocations to the `EVENTS` ring buffer with the user stack and the
//!    immediate caller read from `[sp]`;
//! 6. with `--live`, asks for the call's return when it needs the block's address
//!    (see `live.rs`): only sampled calls, and reallocs of tracked blocks, pay for it.
//!
//! docs/design.md describes each mechanism and docs/decisions/ why it was chosen;
//! docs/statistics.md why the sampling is unbiased.
#![no_std]
#![no_main]
// aya-ebpf's map methods take keys as `impl Borrow<K>`; the program passes references,
// as it was verified with, rather than copies clippy would prefer.
#![allow(clippy::needless_borrows_for_generic_args)]

mod call;
mod emit;
mod header;
mod java;
mod live;
mod lost;
mod node;
mod pressure;
mod process;
mod python;
mod stack_copy;
mod threads;
mod wakeup;

use core::ptr::read_volatile;

use allocbpf_common::{
    cookie::ProbeCookie,
    sampler::{self, pvalloc_bytes, Decision},
    sampling_rate, Counter, EpochCounts, LiveKey, LiveMode, ProcessCounts, Shape, ThreadState,
    COUNTER_COUNT, COUNTER_SLOTS, INTERVAL_TABLE_LEN, MAX_LIVE_SAMPLES, MAX_OVERFLOW_THREADS,
    MAX_PROCESSES, PYMALLOC_SMALL_MAX, RING_BUFFER_BYTES, THREAD_SLOTS_LEN,
};
use aya_ebpf::{
    helpers::bpf_get_current_pid_tgid,
    macros::{map, raw_tracepoint, uprobe, uretprobe},
    maps::{Array, HashMap, PerCpuArray, PerCpuHashMap, RingBuf},
    programs::{ProbeContext, RawTracePointContext, RetProbeContext},
};
use aya_log_ebpf::warn;

use crate::{
    call::{
        cookie_of, entry_of, inputs, is_forwarded, now_of, product, remember_wrapper,
        return_address, Now,
    },
    threads::{add_process_totals, existing_thread_state, slot_of, thread_state},
};

/// Only this tgid is profiled; 0 means every process. Set by the loader.
#[no_mangle]
static TARGET_PID: u32 = 0;

/// allocbpf's own tgid: never sampled system-wide (set by the loader).
#[no_mangle]
static SELF_TGID: u32 = 0;

/// Nonzero: count probe hits per process even with a target pid (its overhead budget).
#[no_mangle]
static COUNT_HITS: u32 = 0;

/// Mean sampling interval in bytes (only reported in events; the table carries the law).
#[no_mangle]
static RATE: u64 = 512 * 1024;

/// Allocations of at least this many bytes are recorded with probability 1.
#[no_mangle]
static CERTAIN_THRESHOLD: u64 = u64::MAX;

/// `THREAD_SLOTS` length minus one; the loader may shrink the table (tests do).
#[no_mangle]
static THREAD_SLOT_MASK: u32 = THREAD_SLOTS_LEN - 1;

/// Bytes of user stack copied per sample for userspace DWARF unwinding; 0: the kernel
/// walks frame pointers instead (`--unwind fp`).
#[no_mangle]
static STACK_COPY_BYTES: u32 = 0;

/// A `LiveMode` discriminant: whether and how sampled blocks are tracked until freed.
#[no_mangle]
static LIVE_MODE: u32 = LiveMode::Off as u32;

/// Tracked sampled blocks (`--live`): (pid, address) -> sample id.
#[map]
static LIVE: HashMap<LiveKey, u64> = HashMap::with_max_entries(MAX_LIVE_SAMPLES, 0);

/// `BPF_F_MMAPABLE`: userspace maps `THREAD_SLOTS` to read and free slots, and
/// `INTERVALS` to write it, without a system call per entry.
const BPF_F_MMAPABLE: u32 = 1 << 10;

/// Per-thread countdown and exact totals, direct-mapped by `tid & THREAD_SLOT_MASK`. A slot is
/// claimed by the first thread that allocates with it free. At the thread's exit it is
/// frozen (`exited`) until userspace has collected its counts and freed it: counts
/// never move between maps, so userspace reads them without racing an exit.
#[map]
static THREAD_SLOTS: Array<ThreadState> = Array::with_max_entries(THREAD_SLOTS_LEN, BPF_F_MMAPABLE);

/// Threads whose slot another thread holds, keyed by tid. Frozen at thread exit like a
/// slot, and deleted by userspace; when full, new threads use `CPU_COUNTDOWN`.
#[map]
static THREADS: HashMap<u32, ThreadState> = HashMap::with_max_entries(MAX_OVERFLOW_THREADS, 0);

/// Exact totals of calls counted without a thread entry (the per-CPU fallback), keyed
/// by tgid, by epoch. Per-CPU because the BPF target has no atomic read-modify-write
/// in Rust's `core`.
#[map]
static PROCESS_TOTALS: PerCpuHashMap<u32, ProcessCounts> =
    PerCpuHashMap::with_max_entries(MAX_PROCESSES, 0);

/// The current epoch (`EpochCounts`): userspace increments it to cut an interval.
#[map]
static EPOCH: Array<u64> = Array::with_max_entries(1, 0);

/// Exponential intervals with mean `RATE`, written and refreshed by userspace through a
/// memory mapping (`BPF_F_MMAPABLE`): a store an entry, not a system call's copy.
#[map]
static INTERVALS: Array<u64> = Array::with_max_entries(INTERVAL_TABLE_LEN, BPF_F_MMAPABLE);

/// Per-CPU event counters, one set per epoch parity: `(epoch & 1) * COUNTER_COUNT +
/// Counter`.
#[map]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(COUNTER_SLOTS, 0);

/// Fallback countdown for threads that found `THREADS` full: `[0]` the bytes left,
/// `[1]` the pressure level it was drawn at.
#[map]
static CPU_COUNTDOWN: PerCpuArray<u64> = PerCpuArray::with_max_entries(2, 0);

/// Sampled allocations.
#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(RING_BUFFER_BYTES, 0);

/// Defines a uprobe program (section `uprobe`, as aya's `#[uprobe]`) that returns its
/// body's value. aya's macro always returns 0, but a session link reads the value: 0
/// runs the program again at the return, anything else skips it.
macro_rules! session_uprobe {
    ($(#[$meta:meta])* fn $name:ident($ctx:ident) $body:block) => {
        $(#[$meta])*
        #[no_mangle]
        #[link_section = "uprobe"]
        pub fn $name(raw: *mut core::ffi::c_void) -> u32 {
            let $ctx = ProbeContext::new(raw);
            $body
        }
    };
}

/// Entry programs attached through uprobe session links return 0 to have the same
/// program run again at the function's return.
const RUN_RETURN: u32 = 0;

/// What an entry program returns when no return run is wanted: 1 under session links
/// (skip the return). Plain perf-event uprobes must get 0: there a non-zero value asks
/// the kernel to also emit a perf sample, which costs ~140 ns per call (measured).
#[inline(always)]
fn skip_return() -> u32 {
    // SAFETY: reading a `.rodata` global the loader set (constant to the verifier).
    (unsafe { read_volatile(&LIVE_MODE) } == LiveMode::Session as u32) as u32
}

/// The current epoch.
#[inline(always)]
pub(crate) fn current_epoch() -> u64 {
    EPOCH.get(0).copied().unwrap_or(0)
}

/// Counts one event in the current epoch's counters.
#[inline(always)]
pub(crate) fn bump(counter: Counter) {
    bump_in(current_epoch(), counter)
}

/// Counts one event in `epoch`'s counters (the epoch the run counts its call in).
#[inline(always)]
pub(crate) fn bump_in(epoch: u64, counter: Counter) {
    let index = (epoch & 1) as u32 * COUNTER_COUNT + counter as u32;
    if let Some(slot) = COUNTERS.get_ptr_mut(index) {
        // SAFETY: per-CPU slot, and programs do not migrate while running.
        unsafe { *slot += 1 };
    }
}

/// Runs the countdown for one allocation at pressure `level` through a probe of window
/// shift `window` (the countdown already follows both: [`pressure::follow`]).
#[inline(always)]
fn decide(remaining: &mut u64, size: u64, level: u32, window: u32) -> Decision {
    // SAFETY: reading a `.rodata` global the loader set.
    let threshold = unsafe { read_volatile(&CERTAIN_THRESHOLD) };
    sampler::decide(remaining, size, threshold, || {
        pressure::interval_at(level, window)
    })
}

/// What a probe knows about its call beyond the size.
#[derive(Clone, Copy, Default)]
pub(crate) struct CallArgs {
    /// realloc/reallocarray: the block being resized (0 for none).
    pub(crate) old: u64,
    /// posix_memalign: where the new block's address will be stored.
    pub(crate) out: u64,
    /// A Java heap allocation's class and thread.
    pub(crate) java: Option<java::JavaCall>,
}

/// The common path of every allocation probe. `size` is 0 for calls that allocate
/// nothing countable (calloc overflow, realloc(p, 0)); they still count as calls.
/// Returns `RUN_RETURN` when a session link must run this program again at the return.
#[inline(always)]
fn on_alloc(
    ctx: &ProbeContext,
    cookie: &ProbeCookie,
    shape: Shape,
    size: u64,
    args: CallArgs,
) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let pid = (pid_tgid >> 32) as u32;
    let tid = pid_tgid as u32;
    let target = unsafe { read_volatile(&TARGET_PID) };
    if target != 0 && pid != target {
        return skip_return();
    }
    let Some(coarsening) = process::admit(pid, cookie.stepped, cookie.own_link) else {
        return skip_return();
    };
    let now = now_of(ctx);
    let entry = entry_of(&now, cookie);
    // An inlined allocator's site: no function entry, no return.
    let inlined = shape as u32 == Shape::SmallObject as u32;
    let site = emit::CallSite {
        sp: entry.sp,
        inlined_ip: if inlined { now.ip } else { 0 },
        java: args.java,
    };
    let kind = cookie.function as u32;
    // Read once: the call, its sample and the sample counter share one epoch.
    let epoch = current_epoch();
    let live = unsafe { read_volatile(&LIVE_MODE) } != LiveMode::Off as u32;
    // The ring's pressure and the process's own coarsening raise the interval alike.
    let level = pressure::level() + coarsening;
    let window = cookie.window_shift as u32;
    // SAFETY: reading a `.rodata` global the loader set.
    let rate = sampling_rate(unsafe { read_volatile(&RATE) }, level, window);

    let Some(state) = thread_state(pid, tid, level, window) else {
        // Slot taken and overflow map full. Totals stay exact through the process map,
        // and a per-CPU countdown keeps sampling unbiased (each allocation is still
        // sampled with probability 1 - exp(-size/rate), by memorylessness). Forwarded
        // calls cannot be recognised here, nor returns awaited (no live tracking).
        bump_in(epoch, Counter::ThreadMapFull);
        if !add_process_totals(pid, epoch, size) {
            warn!(ctx, "allocbpf: process totals map full, pid {}", pid);
        }
        if let (Some(remaining), Some(drawn)) =
            (CPU_COUNTDOWN.get_ptr_mut(0), CPU_COUNTDOWN.get_ptr_mut(1))
        {
            // SAFETY: per-CPU slots; programs do not migrate while running.
            let (remaining, drawn) = unsafe { (&mut *remaining, &mut *drawn) };
            let mut drawn_scale = *drawn as u32;
            pressure::follow(remaining, &mut drawn_scale, level, window);
            *drawn = drawn_scale as u64;
            let decision = decide(remaining, size, level, window);
            emit::emit(ctx, kind, pid_tgid, size, decision, site, epoch, rate);
        }
        return skip_return();
    };
    if live && live::is_awaited_return(state, &now) {
        // A session link runs the entry program again at the return.
        live::on_return(state, pid, return_value(ctx));
        return skip_return();
    }
    // An inlined small-object site is never a wrapper's nested call (its size class
    // never reaches another probed entry), and leaves a pending wrapper record to the
    // call it describes.
    if state.forward_sp != 0 && !inlined {
        let forwarded = is_forwarded(state, &entry);
        // One-shot: the record only ever describes the thread's latest wrapper call.
        state.forward_sp = 0;
        state.forward_lo = 0;
        state.forward_hi = 0;
        state.forward_call_depth = 0;
        if forwarded {
            bump(Counter::ForwardedCalls);
            // A forwarded wrapper may forward again (reallocarray -> realloc -> malloc):
            // it becomes the pending record.
            if cookie.wrapper {
                remember_wrapper(state, cookie, &entry, args.old);
            }
            return skip_return();
        }
    }
    if cookie.wrapper {
        remember_wrapper(state, cookie, &entry, args.old);
    }
    EpochCounts::add(&mut state.counts, epoch, 1, size);
    pressure::follow(&mut state.remaining, &mut state.level, level, window);
    let decision = decide(&mut state.remaining, size, level, window);
    let sample_id = emit::emit(ctx, kind, pid_tgid, size, decision, site, epoch, rate);
    if !live {
        return skip_return();
    }
    // An inlined site has no return to await (and its plain uprobe arms no return
    // probe whatever this says): its block is predicted now.
    if inlined {
        if sample_id != 0 {
            live::on_inlined_site(pid, tid, size, sample_id);
        }
        return skip_return();
    }
    let await_return = live::on_entry(state, pid, shape, size, sample_id, args);
    if await_return {
        state.pending_sp = entry.sp;
        state.pending_return = return_address(entry.sp);
        RUN_RETURN
    } else {
        skip_return()
    }
}

/// `rax` at a return.
#[inline(always)]
fn return_value(ctx: &ProbeContext) -> u64 {
    // SAFETY: `regs` points at the trapped task's saved registers for this program run.
    unsafe { (*ctx.regs).rax }
}

session_uprobe! {
    /// [`Shape::Size`]: `malloc(size)`, `operator new(size)`, `aligned_alloc(_, size)`...
    fn probe_size(ctx) {
        let cookie = cookie_of(&ctx);
        let [size, _, _] = inputs(&ctx, &cookie);
        on_alloc(&ctx, &cookie, Shape::Size, size, CallArgs::default())
    }
}

session_uprobe! {
    /// [`Shape::Array`]: `calloc(nmemb, size)`
    fn probe_array(ctx) {
        let cookie = cookie_of(&ctx);
        let [n, s, _] = inputs(&ctx, &cookie);
        let size = product(&ctx, &cookie, n, s);
        on_alloc(&ctx, &cookie, Shape::Array, size, CallArgs::default())
    }
}

session_uprobe! {
    /// [`Shape::Resize`]: `realloc(ptr, size)`: `size` new bytes; `realloc(p, 0)`
    /// frees and counts 0 bytes.
    fn probe_resize(ctx) {
        let cookie = cookie_of(&ctx);
        let [old, size, _] = inputs(&ctx, &cookie);
        on_alloc(&ctx, &cookie, Shape::Resize, size, CallArgs { old, ..CallArgs::default() })
    }
}

session_uprobe! {
    /// [`Shape::ResizeArray`]: `reallocarray(ptr, nmemb, size)`
    fn probe_resize_array(ctx) {
        let cookie = cookie_of(&ctx);
        let [old, n, s] = inputs(&ctx, &cookie);
        let size = product(&ctx, &cookie, n, s);
        on_alloc(&ctx, &cookie, Shape::ResizeArray, size, CallArgs { old, ..CallArgs::default() })
    }
}

session_uprobe! {
    /// [`Shape::PosixMemalign`]: `posix_memalign(memptr, alignment, size)`
    fn probe_posix_memalign(ctx) {
        let cookie = cookie_of(&ctx);
        let [out, size, _] = inputs(&ctx, &cookie);
        on_alloc(&ctx, &cookie, Shape::PosixMemalign, size, CallArgs { out, ..CallArgs::default() })
    }
}

session_uprobe! {
    /// [`Shape::Pvalloc`]: `pvalloc(size)` rounds up to whole 4 KiB pages (x86-64's
    /// page size).
    fn probe_pvalloc(ctx) {
        let cookie = cookie_of(&ctx);
        let size = pvalloc_bytes(inputs(&ctx, &cookie)[0]);
        on_alloc(&ctx, &cookie, Shape::Pvalloc, size, CallArgs::default())
    }
}

session_uprobe! {
    /// [`Shape::InPlace`]: `xallocx(ptr, size, extra, flags)` grows or shrinks a block
    /// where it is: `size` bytes are counted; the block keeps its address and identity.
    fn probe_in_place(ctx) {
        let cookie = cookie_of(&ctx);
        let [size, _, _] = inputs(&ctx, &cookie);
        on_alloc(&ctx, &cookie, Shape::InPlace, size, CallArgs::default())
    }
}

session_uprobe! {
    /// [`Shape::JavaHeap`]: HotSpot's `AllocTracer::send_allocation_in_new_tlab(klass,
    /// obj, tlab_bytes, object_bytes, thread)` and `send_allocation_outside_tlab(klass,
    /// obj, object_bytes, thread)`: the bytes taken, the class, the thread.
    fn probe_java_heap(ctx) {
        let cookie = cookie_of(&ctx);
        let [size, klass, thread] = inputs(&ctx, &cookie);
        let java = Some(java::JavaCall { klass, thread });
        on_alloc(&ctx, &cookie, Shape::JavaHeap, size, CallArgs { java, ..CallArgs::default() })
    }
}

session_uprobe! {
    /// [`Shape::V8Lab`]: V8's allocation-observer step on a space (or allocator) of a
    /// registered Node.js process: the bytes its LAB handed out since the previous
    /// step, counted as one chunk.
    fn probe_v8_lab(ctx) {
        let cookie = cookie_of(&ctx);
        let [space, _, _] = inputs(&ctx, &cookie);
        match node::lab_chunk(space) {
            Some(chunk) => on_alloc(&ctx, &cookie, Shape::V8Lab, chunk, CallArgs::default()),
            None => skip_return(),
        }
    }
}

session_uprobe! {
    /// [`Shape::V8Large`]: an object allocated in a V8 large-object space of a
    /// registered Node.js process.
    fn probe_v8_large(ctx) {
        let cookie = cookie_of(&ctx);
        let [size, _, _] = inputs(&ctx, &cookie);
        match node::large_object(size) {
            Some(size) => on_alloc(&ctx, &cookie, Shape::V8Large, size, CallArgs::default()),
            None => skip_return(),
        }
    }
}

/// [`Shape::SmallObject`]: a small object allocated where CPython's `PyObject_Malloc`
/// was inlined, probed at the branch that takes the inlined allocator. A plain uprobe,
/// never a session: the site is not a function entry, and `[sp]` is no return address
/// to arm a return probe on.
#[uprobe]
pub fn probe_small_object(ctx: ProbeContext) -> u32 {
    /// EFLAGS.ZF
    const ZERO_FLAG: u64 = 1 << 6;
    // The inlined allocator runs only when the comparison found the default one (ZF
    // set, for `jne` and `je` alike). Else the call goes through the replaced pointer
    // (PYTHONMALLOC=malloc, a debug or tracing hook): to entries that count it, or none.
    // SAFETY: `regs` points at the trapped task's saved registers for this program run.
    if unsafe { (*ctx.regs).eflags } & ZERO_FLAG == 0 {
        return 0;
    }
    let cookie = cookie_of(&ctx);
    let [input, _, _] = inputs(&ctx, &cookie);
    let size = input.wrapping_mul(cookie.code_size);
    // Zero and larger requests go on to malloc, which counts them.
    if size == 0 || size > PYMALLOC_SMALL_MAX {
        return 0;
    }
    on_alloc(&ctx, &cookie, Shape::SmallObject, size, CallArgs::default());
    0
}

/// [`Shape::Free`]: `free(ptr)` and every deallocation entry, attached at an
/// instruction the kernel emulates (`free+0` would be single-stepped at ~16 us per
/// call). Only tracked sampled blocks are looked up and retired.
#[uprobe]
pub fn probe_free(ctx: ProbeContext) -> u32 {
    let pid = (bpf_get_current_pid_tgid() >> 32) as u32;
    let target = unsafe { read_volatile(&TARGET_PID) };
    if target != 0 && pid != target {
        return 0;
    }
    let cookie = cookie_of(&ctx);
    if process::admit(pid, cookie.stepped, cookie.own_link).is_none() {
        return 0;
    }
    let [address, _, _] = inputs(&ctx, &cookie);
    if address != 0 {
        live::free_block(pid, address);
    }
    0
}

/// The return of every allocation call, on kernels without uprobe session links (the
/// classic, costly fallback: every call pays for a uretprobe). Only the awaited call's
/// return (the thread's pending record) does any work.
#[uretprobe]
pub fn probe_return(ctx: RetProbeContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let pid = (pid_tgid >> 32) as u32;
    let target = unsafe { read_volatile(&TARGET_PID) };
    if target != 0 && pid != target {
        return 0;
    }
    // Counted for the overhead budget: this is a second trap per call. (Never on own
    // links: those need session links, as the budget's windows do.)
    let _ = process::admit(pid, false, false);
    let Some(state) = existing_thread_state(pid_tgid as u32) else {
        return 0;
    };
    // SAFETY: `regs` points at the trapped task's saved registers for this program run.
    let (now, rax) = unsafe {
        (
            Now {
                sp: (*ctx.regs).rsp,
                ip: (*ctx.regs).rip,
            },
            (*ctx.regs).rax,
        )
    };
    if live::is_awaited_return(state, &now) {
        live::on_return(state, pid, rax);
    }
    0
}

/// An empty program attached to the same functions by `cargo xtask bench`: the cost floor
/// of any uprobe-based design (the trap itself).
#[uprobe]
pub fn probe_empty(_ctx: ProbeContext) -> u32 {
    0
}

/// Thread exit: freeze the thread's slot and overflow entry (`exited`) so userspace
/// collects their counts and frees them. Nothing moves between maps: a reader that
/// saw the counts in the slot cannot see them again elsewhere.
#[raw_tracepoint(tracepoint = "sched_process_exit")]
pub fn thread_exit(_ctx: RawTracePointContext) -> i32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tid = pid_tgid as u32;
    process::on_thread_exit((pid_tgid >> 32) as u32, tid);
    let mut froze = false;
    if let Some(slot) = slot_of(tid) {
        if slot.tid == tid && slot.exited == 0 {
            slot.exited = 1;
            froze = true;
        }
    }
    // A thread may hold both: an overflow entry made while its slot was taken, then
    // the slot once it was freed.
    if let Some(state) = THREADS.get_ptr_mut(&tid) {
        // SAFETY: valid map value pointer for this run; only this thread writes it.
        unsafe { (*state).exited = 1 };
        froze = true;
    }
    if froze {
        bump(Counter::ThreadsFrozen);
    }
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[link_section = "license"]
#[no_mangle]
static LICENSE: [u8; 4] = *b"GPL\0";
