//! Sampled allocations and process events from the eBPF ring buffer: the records
//! ([`Event`], [`decode`]) and their reader ([`EventReader`]), whose own thread keeps the
//! kernel ring drained whatever the consumer is busy with.

use allocbpf_common::{
    runtime_entry::capture_of, AllocFn, EventKind, LiveEvent, LostSample, ProcessEvent,
    SampleEvent, MAX_STACK_DEPTH, SAMPLE_FLAG_CERTAIN, SAMPLE_FLAG_INLINED,
};
mod reader;

pub use reader::{EventReader, ReaderStats, RING_POLL_EVERY};

/// One ring-buffer record, decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A sampled allocation.
    Sample(RawSample),
    /// A tracked sampled block was freed (live tracking).
    Freed {
        /// Process id.
        pid: u32,
        /// The sample's id.
        sample_id: u64,
        /// CLOCK_MONOTONIC nanoseconds at the free.
        timestamp_ns: u64,
    },
    /// A sampled allocation could not be tracked (live tracking): it failed, or the live map
    /// was full.
    Untracked {
        /// Process id.
        pid: u32,
        /// The sample's id.
        sample_id: u64,
    },
    /// A process called execve (system-wide mode).
    Exec {
        /// Process id.
        pid: u32,
    },
    /// A process's main thread exited (system-wide mode).
    Exit {
        /// Process id.
        pid: u32,
    },
}

/// One sampled allocation, decoded from a [`SampleEvent`]. The default is no sample
/// at all (zeros, no stack, no function), to build others from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RawSample {
    /// Unique id (which live tracking's events about the block name).
    pub sample_id: u64,
    /// Process id.
    pub pid: u32,
    /// Thread id.
    pub tid: u32,
    /// The epoch the call was counted in (low 32 bits): which interval it belongs to.
    pub epoch: u32,
    /// CLOCK_MONOTONIC nanoseconds at the probe.
    pub timestamp_ns: u64,
    /// Requested bytes.
    pub size: u64,
    /// Bytes before the sample point (see [`SampleEvent::offset`]).
    pub offset: u64,
    /// Mean sampling interval in force.
    pub rate: u64,
    /// The countdown the kernel drew for the thread's next sample (0 if certain).
    pub next_interval: u64,
    /// Recorded with probability 1 (at or above the certain threshold).
    pub certain: bool,
    /// Sampled at an inlined allocator's site inside its function, not at an entry:
    /// `stack[0]` is that site (plus one), a frame of its own.
    pub inlined: bool,
    /// The function called, if known.
    pub function: Option<AllocFn>,
    /// Return addresses, innermost first: the immediate caller (read at `[sp]`), then the
    /// frame-pointer walk. The allocation function's own frame is left out.
    pub stack: Vec<u64>,
    /// The `bpf_get_stack` error (negative errno) when only the caller is known.
    pub stack_error: i32,
    /// Userspace unwinding: `ip`, `sp`, `bp` at the probe.
    pub regs: [u64; 3],
    /// Userspace unwinding: the user stack copied from `sp` up (empty otherwise).
    pub user_stack: Vec<u8>,
    /// The sample ring was full: this came through the ring of lost samples, with
    /// its weight but without a stack.
    pub lost: bool,
    /// What a runtime's eBPF part appended to the record, for that runtime alone.
    pub capture: Option<RuntimeCapture>,
}

/// The bytes a runtime's eBPF part appended to a sample record (its layout is that
/// runtime's: `allocbpf_common::runtime_entry::CAPTURES`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RuntimeCapture {
    /// The `SampleEvent::flags` bit that marks it.
    pub flag: u32,
    /// The capture as sent.
    pub bytes: Box<[u8]>,
}

/// Decodes one ring-buffer record; `None` if it is malformed (a version mismatch).
pub fn decode(bytes: &[u8]) -> Option<Event> {
    let kind = u32::from_ne_bytes(bytes.get(..4)?.try_into().ok()?);
    if kind == EventKind::Sample as u32 {
        return decode_sample(bytes).map(Event::Sample);
    }
    if kind == EventKind::Lost as u32 {
        return decode_lost(bytes).map(Event::Sample);
    }
    if kind == EventKind::Exec as u32 || kind == EventKind::Exit as u32 {
        if bytes.len() < std::mem::size_of::<ProcessEvent>() {
            return None;
        }
        // SAFETY: as below, for the plain-integer ProcessEvent.
        let event: ProcessEvent = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
        return Some(if kind == EventKind::Exec as u32 {
            Event::Exec { pid: event.pid }
        } else {
            Event::Exit { pid: event.pid }
        });
    }
    if bytes.len() < std::mem::size_of::<LiveEvent>() {
        return None;
    }
    // SAFETY: the length was checked, LiveEvent is plain integers (any bit pattern is
    // valid) and read_unaligned has no alignment requirement.
    let event: LiveEvent = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
    match kind {
        k if k == EventKind::Freed as u32 => Some(Event::Freed {
            pid: event.pid,
            sample_id: event.sample_id,
            timestamp_ns: event.timestamp_ns,
        }),
        k if k == EventKind::Untracked as u32 => Some(Event::Untracked {
            pid: event.pid,
            sample_id: event.sample_id,
        }),
        _ => None,
    }
}

fn decode_sample(bytes: &[u8]) -> Option<RawSample> {
    if bytes.len() < std::mem::size_of::<SampleEvent>() {
        return None;
    }
    // SAFETY: the length was checked, SampleEvent is plain integers (any bit pattern is
    // valid) and read_unaligned has no alignment requirement.
    let event: SampleEvent = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
    // A runtime's capture, if any, is the record's last bytes.
    let capture = capture_of(event.flags).and_then(|layout| {
        let start = bytes.len().checked_sub(layout.bytes)?;
        (start >= std::mem::size_of::<SampleEvent>()).then(|| RuntimeCapture {
            flag: layout.flag,
            bytes: bytes[start..].into(),
        })
    });
    let bytes = match &capture {
        Some(capture) => &bytes[..bytes.len() - capture.bytes.len()],
        None => bytes,
    };
    let depth = (event.stack_len as usize).min(MAX_STACK_DEPTH);
    let mut stack = Vec::with_capacity(depth + 1);
    if event.caller != 0 {
        stack.push(event.caller);
    }
    // stack[0] is the probed function's first instruction: not a caller, left out.
    stack.extend(
        event.stack[..depth]
            .iter()
            .skip(1)
            .copied()
            .take_while(|&a| a != 0),
    );
    Some(RawSample {
        user_stack: {
            let header = std::mem::size_of::<SampleEvent>();
            let len = (event.user_stack_len as usize).min(bytes.len() - header);
            bytes[header..header + len].to_vec()
        },
        capture,
        ..header_of(&event, stack)
    })
}

/// The fields every sample record has, with `stack` as its native frames.
fn header_of(event: &SampleEvent, stack: Vec<u64>) -> RawSample {
    RawSample {
        sample_id: event.sample_id,
        pid: event.pid,
        tid: event.tid,
        epoch: event.epoch,
        timestamp_ns: event.timestamp_ns,
        size: event.size,
        offset: event.offset,
        rate: event.rate,
        next_interval: event.next_interval,
        certain: event.flags & SAMPLE_FLAG_CERTAIN != 0,
        inlined: event.flags & SAMPLE_FLAG_INLINED != 0,
        function: AllocFn::from_u32(event.alloc_fn),
        stack,
        stack_error: event.stack_error,
        regs: event.regs,
        ..RawSample::default()
    }
}

fn decode_lost(bytes: &[u8]) -> Option<RawSample> {
    if bytes.len() < std::mem::size_of::<LostSample>() {
        return None;
    }
    // SAFETY: as in `decode_sample`, for the plain-integer LostSample.
    let event: LostSample = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
    Some(RawSample {
        sample_id: event.sample_id,
        pid: event.pid,
        tid: event.tid,
        epoch: event.epoch,
        timestamp_ns: event.timestamp_ns,
        size: event.size,
        offset: event.offset,
        rate: event.rate,
        certain: event.flags & SAMPLE_FLAG_CERTAIN != 0,
        function: AllocFn::from_u32(event.alloc_fn),
        lost: true,
        ..RawSample::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event_bytes(event: &SampleEvent) -> Vec<u8> {
        // SAFETY: SampleEvent is repr(C) plain data without padding.
        unsafe {
            std::slice::from_raw_parts(
                (event as *const SampleEvent).cast::<u8>(),
                std::mem::size_of::<SampleEvent>(),
            )
        }
        .to_vec()
    }

    fn event() -> SampleEvent {
        let mut stack = [0u64; MAX_STACK_DEPTH];
        stack[..4].copy_from_slice(&[0x1000, 0x2000, 0x3000, 0x4000]);
        SampleEvent {
            kind: EventKind::Sample as u32,
            epoch: 0,
            sample_id: 99,
            timestamp_ns: 5,
            size: 100,
            offset: 40,
            rate: 4096,
            next_interval: 5000,
            caller: 0x1500,
            pid: 7,
            tid: 8,
            alloc_fn: AllocFn::Calloc as u32,
            flags: 0,
            stack_len: 4,
            stack_error: 0,
            user_stack_len: 0,
            reserved2: 0,
            regs: [0; 3],
            stack,
        }
    }

    #[test]
    fn caller_is_prepended_and_the_allocator_frame_dropped() {
        let Some(Event::Sample(sample)) = decode(&event_bytes(&event())) else {
            panic!("not a sample")
        };
        assert_eq!(sample.stack, vec![0x1500, 0x2000, 0x3000, 0x4000]);
        assert_eq!(sample.function, Some(AllocFn::Calloc));
        assert!(!sample.certain);
    }

    /// A record with `user_stack` copied after the header and `capture` (the bytes of
    /// a runtime's capture, its flag set) at its end.
    fn record_with(user_stack: &[u8], flag: u32, capture: &[u8]) -> Vec<u8> {
        let mut e = event();
        e.flags = flag;
        e.user_stack_len = user_stack.len() as u32;
        [event_bytes(&e).as_slice(), user_stack, capture].concat()
    }

    #[test]
    fn a_runtime_capture_is_the_records_last_bytes_after_its_stack_copy() {
        use allocbpf_common::{
            runtime_entry::{capture_of, CAPTURES},
            SAMPLE_FLAG_JAVA, SAMPLE_FLAG_PYTHON,
        };
        for layout in CAPTURES {
            let capture: Vec<u8> = (0..layout.bytes).map(|i| i as u8).collect();
            let stack = [7u8; 64];
            let Some(Event::Sample(sample)) = decode(&record_with(&stack, layout.flag, &capture))
            else {
                panic!("not a sample")
            };
            let decoded = sample.capture.expect("a capture");
            assert_eq!(
                (decoded.flag, &decoded.bytes[..]),
                (layout.flag, &capture[..])
            );
            assert_eq!(
                sample.user_stack, stack,
                "the copied stack is not the capture's"
            );
            assert_eq!(sample.stack, vec![0x1500, 0x2000, 0x3000, 0x4000]);
        }
        assert_eq!(
            capture_of(SAMPLE_FLAG_PYTHON).map(|c| c.flag),
            Some(SAMPLE_FLAG_PYTHON)
        );
        assert_eq!(
            capture_of(SAMPLE_FLAG_JAVA).map(|c| c.flag),
            Some(SAMPLE_FLAG_JAVA)
        );
        assert_eq!(capture_of(SAMPLE_FLAG_CERTAIN), None);
    }

    #[test]
    fn a_capture_too_short_for_its_flag_is_not_believed() {
        use allocbpf_common::runtime_entry::CAPTURES;
        for layout in CAPTURES {
            // The record is shorter than header + capture: no capture, and the stack
            // copy is cut at the record's end.
            let short = record_with(&[], layout.flag, &vec![1u8; layout.bytes - 1]);
            let Some(Event::Sample(sample)) = decode(&short) else {
                panic!("not a sample")
            };
            assert!(sample.capture.is_none());
        }
    }

    #[test]
    fn a_failed_stack_keeps_only_the_caller() {
        let mut e = event();
        e.stack_len = 0;
        e.stack_error = -14;
        e.flags = SAMPLE_FLAG_CERTAIN;
        let Some(Event::Sample(sample)) = decode(&event_bytes(&e)) else {
            panic!("not a sample")
        };
        assert_eq!(sample.stack, vec![0x1500]);
        assert_eq!(sample.stack_error, -14);
        assert!(sample.certain);
    }

    #[test]
    fn lost_samples_decode_without_a_stack() {
        let lost = LostSample {
            kind: EventKind::Lost as u32,
            epoch: 3,
            sample_id: 11,
            timestamp_ns: 12,
            size: 100_000,
            offset: 7,
            rate: 1 << 21,
            pid: 5,
            tid: 6,
            alloc_fn: AllocFn::Malloc as u32,
            flags: 0,
        };
        // SAFETY: LostSample is repr(C) plain data without padding.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                (&lost as *const LostSample).cast::<u8>(),
                std::mem::size_of::<LostSample>(),
            )
        };
        let Some(Event::Sample(sample)) = decode(bytes) else {
            panic!("not a sample")
        };
        assert!(sample.lost);
        assert!(sample.stack.is_empty() && sample.user_stack.is_empty());
        assert_eq!(
            (sample.size, sample.offset, sample.rate),
            (100_000, 7, 1 << 21)
        );
        assert_eq!((sample.pid, sample.epoch), (5, 3));
        assert!(decode(&bytes[..40]).is_none());
    }

    #[test]
    fn short_records_are_rejected() {
        assert!(decode(&[0u8; 16]).is_none());
        assert!(decode(&[1u8; 16]).is_none());
    }

    #[test]
    fn live_events_decode() {
        let event = LiveEvent {
            kind: EventKind::Freed as u32,
            pid: 3,
            sample_id: 77,
            timestamp_ns: 9,
        };
        // SAFETY: LiveEvent is repr(C) plain data without padding.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                (&event as *const LiveEvent).cast::<u8>(),
                std::mem::size_of::<LiveEvent>(),
            )
        };
        assert_eq!(
            decode(bytes),
            Some(Event::Freed {
                pid: 3,
                sample_id: 77,
                timestamp_ns: 9
            })
        );
    }
}
