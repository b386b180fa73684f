//! `cargo xtask run` and `cargo xtask test`.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
};

use anyhow::{bail, Context, Result};

use crate::{
    setup,
    util::{
        attach, build_allocbpf, cargo, compile_c, finish, is_root, run as run_command, Workload,
    },
};

/// Builds allocbpf and runs it with `args`, or on the bundled demo workload.
pub fn run(args: &[String]) -> Result<()> {
    setup::ensure()?;
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
    let mut workload = Workload::start(&mut Command::new(binary))?;
    eprintln!(
        "xtask: demo workload pid {}: 7 sites, 357.6 MiB in 175,017 calls",
        workload.pid
    );
    let (profiler, stderr) = attach(
        allocbpf,
        &["--pid", &workload.pid, "--rate", "256KiB"],
        true,
    )?;
    workload.go()?;
    workload.child.wait()?;
    finish(profiler, stderr, true)
}

/// Formatting, clippy, unit tests and end-to-end tests.
pub fn test() -> Result<()> {
    setup::ensure()?;
    if !is_root() {
        bail!("the end-to-end tests attach real uprobes: run `sudo cargo xtask test`");
    }
    run_command(cargo().args(["fmt", "--all", "--", "--check"]))?;
    // The eBPF crate is its own workspace, which `--all` does not reach.
    run_command(cargo().args([
        "fmt",
        "--manifest-path",
        "ebpf/allocbpf-ebpf/Cargo.toml",
        "--",
        "--check",
    ]))?;
    run_command(cargo().args([
        "clippy",
        "--release",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    check_layering()?;
    let allocbpf = build_allocbpf()?;
    let mut command = cargo();
    command
        // --no-fail-fast: one failing test binary must not hide the others' results.
        .args(["test", "--release", "--workspace", "--no-fail-fast"])
        .env("ALLOCBPF_BIN", &allocbpf)
        .stdout(Stdio::piped());
    eprintln!("xtask: {command:?}");
    let mut child = command.spawn().context("cannot start cargo test")?;
    let (mut passed, mut failed) = (0u64, 0u64);
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line?;
        println!("{line}");
        if let Some((p, f)) = parse_test_result(&line) {
            passed += p;
            failed += f;
        }
    }
    let status = child.wait()?;
    // One closing line over every test binary (cargo's own last lines are doc-test
    // binaries with no tests).
    println!("summary: {passed} passed, {failed} failed");
    if !status.success() || failed > 0 || passed == 0 {
        bail!("tests failed: {status}");
    }
    Ok(())
}

/// The crate graph's rules (docs/design.md, "Crates, in the order data flows"): crates
/// each library must not link, directly or through another crate.
const LAYERING: &[(&str, &[&str])] = &[
    (
        "allocbpf-profile",
        &["aya", "tokio", "blazesym", "framehop", "clap"],
    ),
    (
        "allocbpf-export",
        &["aya", "tokio", "blazesym", "framehop", "clap"],
    ),
    ("allocbpf-probe", &["clap", "framehop"]),
    ("allocbpf-stacks", &["clap"]),
    ("allocbpf-collect", &["clap", "anyhow"]),
    ("allocbpf-agent", &["clap"]),
];

/// Checks [`LAYERING`] on the resolved dependency graph (`cargo tree`).
fn check_layering() -> Result<()> {
    for (krate, forbidden) in LAYERING {
        let output = cargo()
            .args(["tree", "-e", "normal", "--prefix", "none", "-p", krate])
            .output()
            .context("cannot run cargo tree")?;
        if !output.status.success() {
            bail!(
                "cargo tree -p {krate}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let tree = String::from_utf8_lossy(&output.stdout);
        let linked: Vec<&str> = tree
            .lines()
            .filter_map(|line| line.split_whitespace().next())
            .filter(|name| forbidden.contains(name))
            .collect();
        if !linked.is_empty() {
            bail!("{krate} must not link {linked:?} (docs/design.md: the crate graph's rules)");
        }
    }
    eprintln!("xtask: crate layering as docs/design.md states it");
    Ok(())
}

/// Reads `test result: ok. 7 passed; 0 failed; ...` into (7, 0).
fn parse_test_result(line: &str) -> Option<(u64, u64)> {
    let rest = line.strip_prefix("test result: ")?;
    // Each `;`-separated part ends in "<number> <word>".
    let count = |word: &str| {
        rest.split(';').find_map(|part| {
            let mut tokens = part.split_whitespace().rev();
            let (w, n) = (tokens.next()?, tokens.next()?);
            if w == word {
                n.parse().ok()
            } else {
                None
            }
        })
    };
    Some((count("passed")?, count("failed")?))
}

#[cfg(test)]
mod tests {
    use super::parse_test_result;

    #[test]
    fn cargo_result_lines_are_counted() {
        let line = "test result: ok. 30 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.02s";
        assert_eq!(parse_test_result(line), Some((30, 2)));
        let line = "test result: FAILED. 1 passed; 3 failed; 0 ignored";
        assert_eq!(parse_test_result(line), Some((1, 3)));
        assert_eq!(parse_test_result("running 3 tests"), None);
    }
}
