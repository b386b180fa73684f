//! What profiling costs a Java program (`cargo xtask bench --parts jvm`): the JVM
//! workload (`workloads/java/AllocSites.java`: byte arrays and small objects in TLABs)
//! on Debian's OpenJDK 17 with a fixed 2 GiB heap, its loop timed by itself, bare,
//! under `allocbpf --pid` and under `allocbpf agent` at its defaults (one agent for its
//! rounds). Rounds alternate bare and `--pid`; medians of the allocation throughput
//! and their ratios to bare are printed, with the CPU the profiler spent per second of
//! the JVM's loop (`--pid`: allocbpf's own; the agent: its CPU over its rounds).

use allocbpf_e2e::{
    bench::{compare_runs, rounds_arg, Workloads},
    jvm::{output_value, start_alloc_sites, truth, Site, JDK17},
    scratch_dir, Workload,
};
use anyhow::{Context, Result};

/// Iterations of the workload's main loop per run (a few seconds).
const ITERATIONS: &str = "200000000";

/// Big arrays per run: none (their humongous allocations make the collector's pace,
/// and the loop's, vary from run to run).
const BIG_ARRAYS: &str = "0";

/// A fixed heap, touched at start: the collector's sizing and first-touch page faults
/// do not change between runs.
const JVM_OPTIONS: &[&str] = &["-Xms2g", "-Xmx2g", "-XX:+AlwaysPreTouch"];

struct Jvm;

impl Workloads for Jvm {
    fn start(&mut self) -> Result<Workload> {
        start_alloc_sites(JDK17, JVM_OPTIONS, ITERATIONS, "1", BIG_ARRAYS)
    }

    fn figures(&self, output: &str) -> Result<(f64, f64)> {
        let seconds = output_value(output, "loop_ns").context("loop_ns")? / 1e9;
        let bytes: f64 = truth(output)?.0.iter().map(Site::bytes).sum();
        Ok((bytes, seconds))
    }
}

fn main() -> Result<()> {
    let title = format!("OpenJDK 17 AllocSites ({ITERATIONS} iterations, {BIG_ARRAYS} big arrays)");
    compare_runs(&title, &scratch_dir("jvm-cost"), rounds_arg(5)?, &mut Jvm)
}
