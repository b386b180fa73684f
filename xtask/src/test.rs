//! `cargo xtask test`: two lanes.
//!
//! 1. **checks**: formatting, clippy on every crate (the eBPF one included, for the host
//!    target), the crate graph's rules and every unit test. It needs neither root nor
//!    the BPF toolchain (the binary is built with `ALLOCBPF_BPF_TOOLCHAIN=none`), so a
//!    contributor's machine runs it as it is: `cargo xtask test --lane checks`.
//! 2. **end-to-end** (root): installs what is missing, runs the unit tests that need
//!    root (`#[ignore = "needs root: ..."]`: they open files through
//!    `/proc/PID/map_files` or mount), builds the real binary and runs the end-to-end
//!    tests against real processes, probes and servers.
//!
//! One closing line counts the tests of both lanes.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
};

use anyhow::{bail, Context, Result};

use crate::{
    setup,
    util::{build_allocbpf, cargo, is_root, root, run},
};

/// Which lanes `cargo xtask test` runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Lane {
    /// The checks lane only (no root, no BPF toolchain).
    Checks,
    /// The checks lane, then the end-to-end lane (root).
    All,
}

/// Runs `lane`; the closing line counts every test run, whatever stopped the lanes.
pub fn test(lane: Lane) -> Result<()> {
    let mut counts = Counts::default();
    let result = lanes(lane, &mut counts);
    counts.print();
    result.and_then(|()| counts.verdict())
}

/// The lanes in order. A failed unit test does not stop the end-to-end lane (one
/// failure must not hide the other results); a failed format or lint check does.
fn lanes(lane: Lane, counts: &mut Counts) -> Result<()> {
    checks(counts)?;
    if lane == Lane::Checks {
        return Ok(());
    }
    if !is_root() {
        let verdict = match counts.verdict() {
            Ok(()) => "passed",
            Err(_) => "failed",
        };
        bail!(
            "the checks lane {verdict}; the end-to-end lane attaches real uprobes: run \
             `sudo cargo xtask test` (or `cargo xtask test --lane checks` for the checks alone)"
        );
    }
    end_to_end(counts)
}

/// Lane 1: everything that needs neither root nor the BPF toolchain.
fn checks(counts: &mut Counts) -> Result<()> {
    eprintln!("xtask: lane 1, checks (no root, no BPF toolchain)");
    setup::ensure_unit_test_packages()?;
    run(cargo().args(["fmt", "--all", "--", "--check"]))?;
    // The eBPF crate is its own workspace, which `--all` does not reach.
    let ebpf_manifest = "ebpf/allocbpf-ebpf/Cargo.toml";
    run(cargo().args(["fmt", "--manifest-path", ebpf_manifest, "--", "--check"]))?;
    run(cargo()
        .args([
            "clippy",
            "--release",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ])
        .env("ALLOCBPF_BPF_TOOLCHAIN", "none"))?;
    // For the host target: the lints see the same code the BPF target compiles.
    run(cargo()
        .args([
            "clippy",
            "--release",
            "--locked",
            "--manifest-path",
            ebpf_manifest,
        ])
        .arg("--target-dir")
        .arg(root().join("target/ebpf-clippy"))
        .args(["--", "-D", "warnings"]))?;
    check_layering()?;
    counts.run(&mut unit_tests(&[]))
}

/// Every crate's unit tests (the end-to-end crate's need root and the real binary),
/// with the binary built without its eBPF program; `extra` after `--no-fail-fast`.
fn unit_tests(extra: &[&str]) -> Command {
    let mut command = cargo();
    command
        .args([
            "test",
            "--release",
            "--workspace",
            "--exclude",
            "allocbpf-e2e",
        ])
        .arg("--no-fail-fast")
        .args(extra)
        .env("ALLOCBPF_BPF_TOOLCHAIN", "none");
    command
}

/// Lane 2 (root): the end-to-end tests with the real binary.
fn end_to_end(counts: &mut Counts) -> Result<()> {
    eprintln!("xtask: lane 2, end-to-end (root)");
    setup::ensure()?;
    // The unit tests that need root (`#[ignore = "needs root: ..."]`).
    counts.run(&mut unit_tests(&["--lib", "--", "--ignored"]))?;
    let allocbpf = build_allocbpf()?;
    let mut command = cargo();
    command
        // --no-fail-fast: one failing test binary must not hide the others' results.
        .args(["test", "--release", "-p", "allocbpf-e2e", "--no-fail-fast"])
        .env("ALLOCBPF_BIN", &allocbpf);
    counts.run(&mut command)
}

/// Tests passed and failed over the lanes.
#[derive(Debug, Default)]
struct Counts {
    passed: u64,
    failed: u64,
    /// A test command that exited non-zero (a build failure counts no test).
    broken: bool,
}

impl Counts {
    /// Runs a `cargo test` command, echoing its output and counting its results.
    fn run(&mut self, command: &mut Command) -> Result<()> {
        command.stdout(Stdio::piped());
        eprintln!("xtask: {command:?}");
        let mut child = command.spawn().context("cannot start cargo test")?;
        for line in BufReader::new(child.stdout.take().unwrap()).lines() {
            let line = line?;
            println!("{line}");
            if let Some((p, f)) = parse_test_result(&line) {
                self.passed += p;
                self.failed += f;
            }
        }
        let status = child.wait()?;
        self.broken |= !status.success();
        Ok(())
    }

    /// One closing line over every test binary (cargo's own last lines are doc-test
    /// binaries with no tests).
    fn print(&self) {
        println!("summary: {} passed, {} failed", self.passed, self.failed);
    }

    fn verdict(&self) -> Result<()> {
        if self.broken || self.failed > 0 || self.passed == 0 {
            bail!("tests failed");
        }
        Ok(())
    }
}

/// The crate graph's rules (docs/design.md, "Crates, in the order data flows"): for
/// each workspace library, the workspace crates it may link, directly or through
/// another crate (linking any other is an error), and the outside crates it must not
/// link. A crate links only those before it in the data flow; the runtimes
/// (`allocbpf-python`, `allocbpf-go`, `allocbpf-jvm`, `allocbpf-node`) link neither each other nor anything that reads
/// samples, and only the engine's crate names them; the probe and the profile model
/// share their vocabulary through `allocbpf-sampling`, not each other.
const LAYERING: &[(&str, &[&str], &[&str])] = &[
    ("allocbpf-common", &[], KERNEL_ASYNC_CLI),
    ("allocbpf-sampling", &["common"], KERNEL_ASYNC_CLI),
    ("allocbpf-images", &["common"], KERNEL_ASYNC_CLI),
    (
        "allocbpf-profile",
        &["common", "sampling"],
        KERNEL_ASYNC_CLI,
    ),
    (
        "allocbpf-export",
        &["common", "sampling", "profile"],
        KERNEL_ASYNC_CLI,
    ),
    ("allocbpf-runtime", RUNTIME_LINKS, KERNEL_ASYNC_CLI),
    ("allocbpf-python", RUNTIME_LINKS, KERNEL_ASYNC_CLI),
    ("allocbpf-go", RUNTIME_LINKS, KERNEL_ASYNC_CLI),
    ("allocbpf-jvm", RUNTIME_LINKS, KERNEL_ASYNC_CLI),
    ("allocbpf-node", RUNTIME_LINKS, KERNEL_ASYNC_CLI),
    (
        "allocbpf-probe",
        &["common", "sampling", "images"],
        &["clap", "framehop", "blazesym"],
    ),
    ("allocbpf-stacks", STACKS_LINKS, &["clap"]),
    ("allocbpf-collect", COLLECT_LINKS, &["clap", "anyhow"]),
    ("allocbpf-agent", AGENT_LINKS, &["clap"]),
];

/// The outside crates of the kernel side, the async runtime, unwinding, symbolization
/// and the command line, which the lowest layers must not link.
const KERNEL_ASYNC_CLI: &[&str] = &[
    "aya", "aya-obj", "aya-log", "tokio", "blazesym", "framehop", "clap",
];

/// What the runtime interface and every runtime may link (the interface counts once
/// each runtime links it; a runtime linking another runtime is an error).
const RUNTIME_LINKS: &[&str] = &["common", "sampling", "images", "profile", "runtime"];

/// What the frame resolver may link: the runtime interface, no runtime.
const STACKS_LINKS: &[&str] = &[
    "common", "sampling", "images", "profile", "runtime", "probe",
];

/// What the engine may link: every layer below it and the runtimes.
const COLLECT_LINKS: &[&str] = &[
    "common", "sampling", "images", "profile", "runtime", "python", "go", "jvm", "node", "probe",
    "stacks",
];

/// What the agent may link: the engine's and the exporters' layers.
const AGENT_LINKS: &[&str] = &[
    "common", "sampling", "images", "profile", "runtime", "python", "go", "jvm", "node", "probe",
    "stacks", "collect", "export",
];

/// Workspace libraries the layering leaves alone: the end-to-end tests, their harness
/// and the runtime interface's contract test, which drive every layer.
const TEST_LIBRARIES: &[&str] = &[
    "allocbpf-e2e",
    "allocbpf-harness",
    "allocbpf-runtime-contract",
];

/// The workspace crates each top crate may name as a direct dependency: the agent and
/// the binary reach every layer below through the engine's crate.
const DIRECT_EDGES: &[(&str, &[&str])] = &[
    (
        "allocbpf-agent",
        &["allocbpf-collect", "allocbpf-export", "allocbpf-profile"],
    ),
    (
        "allocbpf",
        &[
            "allocbpf-agent",
            "allocbpf-collect",
            "allocbpf-export",
            "allocbpf-profile",
        ],
    ),
];

/// The one crate with a build script: the binary, which builds the eBPF program. A
/// library with one could need the BPF toolchain to compile.
const BUILD_SCRIPTS: &[&str] = &["allocbpf"];

/// Checks that every workspace library has a rule, [`DIRECT_EDGES`] and
/// [`BUILD_SCRIPTS`] on the workspace's packages (`cargo metadata`), and [`LAYERING`]
/// on the resolved dependency graph (`cargo tree`, normal and build dependencies).
fn check_layering() -> Result<()> {
    let metadata = output(cargo().args(["metadata", "--no-deps", "--format-version", "1"]))?;
    let metadata: serde_json::Value = serde_json::from_str(&metadata)?;
    let packages: Vec<&serde_json::Value> = metadata["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .collect();
    let workspace: Vec<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    let has_kind = |package: &serde_json::Value, kind: &str| {
        (package["targets"].as_array().into_iter().flatten()).any(|t| {
            t["kind"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|k| k == kind)
        })
    };
    for package in &packages {
        let name = package["name"].as_str().unwrap_or_default();
        let ruled = LAYERING.iter().any(|(krate, ..)| *krate == name);
        if has_kind(package, "lib") && !ruled && !TEST_LIBRARIES.contains(&name) {
            bail!("{name} is a library with no rule in LAYERING (xtask/src/test.rs)");
        }
        if let Some((_, allowed)) = DIRECT_EDGES.iter().find(|(krate, _)| *krate == name) {
            let named: Vec<&str> = (package["dependencies"].as_array().into_iter().flatten())
                .filter(|d| d["kind"].is_null())
                .filter_map(|d| d["name"].as_str())
                .filter(|d| workspace.contains(d) && !allowed.contains(d))
                .collect();
            if !named.is_empty() {
                bail!("{name} must not depend on {named:?} directly (docs/design.md)");
            }
        }
        if has_kind(package, "custom-build") && !BUILD_SCRIPTS.contains(&name) {
            bail!("{name} has a build script: only the binary may (docs/build.md)");
        }
    }
    for (krate, allowed, forbidden) in LAYERING {
        let edges = [
            "tree",
            "-e",
            "normal,build",
            "--prefix",
            "none",
            "-p",
            krate,
        ];
        let tree = output(cargo().args(edges))?;
        let mut linked: Vec<&str> = tree
            .lines()
            .filter_map(|line| line.split_whitespace().next())
            .filter(|name| *name != *krate)
            .filter(|name| match workspace.contains(name) {
                true => !(name.strip_prefix("allocbpf-")).is_some_and(|n| allowed.contains(&n)),
                false => forbidden.contains(name),
            })
            .collect();
        linked.sort_unstable();
        linked.dedup();
        if !linked.is_empty() {
            bail!("{krate} must not link {linked:?} (docs/design.md: the crate graph's rules)");
        }
    }
    eprintln!("xtask: crate layering as docs/design.md states it");
    Ok(())
}

/// Runs `command` and returns its stdout; fails on a non-zero exit.
fn output(command: &mut Command) -> Result<String> {
    let output = command.output().context("cannot run cargo")?;
    if !output.status.success() {
        bail!("{command:?}: {}", String::from_utf8_lossy(&output.stderr));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
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
