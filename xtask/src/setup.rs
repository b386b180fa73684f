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
    util::{is_root, run},
};

/// Debian packages: the eBPF toolchain, LLVM for bpf-linker, and the tests' tools
/// (gcc/g++ + static libc for workloads, gdb to compare stacks with, Go for
/// `go tool pprof`, setpriv), the programs and allocators the tests profile (redis,
/// jemalloc, tcmalloc, mimalloc, musl), a FUSE file system for the hostile-file tests
/// (bindfs) and the font the statistics figures are drawn
/// with.
const APT_PACKAGES: &[&str] = &[
    "rustc-web",
    "cargo-web",
    "libstd-rust-web-dev-bpf",
    "llvm-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
    "gcc",
    "g++",
    "make",
    "gdb",
    "libc6-dev",
    "golang-go",
    "openssl",
    "python3",
    "util-linux",
    "fonts-dejavu-core",
    "redis-server",
    "redis-tools",
    "libjemalloc2",
    "libtcmalloc-minimal4",
    "libmimalloc2.0",
    "musl-tools",
    "bindfs",
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

/// Installs whatever is missing; does nothing (quickly) when all is there. Also builds
/// the tests' OpenTelemetry Collector when missing and exports its path to the commands
/// xtask starts afterwards as `ALLOCBPF_OTELCOL` ([`servers::ensure_otelcol`]).
pub fn ensure() -> Result<()> {
    let missing: Vec<&str> = APT_PACKAGES
        .iter()
        .copied()
        .filter(|p| !package_installed(p))
        .collect();
    if !missing.is_empty() {
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
            .env("DEBIAN_FRONTEND", "noninteractive"))?;
    }
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
    // Last: it needs no root, and Go from Debian's list above is not new enough for it.
    servers::ensure_otelcol()?;
    Ok(())
}
