//! CPython end to end: Debian's `python3.11` (the interpreter linked into a stripped
//! executable) running `workloads/python_sites.py` under the real allocbpf, by pid and
//! system-wide. Its samples carry the Python frames of the thread that allocated, merged
//! into the native stack where the eval loop ran them, named `function (file:line)`.
//!
//! Bounds: a site of `calls` allocations of `S` bytes each at mean interval `R` has an
//! estimate whose variance is `calls * S^2 (1 - p) / p`, `p = 1 - exp(-S/R)` (each call
//! is sampled with probability `p` and then weighs `S / p`); the estimate must lie within
//! 5 of its standard deviations of the truth (a correct sampler misses with probability
//! below 1e-6). `bytes(N)` is one `PyObject_Calloc(1, N + 33)`: under 512 bytes pymalloc
//! serves it, over it reaches `calloc` through the interpreter and must be counted once.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use allocbpf_e2e::{
    compile_workload, debian_root, go_pprof, one_profiler_at_a_time, require_root, scratch_dir,
    sites::allocation_variance, stacks_with, workspace_root, Profiler, Workload,
};
use anyhow::{Context, Result};
use serde_json::Value;

/// Debian's interpreter: the executable holds the interpreter and is stripped.
const DEBIAN_PYTHON: &str = "/usr/bin/python3.11";

/// Rounds of 100 calls per site.
const ROUNDS: &str = "3000";

/// The mean sampling interval the tests profile at.
const RATE: f64 = 65536.0;

/// One `truth SITE LINE BYTES CALLS` line of the workload.
struct Site {
    name: String,
    line: u32,
    bytes: f64,
    calls: f64,
}

fn parse_truth(output: &str) -> Vec<Site> {
    output
        .lines()
        .filter_map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            (words.first() == Some(&"truth") && words.len() == 5).then(|| Site {
                name: words[1].to_string(),
                line: words[2].parse().unwrap(),
                bytes: words[3].parse().unwrap(),
                calls: words[4].parse().unwrap(),
            })
        })
        .collect()
}

/// The stacks that pass through `site`'s line (its Python frame, as reports show it).
fn site_stacks<'a>(profile: &'a Value, script: &Path, site: &Site) -> Vec<&'a Value> {
    stacks_with(
        profile,
        &format!("{} ({}:{})", site.name, script.display(), site.line),
    )
}

/// The standard deviation of the estimate of `calls` allocations of `bytes` each (or of
/// the in-use estimate of that many live blocks).
fn estimate_sd(calls: f64, bytes: f64) -> f64 {
    (calls * allocation_variance(bytes as u64, RATE as u64)).sqrt()
}

/// Starts `program args` (the workload protocol), profiles it by pid to its exit at
/// 64 KiB with `extra` flags into a json profile, and returns the profile and what the
/// workload printed after its pid.
fn profile_by_pid(
    program: &Path,
    args: &[&str],
    extra: &[&str],
    scratch: &str,
) -> Result<(Value, String)> {
    let out = scratch_dir(scratch).join("profile.json");
    let mut workload = Workload::start(program, args)?;
    let pid = workload.pid.to_string();
    let mut flags = vec!["--pid", &pid, "--rate", "64KiB", "--format", "json"];
    flags.extend_from_slice(extra);
    flags.extend(["--output", out.to_str().context("path")?]);
    let profiler = Profiler::attach(&flags)?;
    workload.go()?;
    workload.wait(Duration::from_secs(120))?;
    let output = workload.stdout.rest(Duration::from_secs(5));
    let finished = profiler.finish(Duration::from_secs(60))?;
    assert_eq!(finished.code, Some(0), "{}", finished.stderr);
    Ok((serde_json::from_slice(&std::fs::read(&out)?)?, output))
}

/// The Python callers of a site in the workload's main thread, outermost first.
const MAIN_THREAD_CALLERS: &[&str] = &["<module> (", "main (", "run_rounds ("];

/// Checks every site of `profile` against the workload's truth: each site's stacks
/// name `callers` (prefixes of Python frames, outermost first) before the site.
fn check_sites(profile: &Value, script: &Path, sites: &[Site], bounds: bool, callers: &[&str]) {
    assert!(sites.len() >= 3, "the workload's truth lines");
    for site in sites {
        if site.bytes == 0.0 {
            // `{"key": i}`: dicts come mostly from the interpreter's free list of them,
            // so the allocations the site makes are not known here.
            continue;
        }
        let stacks = site_stacks(profile, script, site);
        assert!(
            !stacks.is_empty(),
            "no stack names {} at line {}",
            site.name,
            site.line
        );
        // Python callers, outermost first, then the site.
        let frames = stacks[0]["frames"].as_array().unwrap();
        let position = |prefix: &str| {
            frames
                .iter()
                .position(|f| f.as_str().is_some_and(|f| f.starts_with(prefix)))
        };
        let at = format!("{} (", site.name);
        let positions: Vec<Option<usize>> = callers
            .iter()
            .copied()
            .chain([at.as_str()])
            .map(position)
            .collect();
        assert!(
            positions.iter().all(Option::is_some) && positions.is_sorted(),
            "{callers:?} then {at}: {frames:?}"
        );
        // Where an inlined allocator's site is probed (a new int, on an LTO build), the
        // innermost frame is the site's own function, not a word of its stack.
        let innermost = frames.last().and_then(Value::as_str).unwrap_or_default();
        assert!(!innermost.starts_with("[unknown"), "{frames:?}");
        if !bounds {
            continue;
        }
        // At the ctypes site the interpreter also allocates (the call's argument and
        // result objects): its truth is the malloc calls, which pass through libffi.
        let through_ffi = |stack: &&&Value| {
            site.name != "c_malloc"
                || stack["frames"].as_array().is_some_and(|f| {
                    f.iter()
                        .any(|f| f.as_str().is_some_and(|f| f.contains("libffi")))
                })
        };
        let estimate: f64 = stacks
            .iter()
            .filter(through_ffi)
            .map(|s| s["estimated_bytes"].as_f64().unwrap())
            .sum();
        let truth = site.calls * site.bytes;
        let sd = estimate_sd(site.calls, site.bytes);
        println!(
            "{}: estimate {estimate:.0}, truth {truth:.0} +- {sd:.0}",
            site.name
        );
        assert!(
            (estimate - truth).abs() <= 5.0 * sd,
            "{}: estimate {estimate}, truth {truth} +- {sd}",
            site.name
        );
    }
}

fn script() -> std::path::PathBuf {
    workspace_root().join("tests/workloads/python_sites.py")
}

/// How to run the workload: a command, and the script's path as the interpreter sees it.
struct Interpreter {
    program: PathBuf,
    args: Vec<String>,
    script: PathBuf,
    /// The root it runs in, if not this machine's.
    root: Option<PathBuf>,
}

impl Interpreter {
    /// `python` on this machine's root.
    fn host(python: &Path) -> Interpreter {
        Interpreter {
            program: python.to_path_buf(),
            args: vec![],
            script: script(),
            root: None,
        }
    }

    /// `python` (its path inside `root`) run with `chroot`, the script copied in.
    fn chrooted(root: &Path, python: &str) -> Result<Interpreter> {
        std::fs::copy(script(), root.join("python_sites.py"))?;
        Ok(Interpreter {
            program: PathBuf::from("chroot"),
            args: vec![
                root.to_str().context("path")?.to_string(),
                python.to_string(),
            ],
            script: PathBuf::from("/python_sites.py"),
            root: Some(root.to_path_buf()),
        })
    }

    /// The same interpreter running `workloads/python_live.py` (copied into its root).
    fn live(&self) -> Result<Interpreter> {
        let host = workspace_root().join("tests/workloads/python_live.py");
        let script = match &self.root {
            Some(root) => {
                std::fs::copy(&host, root.join("python_live.py"))?;
                PathBuf::from("/python_live.py")
            }
            None => host,
        };
        Ok(Interpreter {
            program: self.program.clone(),
            args: self.args.clone(),
            script,
            root: self.root.clone(),
        })
    }

    /// The arguments that run the workload.
    fn workload_args(&self) -> Result<Vec<&str>> {
        let mut args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        args.extend([self.script.to_str().context("path")?, ROUNDS]);
        Ok(args)
    }

    fn start(&self) -> Result<Workload> {
        Workload::start(&self.program, &self.workload_args()?)
    }
}

fn start_workload() -> Result<Workload> {
    Interpreter::host(Path::new(DEBIAN_PYTHON)).start()
}

/// Profiles the workload under `python` by pid and checks its sites with bounds.
fn check_by_pid(python: &Interpreter, scratch: &str) -> Result<()> {
    let args = python.workload_args()?;
    let (profile, output) = profile_by_pid(&python.program, &args, &[], scratch)?;
    assert_eq!(profile["totals"]["drops"], 0);
    println!("{}:", python.program.display());
    check_sites(
        &profile,
        &python.script,
        &parse_truth(&output),
        true,
        MAIN_THREAD_CALLERS,
    );
    Ok(())
}

/// Profiles the workload under `python` system-wide (`--comm ^python3`) and checks its
/// sites' names and lines (the overhead budget observes the interpreter part of the
/// time: the estimates' bounds are the pid tests').
fn check_system_wide(python: &Interpreter, scratch: &str) -> Result<Vec<Site>> {
    let dir = scratch_dir(scratch);
    let json = dir.join("profile.json");
    let mut workload = python.start()?;
    let mut profiler = Profiler::spawn(&[
        "--comm",
        "^python3",
        "--rate",
        "64KiB",
        "--duration",
        "8s",
        "--format",
        "json",
        "--output",
        json.to_str().context("path")?,
    ])?;
    profiler
        .stderr
        .wait_for("allocbpf: profiling every process", Duration::from_secs(60))?;
    workload.go()?;
    workload.wait(Duration::from_secs(120))?;
    let output = workload.stdout.rest(Duration::from_secs(5));
    let finished = profiler.finish(Duration::from_secs(60))?;
    assert_eq!(finished.code, Some(0), "{}", finished.stderr);
    let profile: Value = serde_json::from_slice(&std::fs::read(&json)?)?;
    let sites = parse_truth(&output);
    check_sites(&profile, &python.script, &sites, false, MAIN_THREAD_CALLERS);
    Ok(sites)
}

/// CPython 3.13 in a Debian trixie root (a container's view: its own libc and
/// interpreter, paths that mean nothing outside it), by pid, system-wide and with
/// `--live` (3.13 keeps its pools in the interpreter's allocator state).
#[test]
fn trixie_python_3_13_in_its_own_root() -> Result<()> {
    require_root();
    let _one = one_profiler_at_a_time();
    let root = debian_root("trixie", &["python3.13"])?;
    let python = Interpreter::chrooted(&root, "/usr/bin/python3.13")?;
    check_by_pid(&python, "python-trixie-pid")?;
    check_system_wide(&python, "python-trixie-host")?;
    check_live(&python.live()?, "python-trixie-live")?;
    Ok(())
}

#[test]
fn debian_python_by_pid_sites_lines_and_estimates() -> Result<()> {
    require_root();
    let _one = one_profiler_at_a_time();
    check_by_pid(&Interpreter::host(Path::new(DEBIAN_PYTHON)), "python-pid")
}

/// Three threads run every site at once, and a fourth site: `malloc(3000)` through
/// `ctypes`, which releases the GIL around the call, so its samples come from threads
/// that do not hold it. Each site's stacks name the thread's Python callers and the
/// site's line, and its estimate is within the bound of its truth (for the ctypes
/// site, its stacks through libffi: the interpreter allocates at that line too).
#[test]
fn debian_python_threads_and_calls_without_the_gil() -> Result<()> {
    require_root();
    let _one = one_profiler_at_a_time();
    let script = script();
    let args = [script.to_str().context("path")?, "1000", "3"];
    let (profile, output) = profile_by_pid(Path::new(DEBIAN_PYTHON), &args, &[], "python-threads")?;
    assert_eq!(profile["totals"]["drops"], 0);
    let sites = parse_truth(&output);
    assert!(sites.iter().any(|site| site.name == "c_malloc"), "{output}");
    check_sites(
        &profile,
        &script,
        &sites,
        true,
        &["Thread.run (", "run_rounds ("],
    );
    Ok(())
}

/// Under `PYTHONMALLOC=malloc` the object allocator's pointer is replaced: the sites
/// where the interpreter inlined `PyObject_Malloc` take the call through it to
/// `malloc`, which counts it, and must not count it again (the big-int site is made
/// only there). Every site within its bound, as without it.
#[test]
fn debian_python_under_pythonmalloc_malloc_counts_each_allocation_once() -> Result<()> {
    require_root();
    let _one = one_profiler_at_a_time();
    let python = Interpreter {
        program: PathBuf::from("env"),
        args: vec!["PYTHONMALLOC=malloc".into(), DEBIAN_PYTHON.into()],
        script: script(),
        root: None,
    };
    check_by_pid(&python, "python-pythonmalloc")
}

/// The same over every CPython 3.9-3.13 pyenv has built on this machine (each as
/// `libpython3.x.so`, without link-time optimisation), with the live test too (their
/// frees are probed where libpython's allocator pointer goes), if any: not required.
#[test]
fn pyenv_pythons_by_pid_when_present() -> Result<()> {
    require_root();
    let _one = one_profiler_at_a_time();
    let root = std::env::var("PYENV_ROOT").unwrap_or_else(|_| "/root/.pyenv".to_string());
    let Ok(versions) = std::fs::read_dir(Path::new(&root).join("versions")) else {
        println!("no pyenv: nothing to check");
        return Ok(());
    };
    let mut checked = Vec::new();
    for entry in versions.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let mut parts = name.split('.');
        let (Some("3"), Some(minor)) = (parts.next(), parts.next()) else {
            continue;
        };
        let Ok(minor) = minor.parse::<u32>() else {
            continue;
        };
        let python = entry.path().join(format!("bin/python3.{minor}"));
        if !(9..=13).contains(&minor) || !python.exists() {
            continue;
        }
        check_by_pid(&Interpreter::host(&python), &format!("python-pyenv-{name}"))?;
        // Its frees: through libpython's allocator pointer (`image/indirect.rs`).
        check_live(
            &Interpreter::host(&python).live()?,
            &format!("python-pyenv-live-{name}"),
        )?;
        checked.push(name);
    }
    println!("pyenv versions checked: {checked:?}");
    Ok(())
}

#[test]
fn debian_python_system_wide_and_in_pprof() -> Result<()> {
    require_root();
    let _one = one_profiler_at_a_time();
    let sites = check_system_wide(&Interpreter::host(Path::new(DEBIAN_PYTHON)), "python-host")?;
    let dir = scratch_dir("python-pprof");

    // pprof: the function, its file and the line, as go tool pprof reads them.
    let pprof = dir.join("profile.pb.gz");
    let mut workload = start_workload()?;
    let pid = workload.pid.to_string();
    let profiler = Profiler::attach(&[
        "--pid",
        &pid,
        "--rate",
        "64KiB",
        "--format",
        "pprof",
        "--output",
        pprof.to_str().context("path")?,
    ])?;
    workload.go()?;
    workload.wait(Duration::from_secs(120))?;
    let finished = profiler.finish(Duration::from_secs(60))?;
    assert_eq!(finished.code, Some(0), "{}", finished.stderr);
    let listing = go_pprof(
        &["-sample_index=alloc_space", "-traces", "-lines"],
        &pprof,
        &dir,
    );
    let large = sites.iter().find(|s| s.name == "large_bytes").unwrap();
    // pprof cleans the path (`tests/harness/../../tests` becomes `tests`).
    let shown = format!("tests/workloads/python_sites.py:{}", large.line);
    assert!(
        listing.lines().any(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            words.len() == 2 && words[0] == "large_bytes" && words[1].ends_with(&shown)
        }),
        "go tool pprof -traces -lines shows no `large_bytes ...{shown}`:\n{listing}"
    );
    Ok(())
}

/// `--live` on Debian's interpreter: `PyObject_Free` is paired with the sampled
/// `PyObject_Calloc` like `free` with `malloc`, and small objects allocated where the
/// interpreter inlined `PyObject_Malloc` (ints, tuples) are tracked at the block the
/// site is handed and retired where it inlined `PyObject_Free`. Each kept site's
/// in-use estimate is within 5 sd of its live bytes (variance `blocks * S^2 (1-p)/p`,
/// as above); a site whose objects were all dropped shows exactly 0 in use.
#[test]
fn debian_python_live_objects_by_site() -> Result<()> {
    require_root();
    let _one = one_profiler_at_a_time();
    check_live(
        &Interpreter::host(Path::new(DEBIAN_PYTHON)).live()?,
        "python-live",
    )
}

/// Samples an inlined site cannot track: those whose size class had no used pool, so
/// that a new pool served them. Kept objects open a new pool every `blocks per pool`
/// allocations (16 KiB pools: 340 ints of 48 bytes, 68 tuples of 240), and each such
/// allocation is sampled with probability `1 - exp(-S/R)`: about
/// `2 x 200000/340 x 6.1e-4 + 50000/68 x 3.7e-3 = 3.4` expected in all (the two kept
/// int sites, the tuples; churned objects reuse their own blocks). A Poisson count of
/// mean 3.4 exceeds 16 with probability below 1e-6.
const MAX_UNTRACKED_SMALL: u64 = 16;

/// Profiles `workloads/python_live.py` under `python` (its [`Interpreter::live`]) with
/// `--live`: the kept sites' blocks are in use within the bound, the churned sites' are
/// all freed.
fn check_live(python: &Interpreter, scratch: &str) -> Result<()> {
    let script = &python.script;
    let mut args: Vec<&str> = python.args.iter().map(String::as_str).collect();
    args.push(script.to_str().context("path")?);
    let (profile, output) = profile_by_pid(&python.program, &args, &["--live"], scratch)?;
    let untracked = profile["live"]["untracked_samples"]
        .as_u64()
        .unwrap_or(u64::MAX);
    assert!(untracked <= MAX_UNTRACKED_SMALL, "{:#}", profile["live"]);
    let sites = parse_truth(&output);
    assert_eq!(sites.len(), 8, "{output}");
    for site in &sites {
        let stacks = site_stacks(&profile, script, site);
        assert!(!stacks.is_empty(), "{} was sampled", site.name);
        // `calls` of the truth line is the number of blocks still live.
        let (blocks, size) = (site.calls, site.bytes);
        // The site's own objects only: the interpreter allocates for itself under a
        // site's frame now and then, and keeps it: a 3,072-byte block, by its size
        // obmalloc's table of arenas doubled to 64 entries of 48 bytes (its frames are
        // unsymbolized), sampled with probability 4.6% at 64 KiB, left one churned
        // site 67,084 bytes in use. A site's blocks read as its size, or its size
        // class (up to 15 bytes more).
        let own_size = |s: &Value| {
            let bytes = s["estimated_bytes"].as_f64().unwrap_or(0.0);
            let objects = s["estimated_objects"].as_f64().unwrap_or(0.0);
            objects > 0.0 && (size - 1.0..=size + 16.0).contains(&(bytes / objects))
        };
        let inuse: f64 = stacks
            .iter()
            .filter(|s| own_size(s))
            .map(|s| s["inuse_bytes"].as_f64().unwrap_or(0.0))
            .sum();
        let truth = blocks * size;
        let sd = estimate_sd(blocks, size);
        println!(
            "{}: in use {inuse:.0}, truth {truth:.0} +- {sd:.0}",
            site.name
        );
        if blocks == 0.0 {
            assert_eq!(inuse, 0.0, "{}: every object was dropped", site.name);
        } else {
            assert!(
                (inuse - truth).abs() <= 5.0 * sd,
                "{}: {inuse} vs {truth}",
                site.name
            );
        }
    }
    Ok(())
}

/// A real program nobody here wrote: Debian's pyflakes checking part of the standard
/// library, in Debian's interpreter. Most of what it allocates is under its own Python
/// functions (parsing and walking the syntax trees of the files it checks).
#[test]
fn pyflakes_over_the_standard_library_names_its_own_functions() -> Result<()> {
    require_root();
    let _one = one_profiler_at_a_time();
    // The workload protocol (pid, then wait for a line), then pyflakes as `python3 -m
    // pyflakes` runs it; it exits 1 when it finds something to say, which is not a
    // failure here.
    let launcher = "import os, runpy, sys\n\
        print(os.getpid(), flush=True)\n\
        sys.stdin.readline()\n\
        sys.argv = ['pyflakes', '/usr/lib/python3.11/email', '/usr/lib/python3.11/json']\n\
        try:\n\
        \x20   runpy.run_module('pyflakes', run_name='__main__')\n\
        except SystemExit:\n\
        \x20   pass\n";
    let (profile, _) = profile_by_pid(
        Path::new(DEBIAN_PYTHON),
        &["-c", launcher],
        &[],
        "python-pyflakes",
    )?;
    let stacks = profile["stacks"].as_array().context("stacks")?;
    let bytes = |s: &Value| s["estimated_bytes"].as_f64().unwrap_or(0.0);
    let mentions = |s: &Value, what: &str| {
        s["frames"].as_array().is_some_and(|f| {
            f.iter()
                .any(|f| f.as_str().is_some_and(|f| f.contains(what)))
        })
    };
    let total: f64 = stacks.iter().map(bytes).sum();
    let own: f64 = stacks
        .iter()
        .filter(|s| mentions(s, "/pyflakes/"))
        .map(bytes)
        .sum();
    let top = stacks
        .iter()
        .max_by(|a, b| bytes(a).total_cmp(&bytes(b)))
        .context("no stacks")?;
    println!(
        "pyflakes' own frames under {:.1}% of {total:.0} bytes",
        100.0 * own / total
    );
    assert!(own > 0.5 * total, "{own} of {total}");
    assert!(mentions(top, "/pyflakes/"), "top stack: {}", top["frames"]);
    Ok(())
}

/// A process that looks like CPython 3.11 and forges every structure allocbpf reads
/// (`workloads/python_forged.c`: a cyclic frame chain, a name and a line table that
/// claim a terabyte, a name that is not a compact string, a code pointer into unmapped
/// memory, and for its second thread, which does not hold the "GIL", a cyclic list of
/// thread states that never names it). allocbpf must finish on time with its profile,
/// keep at most 48 Python frames per sample, cut names to 1,024 characters, refuse the
/// rest, and profile the second thread without Python frames.
#[test]
fn a_forged_interpreter_cannot_make_the_frame_walk_loop_or_grow() -> Result<()> {
    require_root();
    let _one = one_profiler_at_a_time();
    let dir = scratch_dir("python-forged");
    // Its file name says python, as an interpreter's would.
    let built = compile_workload("python_forged", &["-O1", "-rdynamic", "-pthread"])?;
    let binary = dir.join("python3.11-forged");
    std::fs::copy(&built, &binary)?;
    let (profile, _) = profile_by_pid(&binary, &["2"], &[], "python-forged")?;
    let stacks = profile["stacks"].as_array().context("stacks")?;
    assert!(
        !stacks.is_empty(),
        "the forged process's mallocs are still profiled"
    );
    let mut forged_frames = 0;
    let mut without_python = 0;
    for stack in stacks {
        let frames = stack["frames"].as_array().unwrap();
        let python: Vec<&str> = frames
            .iter()
            .filter_map(|f| f.as_str())
            .filter(|f| f.ends_with("(forged!)") || f.contains("(forged!:"))
            .collect();
        assert!(python.len() <= 48, "{} Python frames", python.len());
        for frame in &python {
            let chars = frame.chars().count();
            assert!(
                chars <= 1024 + " (forged!)".len(),
                "a name of {chars} characters"
            );
            assert!(
                !frame.starts_with("loose"),
                "a name that is not a compact str: {frame}"
            );
        }
        forged_frames += python.len();
        without_python += usize::from(python.is_empty());
    }
    // The name that claims a terabyte is read, cut: the walk did reach the frames.
    assert!(forged_frames > 0, "{stacks:?}");
    // The second thread's samples: none of the cycle's thread states names it.
    assert!(without_python > 0, "{stacks:?}");
    Ok(())
}
