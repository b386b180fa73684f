//! allocbpf's in-kernel sampler.
//!
//! One uprobe program per libc allocation entry point. Each call:
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
//!    immediate caller read from `[sp]`.
//!
//! docs/design.md explains each choice; docs/statistics.md why the sampling is unbiased.
#![no_std]
#![no_main]

use core::ptr::{addr_of_mut, read_volatile};

use allocbpf_common::{
    sampler::{self, array_bytes, pvalloc_bytes, Decision},
    AllocFn, Counter, SampleEvent, ThreadState, Totals, ALLOC_FN_COUNT, COUNTER_COUNT,
    INTERVAL_TABLE_LEN, MAX_OVERFLOW_THREADS, MAX_PROCESSES, MAX_STACK_DEPTH, RING_BUFFER_BYTES,
    SAMPLE_FLAG_CERTAIN, THREAD_SLOTS_LEN,
};
use aya_ebpf::{
    bindings::{BPF_F_USER_STACK, BPF_NOEXIST},
    helpers::{
        bpf_get_current_pid_tgid, bpf_get_prandom_u32, bpf_ktime_get_ns, bpf_probe_read_user,
        generated::bpf_get_stack,
    },
    macros::{map, raw_tracepoint, uprobe},
    maps::{Array, HashMap, PerCpuArray, PerCpuHashMap, RingBuf},
    programs::{ProbeContext, RawTracePointContext},
    EbpfContext,
};
use aya_log_ebpf::warn;

/// Only this tgid is profiled; 0 means every process. Set by the loader.
#[no_mangle]
static TARGET_PID: u32 = 0;

/// Mean sampling interval in bytes (only reported in events; the table carries the law).
#[no_mangle]
static RATE: u64 = 512 * 1024;

/// Allocations of at least this many bytes are recorded with probability 1.
#[no_mangle]
static CERTAIN_THRESHOLD: u64 = u64::MAX;

/// Code size of each probed function in the target's libc, indexed by `AllocFn`; used
/// to recognise a call made from inside a probed wrapper.
#[no_mangle]
static FN_SIZES: [u64; ALLOC_FN_COUNT] = [0; ALLOC_FN_COUNT];

/// `THREAD_SLOTS` length minus one; the loader may shrink the table (tests do).
#[no_mangle]
static THREAD_SLOT_MASK: u32 = THREAD_SLOTS_LEN - 1;

/// Per-thread countdown and exact totals, direct-mapped by `tid & THREAD_SLOT_MASK`. A slot is
/// claimed by the first thread that allocates with it free and released at that
/// thread's exit (`thread_exit`).
#[map]
static THREAD_SLOTS: Array<ThreadState> = Array::with_max_entries(THREAD_SLOTS_LEN, 0);

/// Threads whose slot another live thread holds, keyed by tid. Entries are removed at
/// thread exit; when full, new threads use `CPU_COUNTDOWN`.
#[map]
static THREADS: HashMap<u32, ThreadState> = HashMap::with_max_entries(MAX_OVERFLOW_THREADS, 0);

/// Exact totals of threads that have exited (and of threads on the per-CPU fallback),
/// keyed by tgid. Userspace adds the live threads' totals from `THREAD_SLOTS` and
/// `THREADS` and sums the CPUs. Per-CPU because the BPF target has no atomic read-modify-write in Rust's `core`.
#[map]
static PROCESS_TOTALS: PerCpuHashMap<u32, Totals> =
    PerCpuHashMap::with_max_entries(MAX_PROCESSES, 0);

/// Exponential intervals with mean `RATE`, written and refreshed by userspace.
#[map]
static INTERVALS: Array<u64> = Array::with_max_entries(INTERVAL_TABLE_LEN, 0);

/// Per-CPU event counters, indexed by `Counter`.
#[map]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(COUNTER_COUNT, 0);

/// Fallback countdown for threads that found `THREADS` full.
#[map]
static CPU_COUNTDOWN: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Sampled allocations.
#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(RING_BUFFER_BYTES, 0);

#[inline(always)]
fn bump(counter: Counter) {
    if let Some(slot) = COUNTERS.get_ptr_mut(counter as u32) {
        // SAFETY: per-CPU slot, and programs do not migrate while running.
        unsafe { *slot += 1 };
    }
}

/// Draws the next interval: a uniformly random entry of the exponential table.
#[inline(always)]
fn next_interval() -> u64 {
    // SAFETY: a plain helper call without arguments.
    let index = unsafe { bpf_get_prandom_u32() } & (INTERVAL_TABLE_LEN - 1);
    match INTERVALS.get(index) {
        Some(interval) => *interval,
        // Unreachable (the index is masked); the mean keeps the sampler alive.
        None => unsafe { read_volatile(&RATE) },
    }
}

#[inline(always)]
fn decide(remaining: &mut u64, size: u64) -> Decision {
    // SAFETY: reading a `.rodata` global the loader set.
    let threshold = unsafe { read_volatile(&CERTAIN_THRESHOLD) };
    sampler::decide(remaining, size, threshold, next_interval)
}

/// Registers available at function entry.
struct Entry {
    /// Stack pointer: `[sp]` holds the return address.
    sp: u64,
    /// Address of the probed instruction (the function's first byte).
    ip: u64,
}

#[inline(always)]
fn entry_of(ctx: &ProbeContext) -> Entry {
    // SAFETY: `regs` points at the trapped task's saved registers for this program run.
    unsafe {
        Entry {
            sp: (*ctx.regs).rsp,
            ip: (*ctx.regs).rip,
        }
    }
}

#[inline(always)]
fn return_address(sp: u64) -> u64 {
    unsafe { bpf_probe_read_user(sp as *const u64) }.unwrap_or(0)
}

/// True if this call was made by the probed wrapper recorded in `state`, either as a
/// nested call (its return address lies inside the wrapper's code) or as a tail call
/// (same stack pointer and return address as the wrapper had, into a DIFFERENT probed
/// function: the same function again from the same call site is a new call, as in a
/// loop that calls calloc repeatedly).
#[inline(always)]
fn is_forwarded(state: &ThreadState, kind: AllocFn, sp: u64) -> bool {
    let ret = return_address(sp);
    (ret >= state.forward_lo && ret < state.forward_hi)
        || (sp == state.forward_sp
            && ret == state.forward_return
            && kind as u32 != state.forward_fn)
}

/// Records that `kind` (a wrapper that may call another probed function) is running.
#[inline(always)]
fn remember_wrapper(state: &mut ThreadState, kind: AllocFn, entry: &Entry) {
    let size = unsafe { read_volatile(&FN_SIZES[kind as usize]) };
    state.forward_sp = entry.sp;
    state.forward_return = return_address(entry.sp);
    state.forward_lo = entry.ip;
    state.forward_hi = entry.ip + size;
    state.forward_fn = kind as u32;
}

#[inline(always)]
fn emit(ctx: &ProbeContext, kind: AllocFn, pid_tgid: u64, size: u64, decision: Decision, sp: u64) {
    let (offset, next_interval, flags) = match decision {
        Decision::Skip => return,
        Decision::Sampled {
            offset,
            next_interval,
        } => (offset, next_interval, 0),
        Decision::Certain => (0, 0, SAMPLE_FLAG_CERTAIN),
    };
    bump(Counter::Samples);
    let Some(mut entry) = EVENTS.reserve::<SampleEvent>(0) else {
        bump(Counter::RingBufferDrops);
        return;
    };
    let event = entry.as_mut_ptr();
    // SAFETY: `event` points at a reserved, exclusively owned ring-buffer record of the
    // right size; every field is written before submit.
    unsafe {
        addr_of_mut!((*event).timestamp_ns).write(bpf_ktime_get_ns());
        addr_of_mut!((*event).size).write(size);
        addr_of_mut!((*event).offset).write(offset);
        addr_of_mut!((*event).rate).write(read_volatile(&RATE));
        addr_of_mut!((*event).next_interval).write(next_interval);
        addr_of_mut!((*event).caller).write(return_address(sp));
        addr_of_mut!((*event).pid).write((pid_tgid >> 32) as u32);
        addr_of_mut!((*event).tid).write(pid_tgid as u32);
        addr_of_mut!((*event).alloc_fn).write(kind as u32);
        addr_of_mut!((*event).flags).write(flags);
        let written = bpf_get_stack(
            ctx.as_ptr(),
            addr_of_mut!((*event).stack).cast(),
            (MAX_STACK_DEPTH * 8) as u32,
            BPF_F_USER_STACK as u64,
        );
        if written < 0 {
            // An error code is never mistaken for a stack: length 0, error kept apart.
            bump(Counter::StackErrors);
            addr_of_mut!((*event).stack_len).write(0);
            addr_of_mut!((*event).stack_error).write(written as i32);
        } else {
            addr_of_mut!((*event).stack_len).write((written as u32) / 8);
            addr_of_mut!((*event).stack_error).write(0);
        }
    }
    entry.submit(0);
}

/// Adds to a process's kept totals, creating the entry if needed.
#[inline(always)]
fn add_process_totals(pid: u32, calls: u64, bytes: u64) -> bool {
    if PROCESS_TOTALS.get_ptr_mut(&pid).is_none() {
        // BPF_NOEXIST: a racing creator wins and we add to its entry below.
        let _ = PROCESS_TOTALS.insert(&pid, &Totals::default(), BPF_NOEXIST as u64);
    }
    let Some(totals) = PROCESS_TOTALS.get_ptr_mut(&pid) else {
        bump(Counter::ProcessMapFull);
        return false;
    };
    // SAFETY: this CPU's slot of a live map value. The thread-exit tracepoint runs with
    // preemption disabled, so its adds cannot interleave on one CPU.
    unsafe {
        (*totals).calls += calls;
        (*totals).bytes += bytes;
    }
    true
}

/// The `THREAD_SLOTS` slot that thread `tid` maps to (whoever holds it).
#[inline(always)]
fn slot_of(tid: u32) -> Option<&'static mut ThreadState> {
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
fn thread_state(pid: u32, tid: u32) -> Option<&'static mut ThreadState> {
    let fresh = || ThreadState {
        remaining: next_interval(),
        pid,
        tid,
        ..ThreadState::default()
    };
    if let Some(slot) = slot_of(tid) {
        if slot.tid == tid {
            return Some(slot);
        }
        if slot.tid == 0 {
            *slot = fresh();
            return Some(slot);
        }
    }
    if let Some(state) = THREADS.get_ptr_mut(&tid) {
        // SAFETY: only this thread touches its entry; it is removed only at its exit.
        return Some(unsafe { &mut *state });
    }
    THREADS.insert(&tid, &fresh(), BPF_NOEXIST as u64).ok()?;
    // SAFETY: as above.
    THREADS
        .get_ptr_mut(&tid)
        .map(|state| unsafe { &mut *state })
}

/// The common path of every probe. `size` is 0 for calls that allocate nothing
/// countable (calloc overflow, realloc(p, 0)); they still count as calls.
#[inline(always)]
fn on_alloc(ctx: &ProbeContext, kind: AllocFn, size: u64) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let pid = (pid_tgid >> 32) as u32;
    let tid = pid_tgid as u32;
    let target = unsafe { read_volatile(&TARGET_PID) };
    if target != 0 && pid != target {
        return 0;
    }
    let entry = entry_of(ctx);
    let wrapper = kind as u32 != AllocFn::Malloc as u32;

    let Some(state) = thread_state(pid, tid) else {
        // Slot taken and overflow map full. Totals stay exact through the process map,
        // and a per-CPU countdown keeps sampling unbiased (each allocation is still
        // sampled with probability 1 - exp(-size/rate), by memorylessness). Forwarded
        // calls cannot be recognised here.
        bump(Counter::ThreadMapFull);
        if !add_process_totals(pid, 1, size) {
            warn!(ctx, "allocbpf: process totals map full, pid {}", pid);
        }
        if let Some(remaining) = CPU_COUNTDOWN.get_ptr_mut(0) {
            // SAFETY: per-CPU slot.
            let decision = decide(unsafe { &mut *remaining }, size);
            emit(ctx, kind, pid_tgid, size, decision, entry.sp);
        }
        return 0;
    };
    if state.forward_sp != 0 {
        let forwarded = is_forwarded(state, kind, entry.sp);
        // One-shot: the record only ever describes the thread's latest wrapper call.
        state.forward_sp = 0;
        state.forward_lo = 0;
        state.forward_hi = 0;
        if forwarded {
            bump(Counter::ForwardedCalls);
            // A forwarded wrapper may forward again (reallocarray -> realloc -> malloc):
            // it becomes the pending record.
            if wrapper {
                remember_wrapper(state, kind, &entry);
            }
            return 0;
        }
    }
    if wrapper {
        remember_wrapper(state, kind, &entry);
    }
    state.calls += 1;
    state.bytes += size;
    let decision = decide(&mut state.remaining, size);
    emit(ctx, kind, pid_tgid, size, decision, entry.sp);
    0
}

#[inline(always)]
fn arg(ctx: &ProbeContext, n: usize) -> u64 {
    ctx.arg::<u64>(n).unwrap_or(0)
}

/// `malloc(size)`
#[uprobe]
pub fn probe_malloc(ctx: ProbeContext) -> u32 {
    on_alloc(&ctx, AllocFn::Malloc, arg(&ctx, 0))
}

/// `calloc(nmemb, size)`
#[uprobe]
pub fn probe_calloc(ctx: ProbeContext) -> u32 {
    on_alloc(
        &ctx,
        AllocFn::Calloc,
        array_bytes(arg(&ctx, 0), arg(&ctx, 1)),
    )
}

/// `realloc(ptr, size)`: `size` new bytes; `realloc(p, 0)` frees and counts 0 bytes.
#[uprobe]
pub fn probe_realloc(ctx: ProbeContext) -> u32 {
    on_alloc(&ctx, AllocFn::Realloc, arg(&ctx, 1))
}

/// `reallocarray(ptr, nmemb, size)`
#[uprobe]
pub fn probe_reallocarray(ctx: ProbeContext) -> u32 {
    on_alloc(
        &ctx,
        AllocFn::Reallocarray,
        array_bytes(arg(&ctx, 1), arg(&ctx, 2)),
    )
}

/// `posix_memalign(memptr, alignment, size)`
#[uprobe]
pub fn probe_posix_memalign(ctx: ProbeContext) -> u32 {
    on_alloc(&ctx, AllocFn::PosixMemalign, arg(&ctx, 2))
}

/// `aligned_alloc(alignment, size)`
#[uprobe]
pub fn probe_aligned_alloc(ctx: ProbeContext) -> u32 {
    on_alloc(&ctx, AllocFn::AlignedAlloc, arg(&ctx, 1))
}

/// `memalign(alignment, size)`
#[uprobe]
pub fn probe_memalign(ctx: ProbeContext) -> u32 {
    on_alloc(&ctx, AllocFn::Memalign, arg(&ctx, 1))
}

/// `valloc(size)`
#[uprobe]
pub fn probe_valloc(ctx: ProbeContext) -> u32 {
    on_alloc(&ctx, AllocFn::Valloc, arg(&ctx, 0))
}

/// `pvalloc(size)`: rounds up to whole 4 KiB pages (x86-64's page size).
#[uprobe]
pub fn probe_pvalloc(ctx: ProbeContext) -> u32 {
    on_alloc(&ctx, AllocFn::Pvalloc, pvalloc_bytes(arg(&ctx, 0)))
}

/// An empty program attached to the same functions by `cargo xtask bench`: the cost floor
/// of any uprobe-based design (the trap itself).
#[uprobe]
pub fn probe_empty(_ctx: ProbeContext) -> u32 {
    0
}

/// Thread exit: fold the thread's exact totals into its process and free its slot or
/// overflow entry, so both hold live threads only.
#[raw_tracepoint(tracepoint = "sched_process_exit")]
pub fn thread_exit(_ctx: RawTracePointContext) -> i32 {
    let tid = bpf_get_current_pid_tgid() as u32;
    if let Some(slot) = slot_of(tid) {
        if slot.tid == tid {
            add_process_totals(slot.pid, slot.calls, slot.bytes);
            *slot = ThreadState::default();
            return 0;
        }
    }
    let Some(state) = THREADS.get_ptr(&tid) else {
        return 0;
    };
    // SAFETY: valid map value pointer for this run.
    let (pid, calls, bytes) = unsafe { ((*state).pid, (*state).calls, (*state).bytes) };
    add_process_totals(pid, calls, bytes);
    let _ = THREADS.remove(&tid);
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
