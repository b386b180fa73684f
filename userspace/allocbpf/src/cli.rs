//! The command line. Others script against it: extend it, never change what a flag means.

use std::{path::PathBuf, time::Duration};

use clap::Parser;

use allocbpf_collect::budget::CalibrationChild;
use allocbpf_collect::options::{LiveMechanism, UnwindMode};
use allocbpf_export::Format;
use allocbpf_profile::estimate::Confidence;
use allocbpf_profile::units::{parse_duration, parse_size};

pub use allocbpf_profile::units::{MAX_DURATION, MAX_RATE};

/// allocbpf: sample heap allocations with eBPF uprobes on libc malloc, in one running
/// process (--pid) or in every process of the host.
///
/// Each allocated byte is sampled with probability 1/RATE (Poisson sampling, as in
/// tcmalloc, jemalloc and heapprofd); each sample is unbiased by S/(1-exp(-S/RATE))
/// before aggregation, so estimated bytes per stack are unbiased. Needs root (or
/// CAP_BPF + CAP_PERFMON) and a kernel with uprobes and BTF.
#[derive(Debug, Parser)]
#[command(
    name = "allocbpf",
    version,
    about,
    long_about,
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    /// `agent` or `report`; without one, profile now and print the profile.
    #[command(subcommand)]
    pub command: Option<Command>,

    /// Process to profile. Without it, every process of the host is profiled
    /// (system-wide), allocbpf itself excepted.
    #[arg(short, long)]
    pub pid: Option<u32>,

    /// Also probe files defining PREFIXmalloc, PREFIXcalloc, ... (e.g. je_ for a
    /// prefixed jemalloc). Repeatable. A program's own unprefixed malloc (statically
    /// linked, or a custom allocator) is always probed.
    #[arg(long = "allocator-symbol", value_name = "PREFIX")]
    pub allocator_symbol: Vec<String>,

    /// Selects which processes are profiled (system-wide).
    #[command(flatten)]
    pub filter: FilterArgs,

    /// Mean sampling interval in bytes: 4096, 512KiB, 1MiB, 1M, 2MB. K/M/G and
    /// KiB/MiB/GiB are powers of 1024; KB/MB/GB are powers of 1000.
    #[arg(short, long, default_value = "512KiB", value_parser = parse_rate, allow_hyphen_values = true)]
    pub rate: u64,

    /// Stop after this long (500ms, 30s, 5m, 1h). Without it, profiling stops when the
    /// target exits or on Ctrl-C / SIGTERM.
    #[arg(short, long, value_parser = parse_run_duration, allow_hyphen_values = true)]
    pub duration: Option<Duration>,

    /// Overhead budget: at most this share of one CPU per process spent in probes
    /// (1%, 0.5%). Probes are then in only part of the time, in randomly placed windows,
    /// and every estimate is scaled up to the whole run (docs/statistics.md, "Time
    /// sampling"). With --pid the default is none (probed full time); system-wide, 1%.
    #[arg(long, value_parser = parse_budget)]
    pub budget: Option<f64>,

    /// Write the profile here instead of stdout (checked before anything is attached).
    /// A new file is created 0600; an existing one must be yours; a symbolic link is
    /// followed only to a device or FIFO.
    #[arg(short, long)]
    pub output: Option<PathBuf>,

    /// Output format.
    #[arg(short, long, value_enum, default_value_t = FormatArg::Text)]
    pub format: FormatArg,

    /// Also track sampled allocations until they are freed: adds in-use (still live)
    /// estimates per stack (pprof inuse_objects/inuse_space, JSON inuse_bytes).
    #[arg(long)]
    pub live: bool,

    /// Report sampled allocations still live and older than --min-age, grouped by stack
    /// (implies --live).
    #[arg(long)]
    pub leaks: bool,

    /// Minimum age of a live allocation to be reported by --leaks (500ms, 30s, 5m).
    #[arg(long, default_value = "30s", value_parser = parse_min_age, allow_hyphen_values = true)]
    pub min_age: Duration,

    /// How --live observes returns (auto: session links where the kernel has them).
    #[arg(long, hide = true, value_enum, default_value_t = LiveMechanismArg::Auto)]
    pub live_mechanism: LiveMechanismArg,

    /// How user stacks are unwound. auto: copy the top of the stack and unwind it in
    /// userspace with each module's unwind tables, following frame pointers where a
    /// module has none; dwarf: the same, but stop at code without unwind tables; fp:
    /// frame pointers, walked in the kernel (smallest events, but binaries built without
    /// frame pointers give truncated stacks).
    #[arg(long, value_enum, default_value_t = UnwindArg::Auto)]
    pub unwind: UnwindArg,

    /// Do not symbolize: frames keep module + file offset, and pprof profiles carry
    /// addresses and mappings with build ids only, for a symbolizer elsewhere.
    #[arg(long)]
    pub no_symbolize: bool,

    /// Bytes of user stack copied per sample for auto/dwarf unwinding: 4KiB, 8KiB,
    /// 16KiB or 32KiB. Deeper stacks are cut where the copy ends.
    #[arg(long, default_value = "16KiB", value_parser = parse_stack_bytes)]
    pub stack_bytes: u32,

    /// Level of the confidence intervals shown for every estimate (0.5 to 0.9999).
    #[arg(long, default_value = "0.95", value_parser = parse_confidence)]
    pub confidence: Confidence,

    /// Also write every sample as it arrives, one JSON object per line (pid, tid, size,
    /// offset, next_interval, certain): the raw input of the estimator, for analysis.
    #[arg(long, value_name = "FILE")]
    pub raw_samples: Option<PathBuf>,

    /// More log output on stderr (-v: info, -vv: debug).
    #[arg(short, long, action = clap::ArgAction::Count)]
    pub verbose: u8,

    /// Attach an empty program instead of the sampler (benchmark floor; no profile).
    #[arg(long, hide = true)]
    pub empty_probes: bool,

    /// Direct-mapped thread slots (power of two; tests shrink it to force collisions).
    #[arg(long, hide = true, default_value_t = allocbpf_collect::options::THREAD_SLOTS_LEN,
          value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
    pub thread_slots: u32,

    /// Overflow thread entries (tests shrink it to force the per-CPU fallback).
    #[arg(long, hide = true, default_value_t = allocbpf_collect::options::MAX_OVERFLOW_THREADS,
          value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
    pub overflow_threads: u32,
}

/// `--comm`, `--exclude-comm`, `--cgroup`.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct FilterArgs {
    /// Profile only processes whose command name (/proc/PID/comm) matches this regex.
    #[arg(long, value_name = "REGEX")]
    pub comm: Option<String>,
    /// Do not profile processes whose command name matches this regex.
    #[arg(long, value_name = "REGEX")]
    pub exclude_comm: Option<String>,
    /// Profile only processes in this cgroup (v2) or below it: a path relative to the
    /// cgroup root (/system.slice/nginx.service) or under /sys/fs/cgroup.
    #[arg(long, value_name = "PATH")]
    pub cgroup: Option<String>,
}

impl From<&AgentArgs> for allocbpf_agent::config::AgentOverrides {
    fn from(args: &AgentArgs) -> Self {
        Self {
            store: args.store.clone(),
            interval: args.interval,
            push: args.push.clone(),
            metrics_address: args.metrics_address.clone(),
            rate: args.rate,
        }
    }
}

impl From<&FilterArgs> for allocbpf_collect::filter::FilterOptions {
    fn from(args: &FilterArgs) -> Self {
        Self {
            comm: args.comm.clone(),
            exclude_comm: args.exclude_comm.clone(),
            cgroup: args.cgroup.clone(),
        }
    }
}

/// A filter error in the command line's words (the library names its options).
pub fn filter_error(error: allocbpf_collect::filter::FilterError) -> anyhow::Error {
    use allocbpf_collect::filter::FilterError;
    match error {
        FilterError::Regex {
            key,
            pattern,
            source,
        } => anyhow::anyhow!(
            "--{} {pattern:?} is not a valid regex: {source}",
            key.replace('_', "-")
        ),
        FilterError::NoSuchCgroup(path, relative) => {
            anyhow::anyhow!("--cgroup {path}: no such cgroup (looked for /sys/fs/cgroup{relative})")
        }
    }
}

/// `--format` (the library's [`Format`]; clap stays in the binary's module).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum FormatArg {
    /// A table of the top stacks, exact vs estimated totals and drops.
    Text,
    /// Machine-readable JSON (schema: README.md, "Formats").
    Json,
    /// gzipped pprof profile.proto (Go heap conventions).
    Pprof,
    /// Folded stacks: `outer;...;inner estimated_bytes`.
    Folded,
    /// A flamegraph (inferno) of estimated bytes.
    Svg,
    /// One self-contained HTML page: flame graph, tables, timeline (docs/operations.md).
    Html,
}

impl From<FormatArg> for Format {
    fn from(arg: FormatArg) -> Self {
        match arg {
            FormatArg::Text => Format::Text,
            FormatArg::Json => Format::Json,
            FormatArg::Pprof => Format::Pprof,
            FormatArg::Folded => Format::Folded,
            FormatArg::Svg => Format::Svg,
            FormatArg::Html => Format::Html,
        }
    }
}

/// `--unwind` (the library's [`UnwindMode`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum UnwindArg {
    /// Unwind tables where a module has them, frame pointers elsewhere.
    Auto,
    /// Unwind tables only.
    Dwarf,
    /// Frame pointers, in the kernel.
    Fp,
}

impl From<UnwindArg> for UnwindMode {
    fn from(arg: UnwindArg) -> Self {
        match arg {
            UnwindArg::Auto => UnwindMode::Auto,
            UnwindArg::Dwarf => UnwindMode::Dwarf,
            UnwindArg::Fp => UnwindMode::Fp,
        }
    }
}

/// `--live-mechanism` (the library's [`LiveMechanism`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LiveMechanismArg {
    /// uprobe session links where the kernel has them (6.13+), else uretprobes.
    Auto,
    /// A uretprobe on every allocation call (the fallback; for comparison).
    Uretprobe,
}

impl From<LiveMechanismArg> for LiveMechanism {
    fn from(arg: LiveMechanismArg) -> Self {
        match arg {
            LiveMechanismArg::Auto => LiveMechanism::Auto,
            LiveMechanismArg::Uretprobe => LiveMechanism::Uretprobe,
        }
    }
}

/// Subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Run as the fleet node agent: profile every process continuously, cut one
    /// profile per process every interval, store them locally and optionally push them
    /// to Grafana Pyroscope. docs/operations.md has the details.
    Agent(AgentArgs),
    /// Merge profiles the agent stored into one report.
    Report(ReportArgs),
    /// The agent's start-up calibration workload (internal).
    #[command(name = "__calibrate", hide = true)]
    Calibrate {
        /// Call the single-step calibration function instead of malloc.
        #[arg(long)]
        step: bool,
    },
}

/// How the engine starts its calibration child: this executable under the hidden
/// `__calibrate` subcommand above.
pub fn calibration_child() -> CalibrationChild {
    CalibrationChild {
        loop_args: vec!["__calibrate".into()],
        step_args: vec!["__calibrate".into(), "--step".into()],
    }
}

/// `allocbpf agent`. Flags override the config file.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct AgentArgs {
    /// TOML config file (docs/operations.md lists every key). SIGHUP reloads it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Directory of the local profile store (default /var/lib/allocbpf).
    #[arg(long, value_name = "DIR")]
    pub store: Option<PathBuf>,
    /// How often one profile per process is cut (default 60s).
    #[arg(long, value_parser = parse_interval)]
    pub interval: Option<Duration>,
    /// Also push every profile to this Pyroscope server (http:// or https://). The
    /// credentials come from the config file's credentials_file or the environment
    /// (ALLOCBPF_PUSH_TOKEN, ALLOCBPF_PUSH_USER + ALLOCBPF_PUSH_PASSWORD), never argv.
    #[arg(long, value_name = "URL")]
    pub push: Option<String>,
    /// Serve Prometheus self-metrics on this address (default 127.0.0.1:9464; "off"
    /// disables).
    #[arg(long, value_name = "ADDR")]
    pub metrics_address: Option<String>,
    /// Mean sampling interval in bytes (default 512KiB).
    #[arg(long, value_parser = parse_rate)]
    pub rate: Option<u64>,
    /// More log output on stderr (-v: info, -vv: debug).
    #[arg(short, long, action = clap::ArgAction::Count)]
    pub verbose: u8,
}

/// `allocbpf report`.
#[derive(Clone, Debug, clap::Args)]
pub struct ReportArgs {
    /// The agent's store directory.
    #[arg(long, value_name = "DIR")]
    pub store: PathBuf,
    /// Only profiles whose interval ended at most this long ago (30m, 1h, 7d).
    #[arg(long, value_parser = parse_run_duration)]
    pub since: Option<Duration>,
    /// Only processes whose command name matches this regex.
    #[arg(long, value_name = "REGEX")]
    pub comm: Option<String>,
    /// Output format.
    #[arg(short, long, value_enum, default_value_t = FormatArg::Text)]
    pub format: FormatArg,
    /// Write the report here instead of stdout (as --output of a profile: created
    /// 0600, no symbolic link to a file followed).
    #[arg(short, long)]
    pub output: Option<PathBuf>,
}

fn parse_interval(text: &str) -> Result<Duration, String> {
    let interval =
        parse_duration(text, MAX_DURATION).map_err(|e| format!("{e} (example: --interval 60s)"))?;
    if interval < Duration::from_secs(1) {
        return Err(format!("{text} is shorter than the minimum interval, 1s"));
    }
    Ok(interval)
}

fn parse_rate(text: &str) -> Result<u64, String> {
    parse_size(text, MAX_RATE).map_err(|e| format!("{e} (example: --rate 512KiB)"))
}

fn parse_confidence(text: &str) -> Result<Confidence, String> {
    let level: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("'{text}' is not a number (example: --confidence 0.9)"))?;
    Confidence::new(level).map_err(|error| format!("{error} (example: --confidence 0.9)"))
}

fn parse_stack_bytes(text: &str) -> Result<u32, String> {
    let bytes =
        parse_size(text, 1 << 20).map_err(|e| format!("{e} (example: --stack-bytes 16KiB)"))?;
    allocbpf_collect::options::STACK_COPY_SIZES
        .iter()
        .copied()
        .find(|&s| u64::from(s) == bytes)
        .ok_or_else(|| format!("--stack-bytes must be 4KiB, 8KiB, 16KiB or 32KiB, not {text}"))
}

fn parse_budget(text: &str) -> Result<f64, String> {
    let number = text.trim().trim_end_matches('%');
    match number.parse::<f64>() {
        Ok(percent) if percent > 0.0 && percent <= 100.0 => Ok(percent / 100.0),
        _ => Err(format!(
            "{text:?} is not a share of a CPU in percent, in (0, 100] (e.g. 1% or 0.5%)"
        )),
    }
}

fn parse_min_age(text: &str) -> Result<Duration, String> {
    parse_duration(text, MAX_DURATION).map_err(|e| format!("{e} (example: --min-age 30s)"))
}

fn parse_run_duration(text: &str) -> Result<Duration, String> {
    parse_duration(text, MAX_DURATION).map_err(|e| format!("{e} (example: --duration 30s)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("allocbpf").chain(args.iter().copied()))
    }

    #[test]
    fn defaults() {
        let cli = parse(&["--pid", "1"]).unwrap();
        assert_eq!(cli.pid, Some(1));
        assert!(cli.command.is_none());
        assert_eq!(cli.rate, 512 * 1024);
        assert_eq!(cli.format, FormatArg::Text);
        assert!(cli.duration.is_none());
        assert_eq!(cli.confidence, Confidence::DEFAULT);
    }

    /// The engine starts its calibration child with these arguments: they must parse
    /// into the hidden subcommand, each loop as itself.
    #[test]
    fn the_calibration_child_arguments_are_the_hidden_subcommand() {
        let child = calibration_child();
        for (args, want) in [(child.loop_args, false), (child.step_args, true)] {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let cli = parse(&args).unwrap();
            assert!(
                matches!(cli.command, Some(Command::Calibrate { step }) if step == want),
                "{args:?}"
            );
        }
    }

    #[test]
    fn subcommands_parse() {
        let cli = parse(&["agent", "--store", "/tmp/s", "--interval", "5s"]).unwrap();
        let Some(Command::Agent(agent)) = cli.command else {
            panic!("not agent");
        };
        assert_eq!(agent.interval, Some(Duration::from_secs(5)));
        let cli = parse(&["report", "--store", "/tmp/s", "--since", "1h"]).unwrap();
        assert!(matches!(cli.command, Some(Command::Report(_))));
        assert!(parse(&["agent", "--interval", "10ms"]).is_err());
        assert!(parse(&["--comm", "^nginx$"]).unwrap().pid.is_none());
    }

    #[test]
    fn bad_values_are_rejected_with_their_reason() {
        for (args, needle) in [
            (&["--pid", "1", "--rate", "0"][..], "greater than zero"),
            (&["--pid", "1", "--rate", "-4K"][..], "greater than zero"),
            (&["--pid", "1", "--rate", "lots"][..], "not a number"),
            (
                &["--pid", "1", "--rate", "2G"][..],
                "larger than the maximum",
            ),
            (&["--pid", "1", "--duration", "0s"][..], "greater than zero"),
            (&["--pid", "1", "--duration", "1000d"][..], "unknown unit"),
            (
                &["--pid", "1", "--duration", "9999h"][..],
                "larger than the maximum",
            ),
            (&["--pid", "x"][..], "invalid digit"),
            (
                &["--pid", "1", "--confidence", "95"][..],
                "outside 0.5..=0.9999",
            ),
            (&["--pid", "1", "--confidence", "high"][..], "not a number"),
            (&["--pid", "1", "--min-age", "-1s"][..], "greater than zero"),
            (
                &["--pid", "1", "--stack-bytes", "10KiB"][..],
                "must be 4KiB",
            ),
        ] {
            let err = parse(args).unwrap_err().to_string();
            assert!(err.contains(needle), "{args:?}: {err}");
        }
    }
}
