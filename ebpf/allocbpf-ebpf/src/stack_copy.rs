//! `--unwind dwarf`: a sample carries the registers and a copy of the top of the user
//! stack, for userspace to unwind with the modules' unwind tables (framehop).
//!
//! The copy starts at `sp` and stops at the end of the stack mapping: a read that
//! crosses it fails as a whole, so the copy proceeds page by page (the first piece up to
//! the next page boundary, then whole pages) and stops at the first page that cannot be
//! read. Each piece has a size and offset the verifier can bound.

use core::ptr::addr_of_mut;

use allocbpf_common::{PythonStack, SampleEvent};
use aya_ebpf::{helpers::generated::bpf_probe_read_user, programs::ProbeContext, EbpfContext};

use crate::{
    header::{write_header, Header},
    wakeup::wakeup_flags,
    EVENTS,
};

const PAGE: usize = 4096;

/// A sample record with `N` bytes of user stack after the header, and `P` (0 or 1)
/// Python stacks after that.
#[repr(C)]
pub(crate) struct SampleWithStack<const N: usize, const P: usize> {
    event: SampleEvent,
    stack: [u8; N],
    python: [PythonStack; P],
}

/// Reserves, fills and submits a record with up to `N` bytes of stack, with the
/// thread's Python frames when its process is a Python process.
#[inline(always)]
pub(crate) fn emit<const N: usize>(ctx: &ProbeContext, header: &Header) -> bool {
    if crate::python::is_python((header.pid_tgid >> 32) as u32) {
        emit_record::<N, 1>(ctx, header)
    } else {
        emit_record::<N, 0>(ctx, header)
    }
}

#[inline(always)]
fn emit_record<const N: usize, const P: usize>(ctx: &ProbeContext, header: &Header) -> bool {
    let Some(mut entry) = EVENTS.reserve::<SampleWithStack<N, P>>(0) else {
        return false;
    };
    let record = entry.as_mut_ptr();
    // SAFETY: `ctx.as_ptr()` is the trapped task's pt_regs for this program run.
    let regs = unsafe { &*(ctx.as_ptr() as *const aya_ebpf::bindings::pt_regs) };
    let (ip, sp, bp) = (regs.rip, regs.rsp, regs.rbp);
    // SAFETY: `record` is a reserved, exclusively owned record of the right size; every
    // header field is written before submit, and the stack bytes after `copied` are
    // never read by userspace.
    unsafe {
        let event = addr_of_mut!((*record).event);
        write_header(event, header);
        addr_of_mut!((*event).regs).write([ip, sp, bp]);
        let stack = addr_of_mut!((*record).stack).cast::<u8>();
        let copied = copy_stack::<N>(stack, sp, N);
        addr_of_mut!((*event).user_stack_len).write(copied as u32);
        crate::python::fill::<P>(event, addr_of_mut!((*record).python), header);
    }
    entry.submit(wakeup_flags(header.timestamp_ns));
    true
}

/// Copies user memory from `sp` up into `dst` (capacity `N`), page by page, stopping
/// once `limit` bytes are in (the top of a stack known to end there); returns the bytes
/// copied (also the Java stack's copy, `java.rs`).
///
/// # Safety
/// `dst` must be valid for writes of `N` bytes.
#[inline(always)]
pub(crate) unsafe fn copy_stack<const N: usize>(dst: *mut u8, sp: u64, limit: usize) -> usize {
    // Up to the next page boundary: 1..=4096 bytes.
    let first = PAGE - (sp as usize & (PAGE - 1));
    if first > N {
        return 0;
    }
    // SAFETY: first <= N, so the write stays in `dst`.
    let read = unsafe { bpf_probe_read_user(dst.cast(), first as u32, sp as *const _) };
    if read != 0 {
        return 0;
    }
    let mut copied = first;
    for _ in 0..N / PAGE {
        if copied > N - PAGE || copied >= limit {
            break;
        }
        // SAFETY: copied + PAGE <= N.
        let read = unsafe {
            bpf_probe_read_user(
                dst.add(copied).cast(),
                PAGE as u32,
                (sp + copied as u64) as *const _,
            )
        };
        if read != 0 {
            break;
        }
        copied += PAGE;
    }
    copied
}
