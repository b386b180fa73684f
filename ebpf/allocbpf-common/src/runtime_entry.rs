//! What a language runtime hands the kernel and gets back, in bytes: the per-process
//! entry it writes in its own map, and the capture that ends its samples' records.
//!
//! Userspace moves both as opaque bytes (the runtimes' interface names no language);
//! only the runtime that wrote an entry or reads a capture knows its layout, which is
//! defined here beside the eBPF side's.

use crate::{java::JavaCapture, PythonStack, SAMPLE_FLAG_JAVA, SAMPLE_FLAG_PYTHON};

/// A value that crosses between kernel and userspace as plain bytes: a per-process
/// map entry, or a capture at the end of a sample record.
///
/// # Safety
/// Implement it only for `#[repr(C)]` types made of integers with no implicit padding,
/// so that every byte of a value is initialised and every bit pattern is valid.
pub unsafe trait Plain: Copy {
    /// The value's bytes, as the kernel stores them.
    fn as_bytes(&self) -> &[u8] {
        // SAFETY: the trait's contract: no padding, so every byte is initialised.
        unsafe {
            core::slice::from_raw_parts(
                (self as *const Self).cast::<u8>(),
                core::mem::size_of::<Self>(),
            )
        }
    }

    /// The value at the start of `bytes`, if they are long enough.
    fn read_from(bytes: &[u8]) -> Option<Self> {
        if bytes.len() < core::mem::size_of::<Self>() {
            return None;
        }
        // SAFETY: the length was checked, any bit pattern is a valid value (the trait's
        // contract) and read_unaligned has no alignment requirement.
        Some(unsafe { core::ptr::read_unaligned(bytes.as_ptr().cast()) })
    }
}

// SAFETY: all are #[repr(C)], Copy, and made only of integers with no implicit padding
// (their definitions say so; the userspace `aya::Pod` impls rest on the same).
unsafe impl Plain for crate::python::PythonWalk {}
unsafe impl Plain for crate::java::JavaWalk {}
unsafe impl Plain for crate::node::V8Heap {}
unsafe impl Plain for PythonStack {}
unsafe impl Plain for JavaCapture {}

/// The per-process map of CPython processes whose frames are walked
/// ([`PythonWalk`](crate::python::PythonWalk) values).
pub const PYTHON_MAP: &str = "PYTHON";
/// The per-process map of JVMs whose Java heap samples capture their thread
/// ([`JavaWalk`](crate::java::JavaWalk) values).
pub const JAVA_MAP: &str = "JAVA";
/// The per-process map of Node.js processes whose V8 heap is sampled
/// ([`V8Heap`](crate::node::V8Heap) values).
pub const NODE_MAP: &str = "NODE";

/// A runtime's capture at the end of a sample record: the `SampleEvent::flags` bit that
/// says the record carries it, and its size (the record's last bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CaptureLayout {
    /// The flag bit.
    pub flag: u32,
    /// Bytes of the capture.
    pub bytes: usize,
}

/// Every capture a sample record can end with; a record carries at most one.
pub const CAPTURES: [CaptureLayout; 2] = [
    CaptureLayout {
        flag: SAMPLE_FLAG_PYTHON,
        bytes: core::mem::size_of::<PythonStack>(),
    },
    CaptureLayout {
        flag: SAMPLE_FLAG_JAVA,
        bytes: core::mem::size_of::<JavaCapture>(),
    },
];

/// The capture a record with `flags` ends with, if any.
pub fn capture_of(flags: u32) -> Option<CaptureLayout> {
    CAPTURES
        .into_iter()
        .find(|capture| flags & capture.flag != 0)
}
