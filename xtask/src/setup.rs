//! Installs what allocbpf's build and tests need on Debian, where it is missing.
//!
//! The eBPF program builds with Debian's Rust 1.96 (`rustc-web`) and its prebuilt `core`
//! for bpfel-unknown-none, linked by bpf-linker built against LLVM 22 (the LLVM of that
//! rustc). docs/build.md explains the route and the alternative (rustup nightly).
//!
//! It also builds the servers the tests talk to (the OpenTelemetry Collector) into
//! `target/servers/` from pinned sources: see servers.rs.

use std::process::Command;

use anyhow::{bail, Result};

use crate::{
    servers,
    util::{build_allocbpf, cargo, is_root, run},
};

/// Debian packages the unit tests read or run (`cargo xtask test`'s first lane): gcc
/// and binutils (they compile and strip small programs, and read cc1), and the
/// allocators whose real code they decode (musl, tcmalloc).
const UNIT_TEST_PACKAGES: &[&str] = &[
    "gcc",
    "binutils",
    "libc6-dev",
    "musl-tools",
    "libtcmalloc-minimal4",
    // CPython 3.11 and its headers: the Python layout table is checked against them,
    // and the end-to-end Python tests profile Debian's interpreter.
    "python3.11",
    "libpython3.11-dev",
];

/// Debian packages that building and running allocbpf need (`cargo xtask run`): the
/// eBPF toolchain, LLVM and the libraries bpf-linker links, and a C compiler for the
/// demo workload.
const RUN_PACKAGES: &[&str] = &[
    "rustc-web",
    "cargo-web",
    "libstd-rust-web-dev-bpf",
    "llvm-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
    "gcc",
    "libc6-dev",
];

/// Debian packages beyond [`RUN_PACKAGES`] and [`UNIT_TEST_PACKAGES`] that only the
/// end-to-end tests and benchmarks use: their tools (g++ for workloads, gdb to compare
/// stacks with, Go for `go tool pprof`, setpriv), the programs and allocators they
/// profile (redis, jemalloc, mimalloc, OpenJDK), a FUSE file system for the
/// hostile-file tests (bindfs) and the font the statistics figures are drawn with.
const TEST_PACKAGES: &[&str] = &[
    "g++",
    "make",
    "gdb",
    "golang-go",
    "openssl",
    "python3",
    "util-linux",
    "fonts-dejavu-core",
    "redis-server",
    "redis-tools",
    "libjemalloc2",
    "libmimalloc2.0",
    "bindfs",
    // A Debian trixie root for the Python tests (CPython 3.13 with its own libc).
    "debootstrap",
    // A real Go server nobody here wrote, for the Go heap-profile test (a stripped Go
    // 1.19 binary).
    "prometheus",
    // A real Python program for the Python tests (pyflakes over the standard library).
    "python3-pyflakes",
    // Debian's JDK for the JVM tests and benchmark (its javac compiles their workload).
    "openjdk-17-jdk-headless",
    // A real browser for the HTML report's tests and benchmark, driven headless through
    // its WebDriver (tests/harness/src/browser.rs).
    "chromium",
    "chromium-driver",
];

/// bpf-linker release and features that match Debian's rustc-web LLVM (22).
/// Pinned: 0.13 defaults to LLVM 23, and its LLVM must match rustc's major version.
const BPF_LINKER_VERSION: &str = "0.13.0";
const LLVM_PREFIX: &str = "/usr/lib/llvm-22";

fn package_installed(name: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", name])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        .unwrap_or(false)
}

fn bpf_linker_ok() -> bool {
    Command::new("bpf-linker")
        .arg("--version")
        .output()
        .map(|o| {
            o.status.success() && String::from_utf8_lossy(&o.stdout).contains(BPF_LINKER_VERSION)
        })
        .unwrap_or(false)
}

/// Installs what the unit tests need where missing ([`UNIT_TEST_PACKAGES`]); without
/// root, says what to install.
pub fn ensure_unit_test_packages() -> Result<()> {
    install_missing(UNIT_TEST_PACKAGES)
}

/// Installs whatever the tests and benchmarks need that is missing; does nothing
/// (quickly) when all is there. Also builds the tests' OpenTelemetry Collector when
/// missing and exports its path to the commands xtask starts afterwards as
/// `ALLOCBPF_OTELCOL` ([`servers::ensure_otelcol`]), and Node.js 22 likewise
/// ([`crate::tools::ensure_node22`]).
pub fn ensure() -> Result<()> {
    ensure_run()?;
    install_missing(UNIT_TEST_PACKAGES)?;
    install_missing(TEST_PACKAGES)?;
    // Last: it needs no root, and Go from Debian's list above is not new enough for it.
    servers::ensure_otelcol()?;
    crate::tools::ensure_node22()?;
    Ok(())
}

/// Installs only what building and running allocbpf need ([`RUN_PACKAGES`] and
/// bpf-linker): `cargo xtask run` on a fresh machine builds no test server.
pub fn ensure_run() -> Result<()> {
    install_missing(RUN_PACKAGES)?;
    if !bpf_linker_ok() {
        eprintln!("xtask: building bpf-linker {BPF_LINKER_VERSION} against LLVM 22 (~2 minutes)");
        run(
            Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
                .args(["install", "--locked", "--force"])
                .arg(format!("bpf-linker@{BPF_LINKER_VERSION}"))
                .args(["--no-default-features", "--features", "llvm-22"])
                // Without it the build script finds /usr/bin/llvm-config (LLVM 14) and fails.
                .env("LLVM_PREFIX", LLVM_PREFIX),
        )?;
        if !bpf_linker_ok() {
            bail!("bpf-linker was installed but is not on PATH: add ~/.cargo/bin to PATH");
        }
    }
    Ok(())
}

/// Installs those of `packages` that are missing (as root; otherwise says how).
fn install_missing(packages: &[&str]) -> Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|p| !package_installed(p))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !is_root() {
        bail!(
            "missing Debian packages: {}. Run `sudo cargo xtask setup` or \
             `sudo apt-get install {}`",
            missing.join(" "),
            missing.join(" ")
        );
    }
    eprintln!("xtask: installing {}", missing.join(" "));
    run(Command::new("apt-get").args(["update", "-q"]))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

/// `cargo run --release -p allocbpf-e2e --bin NAME --` with `ALLOCBPF_BIN` set to a
/// freshly built allocbpf, after [`ensure`]; the caller adds arguments.
pub fn e2e_bin(name: &str) -> Result<Command> {
    ensure()?;
    let allocbpf = build_allocbpf()?;
    let mut command = cargo();
    command
        .args([
            "run",
            "--release",
            "-p",
            "allocbpf-e2e",
            "--bin",
            name,
            "--",
        ])
        .env("ALLOCBPF_BIN", &allocbpf);
    Ok(command)
}
