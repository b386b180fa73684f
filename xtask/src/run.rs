//! `cargo xtask run` and `cargo xtask test`.

use std::{
    io::{BufRead, BufReader, Write},
    process::{Command, Stdio},
};

use anyhow::{bail, Context, Result};

use crate::{
    setup,
    util::{build_allocbpf, cargo, compile_c, is_root, root, run as run_command},
};

/// Builds allocbpf and runs it with `args`, or on the bundled demo workload.
pub fn run(args: &[String]) -> Result<()> {
    setup::ensure()?;
    let allocbpf = build_allocbpf()?;
    if !args.is_empty() {
        return run_command(Command::new(&allocbpf).args(args));
    }
    demo(&allocbpf)
}

/// Profiles tests/workloads/sites.c (seven allocation sites with known totals).
fn demo(allocbpf: &std::path::Path) -> Result<()> {
    if !is_root() {
        bail!("allocbpf loads eBPF programs: run `sudo cargo xtask run`");
    }
    let workload = compile_c("sites", &["-O1", "-g", "-fno-omit-frame-pointer"])?;
    let mut target = Command::new(&workload)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut lines = BufReader::new(target.stdout.take().unwrap()).lines();
    let pid = lines.next().context("demo workload pid")??;
    eprintln!("xtask: demo workload pid {pid}: 7 sites, 357.6 MiB in 175,017 calls");
    let mut profiler = Command::new(allocbpf)
        .args(["--pid", pid.trim(), "--rate", "256KiB"])
        .stderr(Stdio::piped())
        .spawn()?;
    let mut stderr = BufReader::new(profiler.stderr.take().unwrap()).lines();
    for line in stderr.by_ref() {
        let line = line?;
        eprintln!("{line}");
        if line.contains("profiling pid") {
            break;
        }
    }
    target.stdin.take().unwrap().write_all(b"go\n")?;
    target.wait()?;
    for line in stderr {
        eprintln!("{}", line?);
    }
    let status = profiler.wait()?;
    if !status.success() {
        bail!("allocbpf failed: {status}");
    }
    Ok(())
}

/// Formatting, clippy, unit tests and end-to-end tests.
pub fn test() -> Result<()> {
    setup::ensure()?;
    if !is_root() {
        bail!("the end-to-end tests attach real uprobes: run `sudo cargo xtask test`");
    }
    run_command(cargo().args(["fmt", "--all", "--", "--check"]))?;
    run_command(cargo().args([
        "clippy",
        "--release",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    let allocbpf = build_allocbpf()?;
    run_command(
        cargo()
            .args(["test", "--release", "--workspace"])
            .env("ALLOCBPF_BIN", &allocbpf)
            .current_dir(root()),
    )
}
