//! The accuracy harness's workloads: known truth, each built to stress one property
//! of the sampler (issue 3's list).

use allocbpf_common::sampler::array_bytes;

use crate::simulate::Alloc;

/// A simulated workload: a fixed sequence of allocations with named sites.
pub struct SimWorkload {
    /// Short name for tables and plots.
    pub name: String,
    /// What it checks.
    pub what: &'static str,
    /// Mean sampling interval it runs at.
    pub rate: u64,
    /// Site names, indexed by [`Alloc::site`].
    pub sites: Vec<&'static str>,
    /// Number of threads (each with its own countdown).
    pub threads: usize,
    /// The allocations, in program order.
    pub allocations: Vec<Alloc>,
}

impl SimWorkload {
    /// Exact bytes per site.
    pub fn truth(&self) -> Vec<u64> {
        let mut truth = vec![0; self.sites.len()];
        for a in &self.allocations {
            truth[a.site] += a.size;
        }
        truth
    }
}

/// The harness's rate: small enough that every site gets tens to hundreds of samples
/// per trial, so 2,000 trials run in seconds.
pub const SIM_RATE: u64 = 64 * 1024;

fn alloc(thread: usize, site: usize, size: u64) -> Alloc {
    Alloc { thread, site, size }
}

/// Many small allocations from one site, a few huge ones (certain) from another.
pub fn small_and_huge() -> SimWorkload {
    let mut allocations = Vec::new();
    for i in 0..20_000 {
        allocations.push(alloc(0, 0, 256));
        if i % 2_500 == 0 {
            allocations.push(alloc(0, 1, 1 << 20));
        }
    }
    SimWorkload {
        name: "small_and_huge".into(),
        what: "20,000 x 256 B from one site; 8 x 1 MiB (above the certain threshold) from another",
        rate: SIM_RATE,
        sites: vec!["small_256B", "huge_1MiB"],
        threads: 1,
        allocations,
    }
}

/// Sizes just under and just over the rate, interleaved.
pub fn around_the_rate() -> SimWorkload {
    let allocations = (0..400)
        .flat_map(|_| [alloc(0, 0, SIM_RATE - 512), alloc(0, 1, SIM_RATE + 512)])
        .collect();
    SimWorkload {
        name: "around_rate".into(),
        what: "400 x (R - 512 B) and 400 x (R + 512 B), alternating",
        rate: SIM_RATE,
        sites: vec!["just_under_R", "just_over_R"],
        threads: 1,
        allocations,
    }
}

/// Every 64th allocation is large: the pattern a fixed-stride sampler aliases with.
pub fn periodic() -> SimWorkload {
    let allocations = (0..64_000)
        .map(|i| {
            if i % 64 == 63 {
                alloc(0, 1, 16 << 10)
            } else {
                alloc(0, 0, 64)
            }
        })
        .collect();
    SimWorkload {
        name: "periodic".into(),
        what: "64,000 allocations: 63 of every 64 are 64 B, every 64th is 16 KiB",
        rate: SIM_RATE,
        sites: vec!["periodic_64B", "every_64th_16KiB"],
        threads: 1,
        allocations,
    }
}

/// The same 16 MiB of 1 KiB allocations from one site, round-robin over `threads`.
pub fn split_across_threads(threads: usize) -> SimWorkload {
    let allocations = (0..16_384).map(|i| alloc(i % threads, 0, 1024)).collect();
    SimWorkload {
        name: format!("threads_{threads}"),
        what: "16,384 x 1 KiB from one site, round-robin across threads",
        rate: SIM_RATE,
        sites: vec!["site"],
        threads,
        allocations,
    }
}

/// calloc / realloc-chain / aligned allocation mixes, sized as the probe sizes them.
pub fn allocator_mix() -> SimWorkload {
    let mut allocations = Vec::new();
    for i in 0..2_000u64 {
        // calloc(16, 100); every 500th calloc overflows and counts 0 bytes.
        let calloc = if i % 500 == 0 {
            array_bytes(u64::MAX / 2, 3)
        } else {
            array_bytes(16, 100)
        };
        allocations.push(alloc(0, 0, calloc));
        // aligned_alloc(64, 3000) and posix_memalign(.., 4096, 10000) alternate.
        allocations.push(alloc(0, 1, if i % 2 == 0 { 3000 } else { 10_000 }));
        if i % 8 == 0 {
            // A realloc chain: 1 KiB growing to 32 KiB; each realloc counts its new size.
            for shift in 0..6 {
                allocations.push(alloc(0, 2, 1024 << shift));
            }
        }
    }
    SimWorkload {
        name: "mix".into(),
        what: "calloc(16,100) with overflowing calls, aligned_alloc/posix_memalign, realloc chains",
        rate: SIM_RATE,
        sites: vec!["calloc", "aligned", "realloc_chain"],
        threads: 1,
        allocations,
    }
}

/// Every workload of the harness.
pub fn all() -> Vec<SimWorkload> {
    vec![
        small_and_huge(),
        around_the_rate(),
        periodic(),
        split_across_threads(1),
        split_across_threads(4),
        split_across_threads(16),
        allocator_mix(),
    ]
}
