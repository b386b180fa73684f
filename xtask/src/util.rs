//! Small helpers shared by the tasks.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// Runs `command`, echoing it, and fails on a non-zero exit.
pub fn run(command: &mut Command) -> Result<()> {
    eprintln!("xtask: {command:?}");
    let status = command
        .status()
        .with_context(|| format!("cannot start {:?}", command.get_program()))?;
    if !status.success() {
        bail!("{:?} failed: {status}", command.get_program());
    }
    Ok(())
}

/// `cargo` as invoked for this xtask (respects rustup's choice).
pub fn cargo() -> Command {
    let mut command = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    command.current_dir(root());
    command
}

/// True if we run as root.
pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Builds the release binary and returns its path.
pub fn build_allocbpf() -> Result<PathBuf> {
    run(cargo().args(["build", "--release", "-p", "allocbpf"]))?;
    Ok(root().join("target/release/allocbpf"))
}

/// Compiles a C workload from tests/workloads with `flags`.
pub fn compile_c(name: &str, flags: &[&str]) -> Result<PathBuf> {
    let out_dir = root().join("target/xtask");
    std::fs::create_dir_all(&out_dir)?;
    let binary = out_dir.join(name);
    run(Command::new("gcc")
        .args(flags)
        .arg("-o")
        .arg(&binary)
        .arg(root().join("tests/workloads").join(format!("{name}.c"))))?;
    Ok(binary)
}
