//! Java frames at sample time: a sample of a registered JVM's Java heap carries the
//! thread's last Java frame (its `JavaFrameAnchor`) and a copy of the stack from there
//! up, for userspace to walk with the JVM's own tables. The VM's native frames below
//! the anchor (the allocation path inside libjvm) are not sent: they name no Java code.
//!
//! The capture believes nothing: the thread pointer comes from the probed call's
//! arguments, every read is a bounded helper read, and the copy stops at the first
//! unreadable page; userspace validates every word it walks.

use core::ptr::addr_of_mut;

use allocbpf_common::{
    java::{JavaCapture, JavaStatus, JavaWalk, JAVA_STACK_BYTES, MAX_JAVA_PROCESSES},
    AllocFn, SampleEvent, SAMPLE_FLAG_JAVA,
};
use aya_ebpf::{helpers::bpf_probe_read_user, macros::map, maps::HashMap};

use crate::{
    header::{write_header, Header},
    stack_copy::copy_stack,
    wakeup::wakeup_flags,
    EVENTS,
};

/// Where each JVM's threads keep their last Java frame, by pid; written by userspace.
#[map]
static JAVA: HashMap<u32, JavaWalk> = HashMap::with_max_entries(MAX_JAVA_PROCESSES, 0);

/// A Java heap sample record: the header, then the capture.
#[repr(C)]
struct JavaSample {
    event: SampleEvent,
    java: JavaCapture,
}

/// The probed call's Java side: the allocated object's class and the allocating thread.
#[derive(Clone, Copy)]
pub(crate) struct JavaCall {
    /// `Klass*`.
    pub(crate) klass: u64,
    /// `JavaThread*`.
    pub(crate) thread: u64,
}

/// The word at `address` in the current process.
#[inline(always)]
fn read_word(address: u64) -> Option<u64> {
    // SAFETY: a user-memory read through the helper, which faults safely.
    unsafe { bpf_probe_read_user(address as *const u64) }.ok()
}

/// Sends a sample of `call` with its Java stack when its process is a registered JVM;
/// `None` when it is not (the caller sends it the native way), else whether the ring
/// took it.
#[inline(always)]
pub(crate) fn emit(header: &Header, call: JavaCall) -> Option<bool> {
    let pid = (header.pid_tgid >> 32) as u32;
    // SAFETY: a live map value, written whole by userspace.
    let walk = unsafe { *JAVA.get_ptr(&pid)? };
    let Some(mut entry) = EVENTS.reserve::<JavaSample>(0) else {
        return Some(false);
    };
    let record = entry.as_mut_ptr();
    // SAFETY: `record` is a reserved, exclusively owned record of the right size; every
    // field userspace reads is written before submit (the stack bytes after `copied`
    // are never read).
    unsafe {
        let event = addr_of_mut!((*record).event);
        write_header(event, header);
        addr_of_mut!((*event).flags).write(header.flags | SAMPLE_FLAG_JAVA);
        let java = addr_of_mut!((*record).java);
        addr_of_mut!((*java).klass).write(call.klass);
        let start = read_word(call.thread.wrapping_add(walk.tlab_start as u64));
        let top = read_word(call.thread.wrapping_add(walk.tlab_top as u64));
        let object_bytes = match (start, top) {
            (Some(start), Some(top)) if header.kind == AllocFn::JavaTlab as u32 => {
                top.wrapping_sub(start)
            }
            _ => 0,
        };
        addr_of_mut!((*java).object_bytes).write(object_bytes);
        addr_of_mut!((*java).thread).write(call.thread);
        addr_of_mut!((*java).copied).write(0);
        addr_of_mut!((*java).base).write(0);
        let anchor = call.thread.wrapping_add(walk.anchor as u64);
        let words = (
            read_word(anchor.wrapping_add(walk.last_sp as u64)),
            read_word(anchor.wrapping_add(walk.last_pc as u64)),
            read_word(anchor.wrapping_add(walk.last_fp as u64)),
        );
        let status = match words {
            (Some(sp), Some(pc), Some(fp)) => {
                addr_of_mut!((*java).anchor).write([sp, pc, fp]);
                if sp == 0 {
                    JavaStatus::NoJavaFrame
                } else {
                    let base = sp.wrapping_sub(8);
                    let stack = addr_of_mut!((*java).stack).cast::<u8>();
                    // Up to the thread's stack top: most Java stacks are far shorter
                    // than the copy's room, and the copy is what a sample costs.
                    let top = read_word(call.thread.wrapping_add(walk.stack_base as u64));
                    let limit = match top {
                        Some(top) if top > base => (top - base).min(JAVA_STACK_BYTES as u64),
                        _ => JAVA_STACK_BYTES as u64,
                    } as usize;
                    let copied = copy_stack::<JAVA_STACK_BYTES>(stack, base, limit);
                    addr_of_mut!((*java).copied).write(copied as u32);
                    addr_of_mut!((*java).base).write(base);
                    if copied == 0 {
                        JavaStatus::StackUnreadable
                    } else {
                        JavaStatus::Captured
                    }
                }
            }
            _ => {
                addr_of_mut!((*java).anchor).write([0; 3]);
                JavaStatus::AnchorUnreadable
            }
        };
        addr_of_mut!((*java).status).write(status as u32);
    }
    entry.submit(wakeup_flags(header.timestamp_ns));
    Some(true)
}
