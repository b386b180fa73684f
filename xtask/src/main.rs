//! allocbpf's developer tasks: `cargo xtask <setup|run|test|bench|accuracy|soak>`.
//!
//! Every task first makes sure the machine has what it needs (`setup`), so a fresh
//! Debian machine needs no manual step.

mod accuracy;
mod bench;
mod bench_entries;
mod bench_latency;
mod run;
mod servers;
mod setup;
mod soak;
mod test;
mod tools;
mod util;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "allocbpf build, setup, test and benchmark tasks"
)]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what building and testing need, where missing (apt packages, bpf-linker).
    Setup,
    /// Build allocbpf, then run it: with no arguments on a bundled demo workload,
    /// otherwise with the given arguments (e.g. `-- --pid 1234 --rate 1MiB`).
    Run {
        /// Arguments for allocbpf.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Run every check and test: lane 1 (formatting, clippy, unit tests: no root, no
    /// BPF toolchain), then lane 2 (end-to-end tests, as root).
    Test {
        /// `checks`: lane 1 alone, which any machine can run.
        #[arg(long, value_enum, default_value = "all")]
        lane: test::Lane,
    },
    /// Measure ns per call: no probe, empty-program floor, allocbpf; per entry point of
    /// every allocator family; redis-benchmark throughput.
    Bench {
        /// Alternating rounds of the three configurations (medians are reported).
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// malloc+free pairs per run.
        #[arg(long, default_value_t = 2_000_000)]
        iterations: u64,
        /// Which parts to run: malloc+free pairs (with unwinding throughput), every
        /// entry point of every allocator family, redis-benchmark, the default agent's
        /// cost to gcc compiles and redis, a Python program's runtime, reading Go
        /// programs' heap profiles, a Java program's allocation throughput, a Node.js
        /// program's, how fast `--pid` goes in and out, the HTML report's size and
        /// paint; `push` (not in the default set): delivery to real profile stores.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "pairs,entries,redis,agent,python,go,jvm,node,latency,report"
        )]
        parts: Vec<bench::Part>,
        /// The allocator families the entries part measures (default: every one
        /// installed): glibc, musl, jemalloc, tcmalloc, mimalloc, cpython.
        #[arg(long, value_delimiter = ',')]
        families: Vec<String>,
    },
    /// Run the statistics harness (simulated trials through the kernel's sampling code,
    /// and, as root, the end-to-end coverage run) and print its figures.
    Accuracy {
        /// Also redraw the PNG figures of docs/statistics.md into docs/img/.
        #[arg(long)]
        plots: bool,
    },
    /// Soak the fleet agent (as root): a steady allocator plus hundreds of short-lived
    /// processes; prints the agent's RSS, samples and drops over time.
    Soak {
        /// How long.
        #[arg(long, default_value_t = 10.0)]
        minutes: f64,
        /// The agent's sampling rate (high: many samples).
        #[arg(long, default_value = "16KiB")]
        rate: String,
        /// Run the burst bench instead: real programs started at once under the
        /// default agent (samples, drops, ring and queue peaks, resident memory).
        #[arg(long)]
        burst: bool,
    },
}

fn main() -> Result<()> {
    match Cli::parse().task {
        Task::Setup => setup::ensure(),
        Task::Run { args } => run::run(&args),
        Task::Test { lane } => test::test(lane),
        Task::Bench {
            rounds,
            iterations,
            parts,
            families,
        } => bench::bench(rounds, iterations, &parts, &families),
        Task::Accuracy { plots } => accuracy::accuracy(plots),
        Task::Soak {
            minutes,
            rate,
            burst,
        } => soak::soak(minutes, &rate, burst),
    }
}
