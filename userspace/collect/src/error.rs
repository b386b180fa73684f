//! Why collection could not start or go on.

use std::{io, path::PathBuf};

use allocbpf_images::target::TargetError;
use allocbpf_probe::sampler::ProbeError;

/// An error of the collection engine. Once collection runs, nothing returns an error:
/// what goes wrong then is logged and counted, and what was collected is kept.
#[derive(Debug, thiserror::Error)]
pub enum CollectError {
    /// The process to profile cannot be (it does not exist, has no allocator...).
    #[error(transparent)]
    Target(#[from] TargetError),
    /// The target exited before any of its probes were live (while it was examined).
    /// The binary exits with status 3 for it, as for an exit during attach.
    #[error("pid {pid} exited before its probes were live")]
    TargetExited {
        /// The target pid.
        pid: u32,
    },
    /// The sampler could not be loaded, or a probe attached.
    #[error(transparent)]
    Probe(#[from] ProbeError),
    /// The ring buffer's reader could not start.
    #[error("ring buffer")]
    RingBuffer(#[source] io::Error),
    /// The raw-sample log cannot be written.
    #[error("cannot write raw samples to {}", path.display())]
    RawSamples {
        /// The log's path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A descriptor the run loop waits on (pidfd, signal handler) could not be made.
    #[error("{what}")]
    Wait {
        /// Which one.
        what: &'static str,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The binary was built without its eBPF program (`ALLOCBPF_BPF_TOOLCHAIN=none`).
    #[error("this allocbpf was built without its eBPF program (ALLOCBPF_BPF_TOOLCHAIN=none), so it cannot profile: build it with the BPF toolchain (`cargo xtask setup`, docs/build.md)")]
    NoProgram,
    /// Host scope: not one allocator image could be attached.
    #[error("no allocator image could be attached (see the warnings above)")]
    NoImage,
    /// The overhead budget's calibration failed.
    #[error("{what}")]
    Calibration {
        /// The step that failed.
        what: String,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// An error and its sources, `: `-separated, as the command line prints errors: for
/// messages that log an error and go on.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
