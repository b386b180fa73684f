//! The fields of a sample record every way of sending one writes the same way.

use core::ptr::addr_of_mut;

use allocbpf_common::{EventKind, SampleEvent};

/// The fields of a [`SampleEvent`] every mode fills the same way.
pub(crate) struct Header {
    pub(crate) sample_id: u64,
    pub(crate) timestamp_ns: u64,
    pub(crate) size: u64,
    pub(crate) offset: u64,
    pub(crate) next_interval: u64,
    pub(crate) caller: u64,
    pub(crate) pid_tgid: u64,
    pub(crate) kind: u32,
    pub(crate) flags: u32,
    pub(crate) epoch: u64,
    /// Mean sampling interval of the countdown the sample ended.
    pub(crate) rate: u64,
}

/// Writes `header` into a reserved event (stack fields zeroed).
///
/// # Safety
/// `event` must point at a reserved, exclusively owned ring-buffer record.
#[inline(always)]
pub(crate) unsafe fn write_header(event: *mut SampleEvent, h: &Header) {
    unsafe {
        addr_of_mut!((*event).kind).write(EventKind::Sample as u32);
        addr_of_mut!((*event).epoch).write(h.epoch as u32);
        addr_of_mut!((*event).sample_id).write(h.sample_id);
        addr_of_mut!((*event).timestamp_ns).write(h.timestamp_ns);
        addr_of_mut!((*event).size).write(h.size);
        addr_of_mut!((*event).offset).write(h.offset);
        addr_of_mut!((*event).rate).write(h.rate);
        addr_of_mut!((*event).next_interval).write(h.next_interval);
        addr_of_mut!((*event).caller).write(h.caller);
        addr_of_mut!((*event).pid).write((h.pid_tgid >> 32) as u32);
        addr_of_mut!((*event).tid).write(h.pid_tgid as u32);
        addr_of_mut!((*event).alloc_fn).write(h.kind);
        addr_of_mut!((*event).flags).write(h.flags);
        addr_of_mut!((*event).stack_len).write(0);
        addr_of_mut!((*event).stack_error).write(0);
        addr_of_mut!((*event).user_stack_len).write(0);
        addr_of_mut!((*event).reserved2).write(0);
        addr_of_mut!((*event).regs).write([0; 3]);
    }
}
