//! The call as a probe sees it: the entry's registers at the probed instruction, its
//! inputs, its return address, and whether a probed wrapper forwarded it.

use allocbpf_common::{
    cookie::{ProbeCookie, NEST_SPAN_UNIT},
    sampler::array_bytes,
    ThreadState,
};
use aya_ebpf::{
    helpers::{bpf_probe_read_user, generated::bpf_get_attach_cookie},
    programs::ProbeContext,
    EbpfContext,
};

/// The entry's own view of the call, reconstructed at the probed instruction.
pub(crate) struct Entry {
    /// Stack pointer at the entry: `[sp]` holds the return address.
    pub(crate) sp: u64,
    /// Address of the entry's first byte.
    pub(crate) ip: u64,
}

/// The trapped task's registers as they are now (at the probe, or at a return).
pub(crate) struct Now {
    /// `rsp`
    pub(crate) sp: u64,
    /// `rip`
    pub(crate) ip: u64,
}

#[inline(always)]
pub(crate) fn now_of(ctx: &ProbeContext) -> Now {
    // SAFETY: `regs` points at the trapped task's saved registers for this program run.
    unsafe {
        Now {
            sp: (*ctx.regs).rsp,
            ip: (*ctx.regs).rip,
        }
    }
}

/// This probe's cookie (see `allocbpf_common::cookie`).
#[inline(always)]
pub(crate) fn cookie_of(ctx: &ProbeContext) -> ProbeCookie {
    // SAFETY: `ctx` is this program run's context.
    ProbeCookie::decode(unsafe { bpf_get_attach_cookie(ctx.as_ptr()) })
}

/// The entry's stack pointer and first byte, from the registers at the probe. The
/// probed instruction never lies after a stack-pointer move (userspace's choice), so
/// `[sp]` still holds the return address there.
#[inline(always)]
pub(crate) fn entry_of(now: &Now, cookie: &ProbeCookie) -> Entry {
    Entry {
        sp: now.sp,
        ip: now.ip - cookie.probe_offset as u64,
    }
}

/// The values of the cookie's three inputs, from the registers it names.
///
/// Each register is read from the context at a constant offset into a register file
/// on the stack, which is then indexed by the cookie's codes. Reading the context by
/// a computed offset would be simpler, but the verifier only accepts constant context
/// offsets, and a `match` of context loads is merged by LLVM into exactly that.
#[inline(always)]
pub(crate) fn inputs(ctx: &ProbeContext, cookie: &ProbeCookie) -> [u64; 3] {
    // SAFETY: `regs` points at the trapped task's saved registers for this program run.
    let regs = unsafe { &*ctx.regs };
    if cookie.abi_inputs {
        // The common case (the probe sits before anything moved them): no file.
        return [regs.rdi, regs.rsi, regs.rdx];
    }
    let mut file = [0u64; 16];
    let values = [
        regs.rdi, regs.rsi, regs.rdx, regs.rcx, regs.r8, regs.r9, regs.rax, regs.rbx, regs.rbp,
        regs.r10, regs.r11, regs.r12, regs.r13, regs.r14, regs.r15, 1,
    ];
    for (slot, value) in file.iter_mut().zip(values) {
        // SAFETY: a valid, exclusively borrowed stack slot. Volatile keeps the file a
        // real array the program indexes, rather than a tree of selects.
        unsafe { core::ptr::write_volatile(slot, value) };
    }
    let read = |code: u8| {
        let index = (code & 0xf) as usize;
        // SAFETY: index < 16, inside the initialised array.
        unsafe { core::ptr::read_volatile(file.as_ptr().add(index)) }
    };
    [
        read(cookie.inputs[0]),
        read(cookie.inputs[1]),
        read(cookie.inputs[2]),
    ]
}

/// `a * b` bytes, or 0 when the product overflows: either as computed here, or, when
/// the entry multiplied them before the probed instruction (`b` is then the constant
/// 1), as the CPU's overflow flag says (the allocation then fails).
#[inline(always)]
pub(crate) fn product(ctx: &ProbeContext, cookie: &ProbeCookie, a: u64, b: u64) -> u64 {
    /// EFLAGS.OF
    const OVERFLOW_FLAG: u64 = 1 << 11;
    // SAFETY: as in `input`.
    if cookie.overflow_check && unsafe { (*ctx.regs).eflags } & OVERFLOW_FLAG != 0 {
        return 0;
    }
    array_bytes(a, b)
}

#[inline(always)]
pub(crate) fn return_address(sp: u64) -> u64 {
    unsafe { bpf_probe_read_user(sp as *const u64) }.unwrap_or(0)
}

/// True if this call was made by the probed wrapper recorded in `state`, either as a
/// nested call (its return address lies inside the wrapper's code) or as a tail call
/// (same stack pointer and return address as the wrapper had, into a DIFFERENT probed
/// entry: the same entry again from the same call site is a new call, as in a loop
/// that calls calloc repeatedly).
///
/// A return probe armed on the wrapper (ours with `--live`, or any other tool's
/// uretprobe on the same function) replaces its return address on the stack with the
/// kernel's trampoline, so a tail call sees the trampoline instead: that counts as the
/// wrapper's return address too.
///
/// Reading the return address costs a user-memory read (~100 ns), so a wrapper whose
/// forward is the first code it calls is recognised by the stack pointer alone; else
/// the address is read only when the stack pointer allows a forwarded call: below the
/// wrapper's for a nested call, equal to it for a tail call by a wrapper that may
/// tail-jump (`forward_return` is 0 for the others).
#[inline(always)]
pub(crate) fn is_forwarded(state: &ThreadState, entry: &Entry) -> bool {
    if state.forward_call_depth == NESTING_WRAPPER {
        return is_nested(state, entry);
    }
    // The wrapper's first call is its forward (`cookie::forward_call_slots`): the first
    // probed entry at exactly the forward's stack pointer is that call.
    if state.forward_call_depth != 0
        && entry.sp + state.forward_call_depth as u64 == state.forward_sp
    {
        return true;
    }
    if entry.sp < state.forward_sp {
        let ret = return_address(entry.sp);
        return ret >= state.forward_lo && ret < state.forward_hi;
    }
    if entry.sp != state.forward_sp || state.forward_return == 0 || entry.ip == state.forward_lo {
        return false;
    }
    let ret = return_address(entry.sp);
    ret == state.forward_return || is_return_trampoline(ret)
}

/// The page of the uretprobe trampoline on x86-64 kernels since 6.11 (the uretprobe
/// syscall): `TASK_SIZE_MAX - PAGE_SIZE` with 4-level page tables, seen as the
/// `[uprobes]` mapping at 0x7fffffffe000 in every traced process. No code is mapped
/// there, so no real return address can point into it. (Older kernels put the
/// trampoline at a random address; docs/decisions/ and docs/benchmarks.md say what that
/// costs.)
const UPROBE_TRAMPOLINE_PAGE: u64 = 0x7fff_ffff_e000;

#[inline(always)]
pub(crate) fn is_return_trampoline(ret: u64) -> bool {
    ret & !0xfff == UPROBE_TRAMPOLINE_PAGE
}

/// `forward_call_depth` of a nesting wrapper ([`ProbeCookie::nests`]); its
/// `forward_lo` is the wrapper's entry and `forward_hi` the half-width of the span
/// around it that holds its image's allocator code.
const NESTING_WRAPPER: u32 = u32::MAX;

/// How far below a nesting wrapper's stack pointer its nested calls enter: CPython's
/// allocators reach `malloc` through a frame or two of their own.
const MAX_NEST_DEPTH: u64 = 1024;

/// A probed call after a nesting wrapper's entry is its nested call when it enters at
/// most [`MAX_NEST_DEPTH`] bytes below the wrapper's stack pointer and returns into the
/// image's allocator code (the span around the wrapper's entry). The return address is
/// read only here, for a call that may be nested: reading the wrapper's own at every
/// entry, to check it still runs, cost a user-memory read per Python allocation. What
/// the span leaves out: a program's own `malloc` (ctypes calling libc from a deeper
/// frame after the wrapper returned) returns elsewhere and counts. At the wrapper's own
/// stack pointer only a tail jump of the wrapper can be nested (another entry: the
/// same entry from the same site is the next call of a loop), whose return address is
/// the wrapper's caller's, or the uretprobe trampoline when live tracking awaits it.
#[inline(always)]
fn is_nested(state: &ThreadState, entry: &Entry) -> bool {
    if entry.sp > state.forward_sp || state.forward_sp - entry.sp > MAX_NEST_DEPTH {
        return false;
    }
    let tail = entry.sp == state.forward_sp;
    if tail && entry.ip == state.forward_lo {
        return false;
    }
    let ret = return_address(entry.sp);
    (tail && is_return_trampoline(ret))
        || (ret >= state.forward_lo.wrapping_sub(state.forward_hi)
            && ret < state.forward_lo.wrapping_add(state.forward_hi))
}

/// Records that a wrapper (an entry that may call another probed entry) is running.
/// `old`: the block a resize entry was given (0 for none, and for other shapes).
#[inline(always)]
pub(crate) fn remember_wrapper(
    state: &mut ThreadState,
    cookie: &ProbeCookie,
    entry: &Entry,
    old: u64,
) {
    // The code size comes from the cookie: one program serves every image of the host.
    state.forward_sp = entry.sp;
    if cookie.nests {
        state.forward_return = 0;
        state.forward_lo = entry.ip;
        state.forward_hi = cookie.code_size * NEST_SPAN_UNIT;
        state.forward_call_depth = NESTING_WRAPPER;
        return;
    }
    // Only a tail jump leaves nothing but the return address to recognise it by. A
    // resize of a real block cannot end in a tail jump to an entry that does not
    // resize (it must still copy and release the block): glibc's realloc(p, n) skips
    // the read, realloc(NULL, n), which jumps to malloc, pays it.
    let may_tail = cookie.tail_forward && !(cookie.tail_only_if_null && old != 0);
    state.forward_return = if may_tail {
        return_address(entry.sp)
    } else {
        0
    };
    state.forward_lo = entry.ip;
    state.forward_hi = entry.ip + cookie.code_size;
    state.forward_call_depth = cookie.forward_call_slots as u32 * 8;
}
