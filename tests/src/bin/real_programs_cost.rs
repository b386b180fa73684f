//! What the default agent costs two real programs nobody here wrote (`cargo xtask
//! bench --parts agent`): a Java compile in one JVM (Debian's OpenJDK 17 compiling
//! Apache Commons Lang's sources from Maven Central twice through `javax.tools`) and an
//! npm build tool (terser minifying lodash and its own bundle, on the machine's
//! Node.js 20). Each round runs both, bare rounds first, then the same rounds under one
//! `allocbpf agent` at its defaults. Prints each program's times, ratios to the bare
//! median, the agent's CPU over each program's rounds (per second of the program, per
//! process and per sample), its high-water, and what the store holds of the programs.
//!
//! The inputs are fetched once into `~/.cache/allocbpf/bench/` (Maven Central, npm).

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Instant,
};

use allocbpf_e2e::{
    agent::{metric, scrape_within, AgentProcess},
    bench::{cpu_seconds, high_water_kib, median, observed, rounds_arg},
    jvm::JDK17,
    node::NODE20,
    scratch_dir,
};
use anyhow::{bail, Context, Result};

const METRICS: &str = "127.0.0.1:19498";

/// The Java sources compiled: a few hundred files, no dependencies beyond the JDK.
const JAVA_SOURCES: &str = "https://repo1.maven.org/maven2/org/apache/commons/commons-lang3/3.18.0/commons-lang3-3.18.0-sources.jar";
/// Compiles per JVM: the second runs on a warmed-up compiler, as a build's do.
const COMPILES_PER_JVM: &str = "2";
/// The npm packages, pinned: the same work in every run.
const NPM_PACKAGES: &[&str] = &["terser@5.51.4", "lodash@4.18.1"];

/// The compile driver: `javax.tools` in one JVM, each compile timed.
const DRIVER: &str = r#"
import javax.tools.ToolProvider;
import java.nio.file.*;
import java.util.*;

public class CompileSources {
    public static void main(String[] args) throws Exception {
        var compiler = ToolProvider.getSystemJavaCompiler();
        List<String> files = Files.readAllLines(Path.of(args[0]));
        for (int i = 0; i < Integer.parseInt(args[2]); i++) {
            List<String> argv = new ArrayList<>(
                List.of("-nowarn", "-encoding", "UTF-8", "-d", args[1] + "/" + i));
            argv.addAll(files);
            if (compiler.run(null, null, System.err, argv.toArray(new String[0])) != 0) {
                throw new RuntimeException("javac failed");
            }
        }
    }
}
"#;

/// The fetched inputs.
struct Inputs {
    /// The unpacked Java sources (the compile's working directory).
    java_sources: PathBuf,
    /// `files.txt`: the sources to compile, relative to `java_sources`.
    java_list: PathBuf,
    /// `CompileSources.java`.
    driver: PathBuf,
    /// The npm project with terser and lodash installed.
    npm: PathBuf,
}

fn run_quietly(command: &mut Command, what: &str) -> Result<()> {
    let output = command
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {what}"))?;
    if !output.status.success() {
        bail!("{what} failed: {}", String::from_utf8_lossy(&output.stderr));
    }
    Ok(())
}

/// Fetches and unpacks the inputs into the cache, once.
fn prepare_inputs() -> Result<Inputs> {
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    let cache = Path::new(&home).join(".cache/allocbpf/bench");
    let java_sources = cache.join("commons-lang3-3.18.0");
    let java_list = cache.join("commons-lang3-3.18.0.files");
    if !java_list.exists() {
        std::fs::create_dir_all(&java_sources)?;
        let jar = cache.join("commons-lang3-3.18.0-sources.jar");
        run_quietly(
            Command::new("curl")
                .args(["-sfL", "-o"])
                .arg(&jar)
                .arg(JAVA_SOURCES),
            "curl (Maven Central)",
        )?;
        run_quietly(
            Command::new(format!("{JDK17}/bin/jar"))
                .arg("xf")
                .arg(&jar)
                .current_dir(&java_sources),
            "jar xf",
        )?;
        let mut files: Vec<String> = walk_java(&java_sources, &java_sources)?;
        files.sort();
        std::fs::write(&java_list, files.join("\n") + "\n")?;
    }
    let driver = cache.join("CompileSources.java");
    std::fs::write(&driver, DRIVER)?;
    let npm = cache.join("npm");
    if !npm.join("node_modules/terser/bin/terser").exists() {
        std::fs::create_dir_all(&npm)?;
        std::fs::write(npm.join("package.json"), "{\"private\": true}\n")?;
        run_quietly(
            Command::new("npm")
                .args(["install", "--no-audit", "--no-fund", "--silent"])
                .args(NPM_PACKAGES)
                .current_dir(&npm),
            "npm install",
        )?;
    }
    Ok(Inputs {
        java_sources,
        java_list,
        driver,
        npm,
    })
}

/// The `.java` files under `dir`, relative to `root`.
fn walk_java(root: &Path, dir: &Path) -> Result<Vec<String>> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            found.extend(walk_java(root, &path)?);
        } else if path.extension().is_some_and(|e| e == "java") {
            found.push(path.strip_prefix(root)?.to_string_lossy().into_owned());
        }
    }
    Ok(found)
}

/// One compile run (a new JVM compiling the sources twice): its wall seconds.
fn compile(inputs: &Inputs, out: &Path) -> Result<f64> {
    let _ = std::fs::remove_dir_all(out);
    let started = Instant::now();
    run_quietly(
        Command::new(format!("{JDK17}/bin/java"))
            .arg(&inputs.driver)
            .arg(&inputs.java_list)
            .arg(out)
            .arg(COMPILES_PER_JVM)
            .current_dir(&inputs.java_sources),
        "the Java compile",
    )?;
    Ok(started.elapsed().as_secs_f64())
}

/// One minify run (terser on lodash and its own bundle): its wall seconds.
fn minify(inputs: &Inputs, out: &Path) -> Result<f64> {
    let started = Instant::now();
    run_quietly(
        Command::new(NODE20)
            .arg("node_modules/terser/bin/terser")
            .args([
                "node_modules/lodash/lodash.js",
                "node_modules/terser/dist/bundle.min.js",
                "-c",
                "-m",
                "-o",
            ])
            .arg(out)
            .current_dir(&inputs.npm),
        "terser",
    )?;
    Ok(started.elapsed().as_secs_f64())
}

/// One program's figures under the agent.
struct UnderAgent {
    times: Vec<f64>,
    agent_cpu: f64,
    /// The agent's counters' growth over the rounds: samples, and its CPU seconds
    /// resolving samples and looking at runtimes.
    samples: f64,
    sample_cpu: f64,
    look_cpu: f64,
}

/// The agent's counters this bench reads: samples, CPU seconds on samples and looks.
fn agent_counters() -> [f64; 3] {
    let text = scrape_within(METRICS, std::time::Duration::from_secs(5)).unwrap_or_default();
    let m = |name: &str| metric(&text, name).unwrap_or(f64::NAN);
    [
        m("allocbpf_samples_total"),
        m("allocbpf_agent_sample_milliseconds_total") / 1e3,
        m("allocbpf_agent_look_milliseconds_total") / 1e3,
    ]
}

/// Runs `program` `rounds` times; with an agent, also what it spent meanwhile.
fn rounds_of(
    rounds: usize,
    agent: Option<u32>,
    mut program: impl FnMut() -> Result<f64>,
) -> Result<UnderAgent> {
    let before = match agent {
        Some(pid) => (cpu_seconds(pid)?, agent_counters()),
        None => (0.0, [0.0; 3]),
    };
    let times = (0..rounds).map(|_| program()).collect::<Result<Vec<_>>>()?;
    let after = match agent {
        Some(pid) => (cpu_seconds(pid)?, agent_counters()),
        None => (0.0, [0.0; 3]),
    };
    Ok(UnderAgent {
        times,
        agent_cpu: after.0 - before.0,
        samples: after.1[0] - before.1[0],
        sample_cpu: after.1[1] - before.1[1],
        look_cpu: after.1[2] - before.1[2],
    })
}

fn report(name: &str, bare: &UnderAgent, profiled: &UnderAgent, stored: (usize, u64, f64)) {
    let list = |values: &[f64]| {
        (values.iter())
            .map(|v| format!("{v:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let base = median(&bare.times);
    let ratios: Vec<f64> = profiled.times.iter().map(|t| t / base).collect();
    let busy: f64 = profiled.times.iter().sum();
    println!("{name}:");
    println!("  bare (s):            {}", list(&bare.times));
    println!("  under the agent (s): {}", list(&profiled.times));
    println!("  ratios to the bare median: {}", list(&ratios));
    println!(
        "  agent / bare (medians): x{:.3}",
        median(&profiled.times) / base
    );
    println!(
        "  agent's CPU over these rounds: {:.2} s in {busy:.1} s ({:.1}% of a CPU), {:.2} s per process run, {:.0} us per sample ({:.0} samples)",
        profiled.agent_cpu,
        profiled.agent_cpu / busy * 100.0,
        profiled.agent_cpu / profiled.times.len() as f64,
        profiled.agent_cpu / profiled.samples * 1e6,
        profiled.samples
    );
    println!(
        "  of which resolving samples {:.2} s ({:.0} us each), looking at runtimes {:.2} s, the rest (discovery, reading, housekeeping) {:.2} s",
        profiled.sample_cpu,
        profiled.sample_cpu / profiled.samples * 1e6,
        profiled.look_cpu,
        profiled.agent_cpu - profiled.sample_cpu - profiled.look_cpu
    );
    let (processes, samples, fraction) = stored;
    println!(
        "  in the store: {processes} processes, {samples} samples, observed {:.1}% of the time (mean)",
        fraction * 100.0
    );
}

fn main() -> Result<()> {
    let rounds = rounds_arg(5)?;
    let inputs = prepare_inputs()?;
    let scratch = scratch_dir("real-programs-cost");
    let classes = scratch.join("classes");
    let minified = scratch.join("out.min.js");
    let bare_java = rounds_of(rounds, None, || compile(&inputs, &classes))?;
    let bare_npm = rounds_of(rounds, None, || minify(&inputs, &minified))?;

    let store = scratch.join("store");
    let agent = AgentProcess::start_default(&store, METRICS)?;
    let pid = agent.child.id();
    let java = rounds_of(rounds, Some(pid), || compile(&inputs, &classes))?;
    let npm = rounds_of(rounds, Some(pid), || minify(&inputs, &minified))?;
    let high_water = high_water_kib(pid);
    agent.terminate(std::time::Duration::from_secs(60))?;

    println!("default agent vs none, real programs ({rounds} runs each):");
    let sources = std::fs::read_to_string(&inputs.java_list)?.lines().count();
    report(
        &format!("OpenJDK 17 compiling commons-lang3 3.18.0 ({sources} sources, twice per JVM)"),
        &bare_java,
        &java,
        observed(&store, "java"),
    );
    report(
        "terser 5.51.4 minifying lodash.js and terser's bundle (Node.js 20)",
        &bare_npm,
        &npm,
        observed(&store, "node"),
    );
    println!("agent's memory high-water: {:.1} MiB", high_water / 1024.0);
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(())
}
