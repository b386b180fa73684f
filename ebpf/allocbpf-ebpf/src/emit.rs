//! Writing sampled allocations to the `EVENTS` ring buffer, with a frame-pointer stack
//! walked in the kernel (`--unwind fp`) or a copy of the user stack (`stack_copy.rs`).

use core::ptr::{addr_of_mut, read_volatile};

use allocbpf_common::{
    sampler::Decision, Counter, PythonStack, SampleEvent, MAX_STACK_DEPTH, SAMPLE_FLAG_CERTAIN,
    SAMPLE_FLAG_INLINED,
};
use aya_ebpf::{
    bindings::BPF_F_USER_STACK,
    helpers::{bpf_ktime_get_ns, generated::bpf_get_stack},
    programs::ProbeContext,
    EbpfContext,
};

use crate::{
    bump, bump_in,
    call::return_address,
    header::{write_header, Header},
    lost, pressure, stack_copy,
    wakeup::wakeup_flags,
    EVENTS, STACK_COPY_BYTES,
};

/// Where a sampled call was made from: the stack pointer at the probe, and whether the
/// probe sat inside the allocating function (an inlined site) rather than at an entry.
#[derive(Clone, Copy)]
pub(crate) struct CallSite {
    /// The stack pointer at the probe.
    pub(crate) sp: u64,
    /// The probed instruction's address if it is an inlined site, else 0.
    pub(crate) inlined_ip: u64,
    /// A Java heap allocation's class and thread ([`Shape::JavaHeap`]).
    ///
    /// [`Shape::JavaHeap`]: allocbpf_common::Shape::JavaHeap
    pub(crate) java: Option<crate::java::JavaCall>,
}

impl CallSite {
    /// The sample's first frame: the return address at `[sp]` at an entry, or the
    /// inlined site's own address plus one (read as a return address, it lands on the
    /// site's instruction).
    #[inline(always)]
    fn caller(&self) -> u64 {
        match self.inlined_ip {
            0 => return_address(self.sp),
            ip => ip + 1,
        }
    }
}

/// Sends a sampled allocation to the ring buffer; returns its sample id, or 0 when there
/// was no sample or it was lost (a lost sample is not tracked either, but its weight is
/// kept in the `LOST` ring when that has room). `rate`: the mean interval of the
/// countdown, which the sample carries.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn emit(
    ctx: &ProbeContext,
    kind: u32,
    pid_tgid: u64,
    size: u64,
    decision: Decision,
    site: CallSite,
    epoch: u64,
    rate: u64,
) -> u64 {
    let (offset, next_interval, certain) = match decision {
        Decision::Skip => return 0,
        Decision::Sampled {
            offset,
            next_interval,
        } => (offset, next_interval, 0),
        Decision::Certain => (0, 0, SAMPLE_FLAG_CERTAIN),
    };
    let inlined = if site.inlined_ip != 0 {
        SAMPLE_FLAG_INLINED
    } else {
        0
    };
    let flags = certain | inlined;
    bump_in(epoch, Counter::Samples);
    let timestamp_ns = unsafe { bpf_ktime_get_ns() };
    // Unique per session without shared state: a thread's timestamps are distinct, an
    // odd multiplier is a bijection mod 2^64, and the tid separates threads (a collision
    // between threads has probability ~2^-64 per pair).
    let sample_id = timestamp_ns.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (pid_tgid as u32 as u64) | 1;
    let header = Header {
        sample_id,
        timestamp_ns,
        size,
        offset,
        next_interval,
        caller: site.caller(),
        pid_tgid,
        kind,
        flags,
        epoch,
        rate,
    };
    let java = site.java.and_then(|call| crate::java::emit(&header, call));
    // SAFETY: reading a `.rodata` global the loader set (constant to the verifier).
    let sent = if let Some(sent) = java {
        sent
    } else {
        match unsafe { read_volatile(&STACK_COPY_BYTES) } {
            0 => emit_fp(ctx, &header),
            4096 => stack_copy::emit::<4096>(ctx, &header),
            8192 => stack_copy::emit::<8192>(ctx, &header),
            32768 => stack_copy::emit::<32768>(ctx, &header),
            _ => stack_copy::emit::<16384>(ctx, &header),
        }
    };
    // What recording it cost (the budget's price of this process's hits).
    let done_ns = unsafe { bpf_ktime_get_ns() };
    crate::process::add_sample_time((pid_tgid >> 32) as u32, done_ns.wrapping_sub(timestamp_ns));
    pressure::observe_ring(done_ns);
    if !sent {
        bump_in(epoch, Counter::RingBufferDrops);
        if !lost::record(&header) {
            bump_in(epoch, Counter::LostUnrecorded);
        }
        return 0;
    }
    sample_id
}

/// A frame-pointer sample record, with `P` (0 or 1) Python stacks after it.
#[repr(C)]
struct FpSample<const P: usize> {
    event: SampleEvent,
    python: [PythonStack; P],
}

/// `--unwind fp`: the kernel walks frame pointers (`bpf_get_stack`); samples of Python
/// processes also carry their Python frames.
#[inline(always)]
fn emit_fp(ctx: &ProbeContext, header: &Header) -> bool {
    if crate::python::is_python((header.pid_tgid >> 32) as u32) {
        emit_fp_record::<1>(ctx, header)
    } else {
        emit_fp_record::<0>(ctx, header)
    }
}

#[inline(always)]
fn emit_fp_record<const P: usize>(ctx: &ProbeContext, header: &Header) -> bool {
    let Some(mut entry) = EVENTS.reserve::<FpSample<P>>(0) else {
        return false;
    };
    let record = entry.as_mut_ptr();
    // SAFETY: a field of the reserved record.
    let event = unsafe { addr_of_mut!((*record).event) };
    // SAFETY: `event` points at a reserved, exclusively owned ring-buffer record of the
    // right size; every field is written before submit.
    unsafe {
        write_header(event, header);
        let written = bpf_get_stack(
            ctx.as_ptr(),
            addr_of_mut!((*event).stack).cast(),
            (MAX_STACK_DEPTH * 8) as u32,
            BPF_F_USER_STACK as u64,
        );
        if written < 0 {
            // An error code is never mistaken for a stack: length 0, error kept apart.
            bump(Counter::StackErrors);
            addr_of_mut!((*event).stack_error).write(written as i32);
        } else {
            addr_of_mut!((*event).stack_len).write((written as u32) / 8);
        }
        crate::python::fill::<P>(event, addr_of_mut!((*record).python), header);
    }
    entry.submit(wakeup_flags(header.timestamp_ns));
    true
}
