//! A language runtime that exists only here, to hold the runtime interface to its
//! promise: a new runtime is its crate, one line in the runtimes' list and, where it
//! needs one, its eBPF part; nothing else names it.
//!
//! "Fakelang" claims one process, writes a per-process map entry of its own layout, and
//! reads its samples' captures (its eBPF part's bytes, which a test plays) as a list of
//! function ids that become frames `fn_N (prog.fake:N)`, in place of the native ones.
#![deny(missing_docs)]

use std::{collections::HashSet, time::Duration};

use allocbpf_profile::frame::{Frame, LocationStyle, SourceLocation, SourceLocations};
use allocbpf_runtime::{
    toolkit::{ProcessStates, RetryPolicy},
    Departure, Found, ProcessView, Runtime, RuntimeMaps, SampleStack,
};

/// This runtime's name.
pub const NAME: &str = "fakelang";

/// The per-process map its eBPF part would read.
pub const MAP: &str = "FAKELANG";

/// The sample flag bit that marks its capture (one no real runtime uses).
pub const CAPTURE_FLAG: u32 = 1 << 20;

/// The label its profiles carry, and its value.
pub const VERSION_LABEL: (&str, &str) = ("fakelang_version", "1.0");

/// The file its frames are in.
pub const SOURCE_FILE: &str = "prog.fake";

/// The map entry it writes for a process: its layout is this runtime's alone.
pub fn entry_of(pid: u32) -> Vec<u8> {
    [b"FAKE".as_slice(), &pid.to_le_bytes()].concat()
}

/// A capture as its eBPF part would send it: function ids, innermost first.
pub fn capture_of(functions: &[u32]) -> Vec<u8> {
    functions.iter().flat_map(|id| id.to_le_bytes()).collect()
}

/// How a frame of function `id` reads in reports that show names only.
pub fn shown_name(id: u32) -> String {
    format!("fn_{id} ({SOURCE_FILE}:{id})")
}

/// The fake language runtime: the processes it was told to claim.
pub struct FakeLang {
    /// Pids it claims when it looks at them.
    pub claims: HashSet<u32>,
    /// Pids it profiles now (claimed, entry written), with the toolkit's one forget.
    profiled: ProcessStates<()>,
}

impl Default for FakeLang {
    fn default() -> Self {
        Self {
            claims: HashSet::new(),
            // One look: a process is claimed or not.
            profiled: ProcessStates::new(
                RetryPolicy {
                    every: Duration::ZERO,
                    times: 0,
                },
                Some(MAP),
            ),
        }
    }
}

impl Runtime for FakeLang {
    fn name(&self) -> &'static str {
        NAME
    }

    fn look_at(&mut self, process: &ProcessView<'_>, maps: &mut dyn RuntimeMaps) -> Option<Found> {
        if !self.claims.contains(&process.pid) {
            return None;
        }
        maps.set_entry(MAP, process.pid, &entry_of(process.pid))
            .ok()?;
        self.profiled.insert(process.pid, ());
        Some(Found {
            runtime: NAME,
            labels: vec![(VERSION_LABEL.0, VERSION_LABEL.1.to_string())],
            source: None,
        })
    }

    fn merge_frames(
        &mut self,
        sample: &SampleStack<'_>,
        native: Vec<Frame>,
        locations: &mut SourceLocations,
    ) -> Vec<Frame> {
        let Some(capture) = sample.capture_of(CAPTURE_FLAG) else {
            return native;
        };
        if self.profiled.get(sample.pid).is_none() {
            return native;
        }
        (capture.chunks_exact(4))
            .map(|id| u32::from_le_bytes(id.try_into().expect("chunks of 4")))
            .map(|id| {
                Frame::Runtime(locations.intern(SourceLocation {
                    function: format!("fn_{id}"),
                    file: SOURCE_FILE.to_string(),
                    line: id,
                    style: LocationStyle::WithFile,
                }))
            })
            .collect()
    }

    fn forget(&mut self, pid: u32, why: Departure, maps: &mut dyn RuntimeMaps) {
        self.profiled.forget(pid, why, maps);
    }
}
