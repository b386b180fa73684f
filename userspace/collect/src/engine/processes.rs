//! The process table: every process the engine follows, with its identity, whether the
//! scope admits it, its aggregate for the current interval and the files it maps.

use std::collections::{HashMap, HashSet};

use allocbpf_probe::image::ImageKey;
use allocbpf_profile::aggregate::Aggregate;

use crate::process::{BuildIdCache, ProcessInfo};

/// One followed process.
pub(crate) struct Tracked {
    /// Its identity and labels.
    pub info: ProcessInfo,
    /// Whether the scope profiles it (samples of others are dropped).
    pub admitted: bool,
    /// Its samples of the current interval (and, with live tracking, its live blocks).
    pub aggregate: Aggregate,
    /// Exited (or found dead): its next profile is its last.
    pub exited: bool,
    /// Allocator images this process maps (for budget detachments).
    pub images: Vec<ImageKey>,
    /// Every executable file it mapped when last examined (and images found mapped
    /// since): what keeps cached facts and attached images alive (`release.rs`).
    pub mapped: Vec<ImageKey>,
}

/// Followed processes, and the pids to leave alone or to clean up after.
#[derive(Default)]
pub(crate) struct ProcessTable {
    /// Followed processes by pid.
    pub tracked: HashMap<u32, Tracked>,
    /// Processes that exited without ever being tracked (no sample: cron jobs,
    /// scripts): their kernel entries (fallback totals, gates, live blocks) are
    /// removed at the next cut, so bounded maps hold running processes only and a
    /// reused pid starts clean. Bounded by the host's pid space.
    pub untracked_exits: HashSet<u32>,
    /// Never profiled: allocbpf itself and its calibration children.
    pub ignored: HashSet<u32>,
    /// Build ids of the executables seen.
    pub build_ids: BuildIdCache,
}

impl ProcessTable {
    /// A table that ignores `me`.
    pub fn ignoring(me: u32) -> ProcessTable {
        ProcessTable {
            ignored: HashSet::from([me]),
            ..ProcessTable::default()
        }
    }

    /// Records `info` for its pid: updates a followed process, or starts following a
    /// new one (returns true then).
    pub fn update(&mut self, info: ProcessInfo, admitted: bool, live: bool) -> bool {
        match self.tracked.get_mut(&info.pid) {
            Some(tracked) => {
                tracked.info = info;
                tracked.admitted = admitted;
                false
            }
            None => {
                self.tracked.insert(
                    info.pid,
                    Tracked {
                        info,
                        admitted,
                        aggregate: if live {
                            Aggregate::with_live_tracking()
                        } else {
                            Aggregate::default()
                        },
                        exited: false,
                        images: Vec::new(),
                        mapped: Vec::new(),
                    },
                );
                true
            }
        }
    }

    /// `pid` exited: its next profile is its last, or (never followed) its kernel
    /// entries go at the next cut.
    pub fn exited(&mut self, pid: u32) {
        match self.tracked.get_mut(&pid) {
            Some(tracked) => tracked.exited = true,
            None => {
                self.untracked_exits.insert(pid);
            }
        }
    }

    /// The command name of `pid`, for logs (empty if unknown).
    pub fn comm(&self, pid: u32) -> String {
        self.tracked
            .get(&pid)
            .map(|t| t.info.comm.clone())
            .unwrap_or_default()
    }
}
