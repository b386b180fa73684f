//! What the bench binaries (`src/bin/`: soak, burst, agent_cost) share.

use std::{
    fmt::Write as _,
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

/// Writes `dir/big.c`: `functions` small functions that each malloc and free, a file
/// whose compile keeps cc1 allocating (gcc -O2 of 3,000 takes ~1.8 s here).
pub fn write_malloc_heavy_source(dir: &Path, functions: usize) -> Result<()> {
    let mut source = String::from("#include <stdlib.h>\n");
    for i in 0..functions {
        let _ = writeln!(
            source,
            "int f{i}(int x) {{ int *p = malloc(sizeof(int) * {}); p[0] = x; int r = p[0] * {i}; free(p); return r; }}",
            i + 1
        );
    }
    std::fs::write(dir.join("big.c"), source).context("writing big.c")
}

/// What one compile of `big.c` took: its wall time, and the CPU time of gcc and of
/// everything it ran (cc1, as), user and system, from `wait4`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CompileTimes {
    /// Wall time.
    pub wall: Duration,
    /// User CPU time.
    pub user: Duration,
    /// System CPU time: the kernel's work for the compile, probe traps included.
    pub system: Duration,
}

impl CompileTimes {
    /// System time per second of user time. Probe traps run in the kernel, so probing
    /// raises it by about the traps' share of the compile's own work (plus the
    /// compile's own system time, ~5% here). A slower or busier host stretches user
    /// and system time alike, so unlike wall time the ratio holds still on a noisy VM.
    pub fn system_per_user(&self) -> f64 {
        self.system.as_secs_f64() / self.user.as_secs_f64().max(1e-9)
    }

    /// The wall times of `compiles`, seconds.
    pub fn walls(compiles: &[Self]) -> Vec<f64> {
        compiles.iter().map(|c| c.wall.as_secs_f64()).collect()
    }

    /// The [`system_per_user`](Self::system_per_user) of each of `compiles`.
    pub fn systems_per_user(compiles: &[Self]) -> Vec<f64> {
        compiles.iter().map(Self::system_per_user).collect()
    }
}

/// Runs `gcc -O2 -c big.c` in `dir` (see [`write_malloc_heavy_source`]) and times it.
pub fn compile_big(dir: &Path) -> Result<CompileTimes> {
    let started = Instant::now();
    let child = Command::new("gcc")
        .args(["-O2", "-c", "big.c", "-o", "big.o"])
        .current_dir(dir)
        .spawn()
        .context("gcc (cargo xtask setup installs it)")?;
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value for wait4 to overwrite.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // wait4 rather than `Child::wait`: it also gives the CPU time of gcc and of the
    // children it waited for. `child` is then dropped unwaited, which std allows.
    let waited = loop {
        // SAFETY: pid is our child; status and usage are valid for writes.
        let waited = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
        if waited == -1 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
        {
            continue;
        }
        break waited;
    };
    let wall = started.elapsed();
    drop(child);
    if waited != pid {
        bail!("waiting for gcc: {}", std::io::Error::last_os_error());
    }
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        bail!("gcc failed (wait status {status:#x})");
    }
    let time = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
    };
    Ok(CompileTimes {
        wall,
        user: time(usage.ru_utime),
        system: time(usage.ru_stime),
    })
}

/// The `--rounds N` argument of a bench binary, `default` without it.
pub fn rounds_arg(default: usize) -> Result<usize> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == "--rounds")
        .and_then(|i| args.get(i + 1))
        .map_or(Ok(default), |r| r.parse())
        .context("--rounds")
}

pub use allocbpf_profile::estimate::median;

/// User + system CPU seconds of process `pid` so far (`/proc/PID/stat`).
pub fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after_name = stat.rfind(')').context("stat")? + 2;
    let fields: Vec<&str> = stat[after_name..].split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>()? + fields[12].parse::<f64>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok(ticks / hz)
}

/// `allocbpf --pid PID ARGS...` once it says it profiles, its stdout discarded; its
/// stderr is read on (and kept alive) while it runs.
pub fn attach_profiler(pid: u32, args: &[&str]) -> Result<(std::process::Child, crate::Lines)> {
    let mut child = Command::new(crate::allocbpf_bin())
        .args(["--pid", &pid.to_string()])
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let mut stderr = crate::Lines::spawn(child.stderr.take().context("piped")?);
    stderr.wait_for("allocbpf: profiling pid", Duration::from_secs(60))?;
    Ok((child, stderr))
}
