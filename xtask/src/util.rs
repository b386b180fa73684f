//! Small helpers shared by the tasks.

use std::{
    io::{BufRead, BufReader, Lines},
    path::{Path, PathBuf},
    process::{Child, ChildStderr, Command, Stdio},
    time::Duration,
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
    compile_c_with("gcc", name, flags)
}

/// [`compile_c`] with another C compiler (`musl-gcc`); the binary is named after both.
pub fn compile_c_with(compiler: &str, name: &str, flags: &[&str]) -> Result<PathBuf> {
    let binary = root().join("target/xtask").join(if compiler == "gcc" {
        name.to_string()
    } else {
        format!("{name}-{compiler}")
    });
    allocbpf_harness::compile(
        &allocbpf_harness::workload_source(&format!("{name}.c")),
        compiler,
        flags,
        &binary,
    )?;
    Ok(binary)
}

/// How long a benchmark workload may take to print its result.
pub const RESULT_TIMEOUT: Duration = Duration::from_secs(1800);

/// Starts allocbpf with `args` and waits until its probes are attached. Returns the
/// process and the rest of its stderr, which the caller must keep reading (dropping it
/// would close the pipe under allocbpf's last messages). `echo` prints stderr lines.
pub fn attach(
    allocbpf: &Path,
    args: &[&str],
    echo: bool,
) -> Result<(Child, Lines<BufReader<ChildStderr>>)> {
    let mut child = Command::new(allocbpf)
        .args(args)
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot start allocbpf")?;
    let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
    for line in stderr.by_ref() {
        let line = line?;
        if echo {
            eprintln!("{line}");
        }
        if line.contains("profiling pid") || line.contains("profiling every process") {
            return Ok((child, stderr));
        }
    }
    bail!("allocbpf did not attach: {}", child.wait()?)
}

/// Reads `stderr` to its end (echoing it if asked), then waits for `child`; fails unless
/// it exited successfully.
pub fn finish(child: Child, stderr: Lines<BufReader<ChildStderr>>, echo: bool) -> Result<()> {
    finish_collecting(child, stderr, echo).map(|_| ())
}

/// [`finish`], returning allocbpf's remaining stderr lines.
pub fn finish_collecting(
    mut child: Child,
    stderr: Lines<BufReader<ChildStderr>>,
    echo: bool,
) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    for line in stderr {
        let line = line?;
        if echo {
            eprintln!("{line}");
        }
        lines.push(line);
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("allocbpf failed: {status}");
    }
    Ok(lines)
}
