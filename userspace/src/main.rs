//! The `allocbpf` command.

use std::process::ExitCode;

use allocbpf::{
    cli::Cli,
    export,
    preflight::{self, Sink},
    probe::ThreadTables,
    session::{self, LiveOptions, SessionOptions},
};
use anyhow::{Context, Result};
use clap::Parser;

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

fn run(cli: Cli) -> Result<()> {
    // Output first: an unwritable path must fail before anything is attached.
    let sink = Sink::open(cli.output.as_deref())?;
    preflight::check_privileges()?;
    preflight::check_kernel()?;
    let options = SessionOptions {
        pid: cli.pid,
        rate: cli.rate,
        duration: cli.duration,
        empty_probes: cli.empty_probes,
        live: (cli.live || cli.leaks).then_some(LiveOptions {
            mechanism: cli.live_mechanism,
            leaks_min_age: cli.leaks.then_some(cli.min_age),
        }),
        unwind: cli.unwind,
        symbolize: !cli.no_symbolize,
        stack_bytes: cli.stack_bytes,
        confidence: cli.confidence,
        raw_samples: cli.raw_samples.clone(),
        thread_tables: ThreadTables {
            slots: cli.thread_slots,
            overflow: cli.overflow_threads,
        },
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let (report, stop) = runtime.block_on(session::run(&options))?;
    eprintln!(
        "allocbpf: stopped ({stop}) after {:.1}s: {} samples, {} dropped",
        report.duration.as_secs_f64(),
        report.totals.samples,
        report.totals.drops
    );
    sink.write_with(|out| export::write(&report, cli.format, out))?;
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("allocbpf: error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
