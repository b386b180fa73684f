//! Compiling and running allocbpf's test workloads (`tests/workloads/`): one harness for
//! the end-to-end tests (`allocbpf-e2e`) and xtask's demo and benchmarks.
//!
//! A workload prints its pid, then waits for a line on stdin before it allocates, so
//! that allocbpf can attach to it first ([`Workload`]).

use std::{
    io::{BufRead, BufReader, Read, Write},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
    sync::{
        atomic::{AtomicU64, Ordering},
        mpsc,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};

pub mod browser;
pub mod net;

/// How long a workload may take to print its pid.
const PID_TIMEOUT: Duration = Duration::from_secs(10);

/// `ETXTBSY`: the executable is open for writing somewhere.
const TEXT_FILE_BUSY: i32 = 26;

/// Spawns `command`, trying again for a while when its executable is busy. A test that
/// writes a program and then runs it races the other tests of its binary: a child they
/// fork meanwhile inherits the write descriptor until it execs, and exec refuses a file
/// open for writing.
fn spawn_when_not_busy(command: &mut Command) -> std::io::Result<std::process::Child> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match command.spawn() {
            Err(error)
                if error.raw_os_error() == Some(TEXT_FILE_BUSY) && Instant::now() < deadline =>
            {
                thread::sleep(Duration::from_millis(20));
            }
            result => return result,
        }
    }
}

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Compiles `source` with `compiler` (gcc, g++, musl-gcc or rustc) and `flags` into
/// `binary`. Several tests may compile the same workload at once: it is built under a
/// unique name, then renamed (atomic), so nobody executes a half-written file.
pub fn compile(source: &Path, compiler: &str, flags: &[&str], binary: &Path) -> Result<()> {
    if let Some(dir) = binary.parent() {
        std::fs::create_dir_all(dir)?;
    }
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let partial = binary.with_extension(format!(
        "partial-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    // Flags after the source, so libraries (-lm) link under Debian's --as-needed.
    let status = Command::new(compiler)
        .arg("-o")
        .arg(&partial)
        .arg(source)
        .args(flags)
        .status()
        .with_context(|| format!("running {compiler} (cargo xtask setup installs it)"))?;
    ensure!(
        status.success(),
        "{compiler} failed on {}",
        source.display()
    );
    std::fs::rename(&partial, binary)?;
    Ok(())
}

/// `tests/workloads/<file>`.
pub fn workload_source(file: &str) -> PathBuf {
    workspace_root().join("tests/workloads").join(file)
}

/// Reads lines from a child's pipe on a thread, so waits can time out.
pub struct Lines {
    rx: mpsc::Receiver<String>,
    /// Every line received so far.
    pub seen: Vec<String>,
}

impl Lines {
    /// Starts reading `pipe`.
    pub fn spawn(pipe: impl Read + Send + 'static) -> Self {
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            rx,
            seen: Vec::new(),
        }
    }

    /// Waits for a line containing `needle` (`""`: the next line).
    pub fn wait_for(&mut self, needle: &str, timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(needle) {
                        return Ok(line);
                    }
                }
                Err(_) => bail!(
                    "no line with {needle:?} within {timeout:?}; saw {:?}",
                    self.seen
                ),
            }
        }
    }

    /// Everything received until the pipe closes (or `timeout`).
    pub fn rest(&mut self, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        while let Ok(line) = self
            .rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            self.seen.push(line);
        }
        self.seen.join("\n")
    }
}

/// A running workload that waits for a go signal. Dropping it kills it.
pub struct Workload {
    /// The process.
    pub child: Child,
    /// Its pid.
    pub pid: u32,
    stdin: Option<ChildStdin>,
    /// Its stdout.
    pub stdout: Lines,
}

impl Workload {
    /// Starts `binary` with `args`; waits until it has printed its pid.
    pub fn start(binary: &Path, args: &[&str]) -> Result<Workload> {
        Self::start_env(binary, args, &[])
    }

    /// [`Workload::start`] with extra environment variables (`LD_PRELOAD`).
    pub fn start_env(binary: &Path, args: &[&str], env: &[(&str, &str)]) -> Result<Workload> {
        Self::spawn(Command::new(binary).args(args).envs(env.iter().copied()))
    }

    /// Starts `command`; waits until it has printed its pid.
    pub fn spawn(command: &mut Command) -> Result<Workload> {
        command.stdin(Stdio::piped()).stdout(Stdio::piped());
        let mut child = spawn_when_not_busy(command)
            .with_context(|| format!("starting {:?}", command.get_program()))?;
        let stdin = child.stdin.take();
        let mut stdout = Lines::spawn(child.stdout.take().unwrap());
        let pid_line = stdout.wait_for("", PID_TIMEOUT)?;
        let pid = pid_line.trim().parse().context("workload pid line")?;
        Ok(Workload {
            child,
            pid,
            stdin,
            stdout,
        })
    }

    /// Tells the workload to start allocating.
    pub fn go(&mut self) -> Result<()> {
        let mut stdin = self.stdin.take().context("already started")?;
        stdin.write_all(b"go\n")?;
        Ok(())
    }

    /// Waits for it to exit successfully.
    pub fn wait(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                ensure!(status.success(), "workload failed: {status}");
                return Ok(());
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                bail!("workload did not finish within {timeout:?}");
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
