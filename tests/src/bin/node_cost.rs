//! What profiling costs a Node.js program (`cargo xtask bench --parts node`): the
//! Node.js workload (`workloads/node/alloc_sites.js`: small objects on the JS heap,
//! arrays in its large-object space, Buffers) on the machine's Node.js 20, its loop
//! timed by itself, bare, under `allocbpf --pid` and under `allocbpf agent` at its
//! defaults (one agent for its rounds). Rounds alternate bare and `--pid`; medians of
//! the JS heap's allocation throughput (V8's own accounting) and their ratios to bare
//! are printed, with the CPU the profiler spent per second of the loop.

use allocbpf_e2e::{
    bench::{compare_runs, rounds_arg, Workloads},
    node::{start_alloc_sites, Truth, NODE20},
    scratch_dir, Workload,
};
use anyhow::Result;

/// Blocks of the workload's loop per run (a few seconds).
const BLOCKS: &str = "2000000";

struct Node;

impl Workloads for Node {
    fn start(&mut self) -> Result<Workload> {
        start_alloc_sites(NODE20, BLOCKS, "1")
    }

    fn figures(&self, output: &str) -> Result<(f64, f64)> {
        let truth = Truth::parse(output)?;
        Ok((truth.allocated, truth.seconds))
    }
}

fn main() -> Result<()> {
    let title = format!("Node.js 20 alloc_sites.js ({BLOCKS} blocks)");
    compare_runs(&title, &scratch_dir("node-cost"), rounds_arg(5)?, &mut Node)
}
