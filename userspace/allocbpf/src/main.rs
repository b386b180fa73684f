//! The `allocbpf` command: the only crate that knows the command line.
//!
//! It parses flags ([`cli`], clap), turns them into the engine's plain options
//! (`allocbpf_collect::options`) or the agent's overrides, runs one of the modes (one
//! process, every process, the agent, `report`) and writes the report through
//! `allocbpf_export`. Errors reach the user here, as `anyhow` chains; it is the only
//! crate that prints (the libraries return what to say, or log through `tracing`).
//!
//! It also owns the eBPF program: `build.rs` builds `ebpf/allocbpf-ebpf` and
//! [`EBPF`] embeds the object, which the engine loads through
//! [`allocbpf_collect::kernel::EbpfObject`]. No library crate needs the BPF toolchain.

mod cli;
mod progress;
mod sink;

use std::process::ExitCode;

/// Every allocation of ours goes through an allocator linked into this binary, not the
/// host's libc malloc: that one carries our probes in every process (including this
/// one), and a trap per allocation of ours would cost us the kernel's whole uprobe
/// dispatch before the program saw that it was us.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use crate::cli::{Cli, Command, FormatArg, ReportArgs};
use crate::sink::Sink;
use allocbpf_collect::{
    budget::{self, BudgetOptions},
    engine::LiveMode,
    error::CollectError,
    filter::ProcessFilter,
    kernel::EbpfObject,
    options::{CollectOptions, LiveOptions, Scope, ThreadTables},
    preflight,
    run::{self, Started, StopReason},
};
use anyhow::{Context, Result};
use clap::Parser;

/// The eBPF program built from `ebpf/allocbpf-ebpf` by `build.rs`.
static EBPF: EbpfObject = EbpfObject(aya::include_bytes_aligned!(concat!(
    env!("OUT_DIR"),
    "/allocbpf.bpf.o"
)));

fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("ALLOCBPF_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

fn live_options(cli: &Cli) -> Option<LiveOptions> {
    (cli.live || cli.leaks).then_some(LiveOptions {
        mechanism: cli.live_mechanism.into(),
        leaks_min_age: cli.leaks.then_some(cli.min_age),
    })
}

/// The command line's collection options (every mode but the agent's).
fn collect_options(cli: &Cli) -> CollectOptions {
    CollectOptions {
        rate: cli.rate,
        live: live_options(cli),
        unwind: cli.unwind.into(),
        stack_bytes: cli.stack_bytes,
        symbolize: !cli.no_symbolize,
        confidence: cli.confidence,
        thread_tables: ThreadTables {
            slots: cli.thread_slots,
            overflow: cli.overflow_threads,
        },
        allocator_prefixes: cli.allocator_symbol.clone(),
        empty_probes: cli.empty_probes,
        raw_samples: cli.raw_samples.clone(),
        budget: cli.budget.map(|process_cpu| BudgetOptions {
            process_cpu,
            ..BudgetOptions::default()
        }),
        calibration: cli::calibration_child(),
        // Only the HTML page shows a timeline: recorded only for it.
        timeline: cli.format == FormatArg::Html,
        ..CollectOptions::default()
    }
}

/// allocbpf's command line as typed (the HTML page's header shows it).
fn command_line() -> String {
    std::env::args_os()
        .map(|arg| arg.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Exit status when the target exited before its probes were live (docs/operations.md,
/// "Exit status"): what was collected is still written.
const EXIT_TARGET_GONE: u8 = 3;

fn run(cli: Cli) -> Result<ExitCode> {
    match &cli.command {
        Some(Command::Calibrate { step }) => {
            let ns = budget::calibration_child(*step).context("calibration loop")?;
            // The parent reads the figure from our stdout.
            println!("{ns}");
            return Ok(ExitCode::SUCCESS);
        }
        Some(Command::Report(args)) => return run_report(args).map(|()| ExitCode::SUCCESS),
        Some(Command::Agent(args)) => {
            let stopped = allocbpf_agent::run(
                &EBPF,
                args.config.clone(),
                args.into(),
                cli::calibration_child(),
            )?;
            eprintln!(
                "allocbpf agent: stopped; {} profile(s) flushed, {} written in all, {} spooled for push",
                stopped.flushed, stopped.written, stopped.spooled
            );
            return match stopped.read_error {
                Some(error) => Err(anyhow::Error::new(error).context("reading the ring buffer")),
                None => Ok(ExitCode::SUCCESS),
            };
        }
        None => {}
    }
    // Output first: an unwritable path must fail before anything is attached.
    let sink = Sink::open(cli.output.as_deref())?;
    let Some(pid) = cli.pid else {
        return run_system_wide(&cli, sink).map(|()| ExitCode::SUCCESS);
    };
    preflight::check_privileges()?;
    preflight::check_kernel()?;
    preflight::raise_descriptor_limit();
    let options = collect_options(&cli);
    let finished = runtime()?.block_on(run::run(
        &EBPF,
        options,
        Scope::Process(pid),
        cli.duration,
        announce,
        progress::printer(),
    ));
    progress::clear();
    let run::Finished { report, stop, .. } = match finished {
        Err(CollectError::TargetExited { pid }) => {
            eprintln!("allocbpf: pid {pid} exited before its probes were live");
            return Ok(ExitCode::from(EXIT_TARGET_GONE));
        }
        finished => finished?,
    };
    let (samples, drops) = (report.totals.samples, report.totals.drops);
    let code = if stop == StopReason::ExitedDuringAttach {
        eprintln!(
            "allocbpf: pid {pid} exited before its probes were live: {samples} samples, {drops} dropped"
        );
        ExitCode::from(EXIT_TARGET_GONE)
    } else {
        eprintln!(
            "allocbpf: stopped ({stop}) after {:.1}s: {samples} samples, {drops} dropped",
            report.duration.as_secs_f64(),
        );
        ExitCode::SUCCESS
    };
    sink.write_with(|out| {
        allocbpf_export::write(&report, cli.format.into(), &command_line(), out)
    })?;
    Ok(code)
}

/// `allocbpf report`: the agent's stored profiles merged into one report.
fn run_report(args: &ReportArgs) -> Result<()> {
    let sink = Sink::open(args.output.as_deref())?;
    let comm = args
        .comm
        .as_deref()
        .map(regex::Regex::new)
        .transpose()
        .context("--comm is not a valid regex")?;
    if !args.store.is_dir() {
        anyhow::bail!(
            "--store {}: no such directory (the agent's --store, /var/lib/allocbpf by default)",
            args.store.display()
        );
    }
    let (report, merged) = allocbpf_agent::merge::merge_store(
        &args.store,
        args.since,
        comm.as_ref(),
        |path, error| eprintln!("allocbpf: skipping {}: {error}", path.display()),
    )?;
    eprintln!(
        "allocbpf: merged {merged} stored profile(s) from {}",
        args.store.display()
    );
    sink.write_with(|out| {
        allocbpf_export::write(&report, args.format.into(), &command_line(), out)
    })?;
    Ok(())
}

/// `allocbpf` without `--pid`: every process, one merged report.
fn run_system_wide(cli: &Cli, sink: Sink) -> Result<()> {
    let filter = ProcessFilter::new(&(&cli.filter).into()).map_err(crate::cli::filter_error)?;
    preflight::check_privileges()?;
    preflight::check_kernel()?;
    preflight::raise_descriptor_limit();
    if cli.leaks {
        anyhow::bail!("--leaks needs --pid (system-wide mode reports in-use bytes with --live)");
    }
    let scope = Scope::Host { filter };
    let options = collect_options(cli);
    let options = CollectOptions {
        // The benchmark floor is a one-process measurement.
        empty_probes: false,
        // Every process: always within a budget (the default one unless given).
        budget: options.budget.or(Some(BudgetOptions::default())),
        ..options
    };
    let finished = runtime()?.block_on(run::run(
        &EBPF,
        options,
        scope,
        cli.duration,
        announce,
        progress::printer(),
    ));
    progress::clear();
    let finished = finished?;
    let run::Finished { report, stop, host } = finished;
    if let Some(host) = host {
        eprintln!(
            "allocbpf: {} processes profiled, {} samples, {} exec events, {} images",
            host.processes, host.samples, host.exec_events, host.images
        );
    }
    match &report.note {
        // Still written below: an empty profile, valid in every format.
        Some(note) => eprintln!("allocbpf: stopped ({stop}): {note}"),
        None => eprintln!(
            "allocbpf: stopped ({stop}): {} samples, {} dropped",
            report.totals.samples, report.totals.drops
        ),
    }
    sink.write_with(|out| {
        allocbpf_export::write(&report, cli.format.into(), &command_line(), out)
    })?;
    Ok(())
}

/// Says on stderr what is profiled, through what (tests and xtask wait for these lines).
fn announce(started: &Started<'_>) {
    match started {
        Started::Host { images } => eprintln!(
            "allocbpf: profiling every process through {images} allocator image(s); Ctrl-C to stop"
        ),
        Started::Process { target, rate } => {
            let mut through: Vec<String> = target.images.iter().map(|i| i.describe()).collect();
            through.extend(target.runtimes.iter().cloned());
            eprintln!(
                "allocbpf: profiling pid {} ({}) through {}: {} probes, mean sampling interval {rate} bytes",
                target.pid,
                target.comm.to_string_lossy(),
                through.join("; "),
                target.probes,
            )
        }
        Started::LiveTracking { mode, frees } => {
            let how = match mode {
                LiveMode::Session => "uprobe session links (only sampled calls pay for the return)",
                LiveMode::Uretprobe => "uretprobes on every allocation call (no session links)",
                LiveMode::Off => "no return probes (benchmark floor)",
            };
            eprintln!("allocbpf: live tracking through {how}; {frees} deallocation entries probed");
        }
    }
}

fn main() -> ExitCode {
    preflight::keep_large_buffers_out_of_the_heap();
    let cli = Cli::parse();
    let verbose = match &cli.command {
        Some(Command::Agent(args)) => args.verbose.max(1),
        _ => cli.verbose,
    };
    init_logging(verbose);
    match run(cli) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("allocbpf: error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The defaults are defined once, in the engine's options: the flags' defaults
    /// (written as text for `--help`) must come out as exactly those.
    #[test]
    fn flag_defaults_are_the_engines_defaults() {
        let cli = Cli::try_parse_from(["allocbpf", "--pid", "1"]).unwrap();
        assert_eq!(
            collect_options(&cli),
            CollectOptions {
                // The binary knows how to start itself as the calibration child.
                calibration: cli::calibration_child(),
                ..CollectOptions::default()
            }
        );
        // `--budget 2%`: the default budget with 2% of a CPU per process.
        let cli = Cli::try_parse_from(["allocbpf", "--pid", "1", "--budget", "2%"]).unwrap();
        assert_eq!(
            collect_options(&cli).budget,
            Some(BudgetOptions {
                process_cpu: 0.02,
                ..BudgetOptions::default()
            })
        );
    }
}
