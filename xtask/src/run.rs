//! `cargo xtask run`: build allocbpf and profile the demo workload (or what it is told).

use std::process::Command;

use allocbpf_harness::Workload;
use anyhow::{bail, Result};

use crate::{
    setup,
    util::{attach, build_allocbpf, compile_c, finish, is_root},
};

/// Builds allocbpf and runs it with `args`, or on the bundled demo workload.
pub fn run(args: &[String]) -> Result<()> {
    setup::ensure_run()?;
    let allocbpf = build_allocbpf()?;
    if !args.is_empty() {
        // allocbpf explains its own failures; pass its exit code through unchanged.
        let status = Command::new(&allocbpf).args(args).status()?;
        std::process::exit(status.code().unwrap_or(1));
    }
    demo(&allocbpf)
}

/// Profiles tests/workloads/sites.c (seven allocation sites with known totals).
fn demo(allocbpf: &std::path::Path) -> Result<()> {
    if !is_root() {
        bail!("allocbpf loads eBPF programs: run `sudo cargo xtask run`");
    }
    let binary = compile_c("sites", &["-O1", "-g", "-fno-omit-frame-pointer"])?;
    let mut workload = Workload::start(&binary, &[])?;
    eprintln!(
        "xtask: demo workload pid {}: 7 sites, 357.6 MiB in 175,017 calls",
        workload.pid
    );
    let (profiler, stderr) = attach(
        allocbpf,
        &["--pid", &workload.pid.to_string(), "--rate", "256KiB"],
        true,
    )?;
    workload.go()?;
    workload.child.wait()?;
    finish(profiler, stderr, true)
}
