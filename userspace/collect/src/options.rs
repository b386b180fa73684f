//! What the engine is asked to do: how to sample ([`CollectOptions`]) and whom
//! ([`Scope`]). Plain values with their defaults defined here, once: the command line
//! and the agent's config both start from [`CollectOptions::default`].

use std::{path::PathBuf, time::Duration};

use allocbpf_images::image::Lookup;
use allocbpf_profile::estimate::Confidence;
use allocbpf_runtime::Runtime;

// The option types and bounds of the layers below, named here so that the agent and the
// binary set options through this crate alone.
pub use allocbpf_common::{MAX_OVERFLOW_THREADS, STACK_COPY_SIZES, THREAD_SLOTS_LEN};
pub use allocbpf_probe::sampler::{LiveMechanism, ThreadTables};
pub use allocbpf_stacks::resolve::UnwindMode;

use crate::{
    budget::{BudgetOptions, CalibrationChild},
    filter::ProcessFilter,
};

/// The default mean sampling interval: 512 KiB, as tcmalloc and heapprofd use.
pub const DEFAULT_RATE: u64 = 512 << 10;

/// The default bytes of user stack copied per sample for DWARF unwinding.
pub const DEFAULT_STACK_BYTES: u32 = 16 << 10;

/// How samples are taken, resolved and reported, whatever is profiled.
#[derive(Clone, Debug, PartialEq)]
pub struct CollectOptions {
    /// Mean sampling interval in bytes.
    pub rate: u64,
    /// Track sampled blocks until freed (in-use estimates, and leaks).
    pub live: Option<LiveOptions>,
    /// How user stacks are unwound.
    pub unwind: UnwindMode,
    /// Bytes of user stack copied per sample, where stacks are unwound in userspace.
    pub stack_bytes: u32,
    /// Name frames (false: module + offset only, for a symbolizer elsewhere).
    pub symbolize: bool,
    /// Level of the reports' confidence intervals.
    pub confidence: Confidence,
    /// Sizes of the kernel's per-thread tables.
    pub thread_tables: ThreadTables,
    /// Symbol prefixes of renamed allocators (`je_`): files defining `PREFIXmalloc` are
    /// probed too.
    pub allocator_prefixes: Vec<String>,
    /// Attach the empty program instead of the sampler (the benchmarks' floor).
    pub empty_probes: bool,
    /// Where to write every raw sample as a JSON line, if anywhere.
    pub raw_samples: Option<PathBuf>,
    /// The overhead budget (`None`: every image probed full time).
    pub budget: Option<BudgetOptions>,
    /// How to start the child that measures a probe hit's cost for the budget.
    pub calibration: CalibrationChild,
    /// Record each process's timeline (allocation and heap in use over time, the
    /// stacks at the peak) for its report; its cost is bounded per process
    /// (`allocbpf_profile::timeline`).
    pub timeline: bool,
    /// The language runtimes a collection sees processes of.
    pub runtimes: RuntimeList,
}

/// Makes the language runtimes a collection sees processes of, each with no process
/// yet: [`crate::runtimes::supported`] by default; a test may hand runtimes of its own.
#[derive(Clone, Copy)]
pub struct RuntimeList(pub fn() -> Vec<Box<dyn Runtime>>);

impl Default for RuntimeList {
    fn default() -> Self {
        Self(crate::runtimes::supported)
    }
}

impl PartialEq for RuntimeList {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::fn_addr_eq(self.0, other.0)
    }
}

impl std::fmt::Debug for RuntimeList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = (self.0)().iter().map(|runtime| runtime.name()).collect();
        f.debug_tuple("RuntimeList").field(&names).finish()
    }
}

impl Default for CollectOptions {
    fn default() -> Self {
        Self {
            rate: DEFAULT_RATE,
            live: None,
            unwind: UnwindMode::Auto,
            stack_bytes: DEFAULT_STACK_BYTES,
            symbolize: true,
            confidence: Confidence::DEFAULT,
            thread_tables: ThreadTables::default(),
            allocator_prefixes: Vec::new(),
            empty_probes: false,
            raw_samples: None,
            budget: None,
            calibration: CalibrationChild::default(),
            timeline: false,
            runtimes: RuntimeList::default(),
        }
    }
}

impl CollectOptions {
    /// What discovery looks for, and whether stacks unwind through unprobed frames.
    pub fn lookup(&self) -> Lookup {
        Lookup {
            prefixes: self.allocator_prefixes.clone(),
            unwind_tables: self.unwind != UnwindMode::Fp,
        }
    }
}

/// Tracking of sampled blocks until they are freed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveOptions {
    /// How returns are observed.
    pub mechanism: LiveMechanism,
    /// Report the blocks still live at the end that are at least this old (leaks).
    pub leaks_min_age: Option<Duration>,
}

/// Which processes are profiled.
#[derive(Clone, Debug)]
pub enum Scope {
    /// One process, through the images it maps when profiling starts; the kernel
    /// filters on its pid, so no other process pays for the probes.
    Process(u32),
    /// Every process of the host that `filter` admits, through every allocator image
    /// in use, found at start and as processes exec.
    Host {
        /// Which processes are profiled.
        filter: ProcessFilter,
    },
}

impl Scope {
    /// The one process profiled, for [`Scope::Process`].
    pub fn pid(&self) -> Option<u32> {
        match self {
            Scope::Process(pid) => Some(*pid),
            Scope::Host { .. } => None,
        }
    }
}
