//! Builds the eBPF program (ebpf/allocbpf-ebpf) and places the object in OUT_DIR, where
//! `src/main.rs` embeds it. The binary is the only crate that needs the BPF toolchain.
//!
//! Two toolchain routes (docs/build.md):
//! - `debian` (default when present): Debian's rustc 1.96 (`rustc-web`) with the prebuilt
//!   `core` for bpfel-unknown-none (`libstd-rust-web-dev-bpf`); no build-std needed.
//! - `nightly`: rustup's nightly with rust-src and `-Z build-std=core`, the usual aya route.
//!
//! `ALLOCBPF_BPF_TOOLCHAIN=debian|nightly` forces one. Both need `bpf-linker` on PATH.
//! `cargo xtask setup` installs what the debian route needs.
//!
//! `ALLOCBPF_BPF_TOOLCHAIN=none` embeds no program: the binary then checks, lints and
//! runs its unit tests anywhere (`cargo xtask test`'s first lane), and refuses to
//! profile, saying why. Never the default: a binary that cannot profile is built only
//! when asked for.

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

const DEBIAN_RUSTC: &str = "/usr/bin/rustc";
const DEBIAN_CARGO: &str = "/usr/bin/cargo";
const DEBIAN_BPF_CORE: &str = "/usr/lib/rustlib/bpfel-unknown-none/lib";
const TARGET: &str = "bpfel-unknown-none";

fn main() {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let ebpf_dir = manifest_dir.join("../../ebpf/allocbpf-ebpf");
    let common_dir = manifest_dir.join("../../ebpf/allocbpf-common");
    for path in [
        ebpf_dir.join("src"),
        ebpf_dir.join("Cargo.toml"),
        ebpf_dir.join("Cargo.lock"),
        common_dir.join("src"),
        common_dir.join("Cargo.toml"),
    ] {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    println!("cargo:rerun-if-env-changed=ALLOCBPF_BPF_TOOLCHAIN");

    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    // Under the workspace's target dir (kept by CI caches), apart from host artifacts.
    let target_dir = workspace_target_dir(&out_dir).join("bpf");
    let route = env::var("ALLOCBPF_BPF_TOOLCHAIN").unwrap_or_else(|_| default_route());
    if route == "none" {
        println!("cargo:warning=ALLOCBPF_BPF_TOOLCHAIN=none: this allocbpf embeds no eBPF program and cannot profile");
        std::fs::write(out_dir.join("allocbpf.bpf.o"), b"")
            .unwrap_or_else(|e| panic!("cannot write to {}: {e}", out_dir.display()));
        return;
    }

    let rustflags = [
        "--cfg=bpf_target_arch=\"x86_64\"",
        "-Cdebuginfo=2",
        // Makes bpf-linker emit .BTF/.BTF.ext, which maps and aya-log need.
        "-Clink-arg=--btf",
    ];
    let mut command = match route.as_str() {
        "debian" => Command::new(DEBIAN_CARGO),
        "nightly" => {
            let mut c = Command::new("rustup");
            c.args(["run", "nightly", "cargo", "-Zbuild-std=core"]);
            c
        }
        other => panic!("ALLOCBPF_BPF_TOOLCHAIN={other}: expected `debian`, `nightly` or `none`"),
    };
    // The outer cargo's environment describes the host build; none of it applies here.
    for (key, _) in env::vars() {
        let host_only = (key.starts_with("CARGO_") && key != "CARGO_HOME")
            || key.starts_with("RUSTC")
            || key.starts_with("RUSTDOC")
            || key == "RUSTFLAGS"
            || key == "RUSTUP_TOOLCHAIN";
        if host_only {
            command.env_remove(&key);
        }
    }
    if route == "debian" {
        // Without RUSTC, /usr/bin/cargo would pick rustup's rustc proxy from PATH.
        // aya-ebpf uses #![feature(asm_experimental_arch)]: allow it for that crate only.
        command
            .env("RUSTC", DEBIAN_RUSTC)
            .env("RUSTC_BOOTSTRAP", "aya_ebpf");
    }
    command
        .current_dir(&ebpf_dir)
        .args(["build", "--release", "--locked", "--target", TARGET])
        .arg("--target-dir")
        .arg(&target_dir)
        .env("CARGO_ENCODED_RUSTFLAGS", rustflags.join("\x1f"));

    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run the eBPF build ({route} route): {e}. {}", HINT));
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        panic!(
            "building the eBPF program failed ({route} route):\n{stderr}\n{}",
            HINT
        );
    }
    let object = target_dir.join(TARGET).join("release").join("allocbpf");
    let embedded = out_dir.join("allocbpf.bpf.o");
    std::fs::copy(&object, &embedded)
        .unwrap_or_else(|e| panic!("eBPF object {} missing after build: {e}", object.display()));
    strip_debug(&embedded);
}

/// LLVM's objcopy, as `llvm-22-dev` brings it (before any other on PATH).
const OBJCOPY: [&str; 2] = ["/usr/lib/llvm-22/bin/llvm-objcopy", "llvm-objcopy"];

/// Takes the DWARF out of the object: bpf-linker makes its BTF from it, and nothing
/// reads it after (the kernel gets the BTF; verifier line info is in `.BTF.ext`). It is
/// four fifths of the object, which the agent's loader parses three times at start
/// (docs/benchmarks.md, "issue 49, third part": its peak memory). Without an objcopy
/// the object stays whole, and says so.
fn strip_debug(object: &Path) {
    for objcopy in OBJCOPY {
        if let Ok(status) = Command::new(objcopy)
            .arg("--strip-debug")
            .arg(object)
            .status()
        {
            if status.success() {
                return;
            }
        }
    }
    println!(
        "cargo:warning=no llvm-objcopy: the eBPF object keeps its DWARF (a larger binary and start-up)"
    );
}

const HINT: &str = "Run `cargo xtask setup` (installs rustc-web, libstd-rust-web-dev-bpf, \
                    llvm-22-dev and bpf-linker), or see docs/build.md.";

fn default_route() -> String {
    if Path::new(DEBIAN_RUSTC).exists() && Path::new(DEBIAN_BPF_CORE).exists() {
        "debian".to_string()
    } else if Command::new("rustup")
        .args(["run", "nightly", "rustc", "--print", "sysroot"])
        .output()
        .map(|o| {
            o.status.success()
                && Path::new(String::from_utf8_lossy(&o.stdout).trim())
                    .join("lib/rustlib/src/rust/library/core")
                    .exists()
        })
        .unwrap_or(false)
    {
        "nightly".to_string()
    } else {
        panic!("no eBPF toolchain found. {HINT}");
    }
}

/// `target/` of the workspace, from `target/<profile>/build/<pkg>-<hash>/out`.
fn workspace_target_dir(out_dir: &Path) -> PathBuf {
    if let Ok(dir) = env::var("CARGO_TARGET_DIR") {
        return PathBuf::from(dir);
    }
    out_dir
        .ancestors()
        .find(|p| p.file_name().is_some_and(|n| n == "target"))
        .map(Path::to_path_buf)
        .unwrap_or_else(|| out_dir.join("ebpf-target"))
}
