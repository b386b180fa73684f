//! HotSpot JVMs, profiled from outside with no agent and no flag: Debian's OpenJDK 17
//! and the Temurin 25 JDK run `workloads/java/AllocSites.java` (known sites: byte
//! arrays in a method the JIT inlines, objects of a known class, big arrays outside any
//! TLAB), by pid and under the agent. Each site's estimate is checked against its
//! truth within a bound derived from the estimator (docs/statistics.md, "JVM"), its
//! class is the leaf frame and its Java frames are named with their files and lines.
//! Processes that impersonate a JVM (`workloads/jvm_forged.c`) are refused with a line
//! and profiled natively. Run as root.

use std::{path::Path, process::Command};

use allocbpf_e2e::{
    agent::profile_workload_under_agent,
    compile_workload,
    jvm::{classes, start_alloc_sites, truth, Site, JDK17, JDK25},
    one_profiler_at_a_time, profile_from_go, require_root, scratch_dir, sum_field, workload_source,
    Workload,
};
use anyhow::{ensure, Context, Result};
use serde_json::Value;

/// Iterations of the main thread's loop (15% small arrays, 85% points): about 15 GB of
/// TLAB allocations, several thousand TLABs.
const ITERATIONS: &str = "80000000";

/// Big arrays the second thread allocates (4 MiB each, outside any TLAB).
const BIG_ARRAYS: &str = "600";

/// The leaf class and the function of each site, and the source line it allocates at.
fn site_frames(name: &str) -> (&'static str, &'static str, &'static str) {
    match name {
        "smallArray" => ("byte[]", "AllocSites.smallArray", "return new byte[1024];"),
        "point" => (
            "AllocSites$Point",
            "AllocSites.pointSite",
            "sink = new Point(i);",
        ),
        _ => (
            "long[]",
            "AllocSites.bigSite",
            "bigSink = new long[1 << 19];",
        ),
    }
}

/// The line of the workload's source that holds `text`.
fn line_of(text: &str) -> usize {
    let source = std::fs::read_to_string(workload_source("java/AllocSites.java")).unwrap();
    source
        .lines()
        .position(|l| l.contains(text))
        .expect("source line")
        + 1
}

/// The stacks (JSON, frames outermost first) whose leaf is `class` and that hold a frame
/// of `function`.
fn stacks_of<'a>(profile: &'a Value, class: &str, function: &str) -> Vec<&'a Value> {
    let prefix = format!("{function} (");
    profile["stacks"]
        .as_array()
        .map(|stacks| {
            stacks
                .iter()
                .filter(|s| {
                    let frames = s["frames"].as_array();
                    frames.and_then(|f| f.last()).and_then(Value::as_str) == Some(class)
                        && frames.is_some_and(|f| {
                            f.iter()
                                .any(|x| x.as_str().is_some_and(|x| x.starts_with(&prefix)))
                        })
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Checks each site's estimate, class and frames in `profile` against the workload's
/// `output`.
///
/// The bound (docs/statistics.md, "JVM"): a TLAB's weight `W` goes to the object that
/// crossed the previous TLAB's end, which is each byte with probability `1/W` in the
/// main thread's well-mixed stream: site `s` with `b_s` bytes gets a binomial number of
/// TLABs, whose estimate has standard deviation at most `sqrt(b_s W)` (the Poisson
/// bound); `W` is the mean weight of the sites' samples. Three biases are bounded
/// apart: each TLAB the collector retired is followed by one whose first object is
/// picked by count, not by bytes (at most `(G + 2) W |count share - byte share|` for
/// `G` collections, and the run's first TLAB); a TLAB's unused tail (at most 1/64 of
/// it, HotSpot's refill waste limit) is charged too; and the TLABs at the run's two
/// ends are partly outside it (`W`). The estimate must lie within 5 standard
/// deviations beyond those (a correct estimator fails with probability below 1e-6).
/// Big arrays are at least the certain threshold: exact. Every site's object estimate
/// must be its bytes' over the site's object size (the weights' attribution).
fn check_sites(profile: &Value, output: &str, label: &str) -> Result<()> {
    let (sites, collections) = truth(output)?;
    let tlab: Vec<&Site> = sites.iter().filter(|s| s.name != "bigArray").collect();
    let (tlab_bytes, tlab_objects): (f64, f64) = (
        tlab.iter().map(|s| s.bytes()).sum(),
        tlab.iter().map(|s| s.count).sum(),
    );
    let mut estimates = Vec::new();
    let (mut weight_sum, mut samples) = (0.0, 0.0);
    for site in &sites {
        let (class, function, text) = site_frames(&site.name);
        let stacks = stacks_of(profile, class, function);
        ensure!(
            !stacks.is_empty(),
            "{label}: no stack of {class} under {function}"
        );
        // Frames named with file and line: the allocating line of the site's method.
        let shown = format!("{function} (AllocSites.java:{})", line_of(text));
        ensure!(
            stacks.iter().any(|s| s["frames"]
                .as_array()
                .unwrap()
                .iter()
                .any(|f| f == &Value::from(shown.as_str()))),
            "{label}: no frame {shown} in {stacks:?}"
        );
        if site.name != "bigArray" {
            weight_sum += sum_field(&stacks, "estimated_bytes");
            samples += sum_field(&stacks, "samples");
        }
        estimates.push(sum_field(&stacks, "estimated_bytes"));
        // Each sample stands for its object: its object estimate is its bytes' over
        // the object's size (the TLAB's size over it, had it not been attributed).
        let objects = sum_field(&stacks, "estimated_objects");
        let per_object = sum_field(&stacks, "estimated_bytes") / objects.max(1.0);
        ensure!(
            (per_object / site.bytes_each - 1.0).abs() < 0.01,
            "{label}: {} estimated {objects:.0} objects of {per_object:.0} bytes, not of {}",
            site.name,
            site.bytes_each
        );
    }
    let w = weight_sum / samples.max(1.0);
    for (site, estimate) in sites.iter().zip(estimates) {
        let truth = site.bytes();
        if site.name == "bigArray" {
            ensure!(
                (estimate - truth).abs() <= 1.0,
                "{label}: big arrays (certain) estimated {estimate}, truth {truth}"
            );
            continue;
        }
        let shares = (site.count / tlab_objects - truth / tlab_bytes).abs();
        let collected = (collections + 2.0) * w * shares;
        let sd = (truth * (1.0 + 1.0 / 64.0) * w).sqrt();
        let lo = truth - 5.0 * sd - collected - w;
        let hi = truth * (1.0 + 1.0 / 64.0) + 5.0 * sd + collected + w;
        eprintln!(
            "{label}: {} truth {truth:.0} estimate {estimate:.0} ({:+.2}%), bound [{lo:.0}, {hi:.0}], W {w:.0}, {collections} GCs",
            site.name,
            100.0 * (estimate / truth - 1.0)
        );
        ensure!(
            (lo..=hi).contains(&estimate),
            "{label}: {} estimated {estimate:.0}, outside [{lo:.0}, {hi:.0}] around its truth {truth:.0}",
            site.name
        );
    }
    // The inlined method: `smallArray` is compiled into `smallSite`, and both show.
    let small = stacks_of(profile, "byte[]", "AllocSites.smallArray");
    let caller = format!(
        "AllocSites.smallSite (AllocSites.java:{})",
        line_of("sink = smallArray();")
    );
    ensure!(
        small.iter().any(|s| s["frames"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f == &Value::from(caller.as_str()))),
        "{label}: the inlined caller {caller} is missing: {small:?}"
    );
    Ok(())
}

/// Starts the workload on the JDK at `home`.
fn start(home: &str, seed: &str) -> Result<Workload> {
    start_alloc_sites(home, &[], ITERATIONS, seed, BIG_ARRAYS)
}

/// Profiles the workload on `home` by pid; checks its sites.
fn by_pid(home: &str, major: &str) -> Result<()> {
    require_root();
    ensure!(
        Path::new(home).join("bin/java").exists(),
        "no JDK {major} at {home} (docs/build.md: Temurin 25 comes from adoptium.net, \
         Debian's 17 from `cargo xtask setup`)"
    );
    let _one = one_profiler_at_a_time();
    let dir = scratch_dir(&format!("jvm-{major}"));
    let out = dir.join("profile.json");
    let workload = start(home, "7")?;
    let pid = workload.pid;
    let (profile, finished, output) = profile_from_go(workload, pid, &out)?;
    ensure!(
        finished.startup_line().contains("HotSpot Java heap"),
        "{}",
        finished.stderr
    );
    check_sites(&profile, &output, &format!("JDK {major}"))
}

#[test]
fn openjdk_17_by_pid_sites_classes_inlined_frames_and_estimates() -> Result<()> {
    by_pid(JDK17, "17")
}

#[test]
fn temurin_25_by_pid_sites_classes_inlined_frames_and_estimates() -> Result<()> {
    by_pid(JDK25, "25")
}

/// The agent finds a running JVM (at its start-up scan, the JVM waiting for its go after
/// its warm-up, so that what the agent sees is the workload's measured run), stores its
/// Java heap profiles with `runtime=jvm`, its version and its main class (what its
/// service name comes from), names its Java frames, and its estimates, merged over the
/// intervals by `allocbpf report`, are within the sites' bounds. The budget is off: the
/// bounds are those of full-time sampling (the budget's time sampling has its own,
/// docs/statistics.md).
#[test]
fn the_agent_profiles_a_jvm_with_its_labels_frames_and_estimates() -> Result<()> {
    // No other test's JVM (they are all `java`) runs while the agent looks.
    let _profilers = one_profiler_at_a_time();
    let workload = start(JDK17, "11")?;
    let found = format!("pid {}: HotSpot JDK 17", workload.pid);
    let run = profile_workload_under_agent("agent-jvm", "^java$", workload, &found)?;
    for label in [
        "runtime:[jvm]",
        "java_version:[17]",
        "java_main:[AllocSites]",
        "comm:[java]",
    ] {
        ensure!(
            run.pprof.contains(label),
            "missing {label} in the JVM's profiles"
        );
    }
    check_sites(&run.profile, &run.output, "JDK 17 under the agent")
}

/// A process that maps a file named libjvm.so and exports HotSpot's table symbols, with
/// tables that lie (no terminator, a 2^40 stride, a name without its end, names that
/// point at the table): each is refused with a line saying why, within the run, and the
/// process is profiled natively, its tracer calls counted.
#[test]
fn a_forged_jvm_is_refused_and_profiled_natively() -> Result<()> {
    require_root();
    let _one = one_profiler_at_a_time();
    let dir = scratch_dir("jvm-forged");
    let built = compile_workload("jvm_forged", &["-O1", "-rdynamic"])?;
    let binary = dir.join("libjvm.so");
    std::fs::copy(&built, &binary)?;
    for (mode, why) in [
        ("endless", "a table without its terminator"),
        ("stride", "a table's stride"),
        ("name", "a name without its end"),
        ("loop", "a name is not"),
    ] {
        let workload = Workload::start(&binary, &[mode])?;
        let pid = workload.pid;
        let out = dir.join(format!("{mode}.json"));
        let (profile, finished, _) = profile_from_go(workload, pid, &out)?;
        ensure!(
            finished
                .stderr
                .contains("maps libjvm.so but is profiled without Java frames")
                && finished.stderr.contains(why),
            "{mode}: {}",
            finished.stderr
        );
        ensure!(
            profile["stacks"].as_array().is_some_and(|s| !s.is_empty()),
            "{mode}: nothing profiled"
        );
        // Every tracer call took 1 MiB or 8 MiB: counted, far beyond the mallocs.
        let exact = profile["totals"]["exact_bytes"].as_f64().unwrap_or(0.0);
        ensure!(exact > 1e9, "{mode}: {exact} bytes counted");
    }
    Ok(())
}

/// A JDK whose libjvm is stripped of its local symbols (the allocation tracer's): the
/// JVM is told apart and said so, and its native allocations are still profiled. The
/// JDK is Debian's, linked file by file, with the launcher copied (it finds its home
/// from its own path) and a stripped copy of libjvm.
#[test]
fn a_stripped_libjvm_is_said_and_profiled_natively() -> Result<()> {
    require_root();
    let _one = one_profiler_at_a_time();
    let dir = scratch_dir("jvm-stripped");
    let home = dir.join("jdk");
    if !home.exists() {
        let linked = Command::new("cp")
            .arg("-rs")
            .arg(format!("{JDK17}/"))
            .arg(&home)
            .status()?;
        ensure!(linked.success(), "cp -rs of the JDK");
        for file in ["bin/java", "lib/server/libjvm.so"] {
            std::fs::remove_file(home.join(file))?;
            std::fs::copy(Path::new(JDK17).join(file), home.join(file))?;
        }
        let stripped = Command::new("strip")
            .arg("--strip-all")
            .arg(home.join("lib/server/libjvm.so"))
            .status()?;
        ensure!(stripped.success(), "strip");
    }
    let workload = start(home.to_str().context("path")?, "5")?;
    let pid = workload.pid;
    let (profile, finished, _) = profile_from_go(workload, pid, &dir.join("profile.json"))?;
    ensure!(
        finished
            .stderr
            .contains("defines no allocation tracer symbols (a stripped libjvm)"),
        "{}",
        finished.stderr
    );
    ensure!(
        !finished.startup_line().contains("HotSpot Java heap"),
        "{}",
        finished.stderr
    );
    ensure!(
        profile["totals"]["exact_calls"].as_f64().unwrap_or(0.0) > 0.0,
        "its native allocations are counted: {}",
        profile["totals"]
    );
    Ok(())
}

/// A JVM in a container's namespaces: its own mount namespace with a /tmp of its own,
/// its own pid namespace (where it is pid 1). It is profiled by its host pid like any
/// other, its Java frames named.
#[test]
fn a_jvm_in_its_own_mount_and_pid_namespaces_is_profiled() -> Result<()> {
    require_root();
    let _one = one_profiler_at_a_time();
    let dir = scratch_dir("jvm-container");
    // Its classes are copied into a tmpfs of its own first: the scratch directory may
    // be under the host's /tmp, which its own /tmp hides.
    let script = format!(
        "mount -t tmpfs none /mnt && cp -r {}/. /mnt/ && mount -t tmpfs none /tmp && \
         exec {JDK17}/bin/java -cp /mnt AllocSites {ITERATIONS} 3 {BIG_ARRAYS}",
        classes().display()
    );
    let workload = Workload::spawn(Command::new("unshare").args([
        "--mount",
        "--propagation",
        "private",
        "--pid",
        "--fork",
        "sh",
        "-c",
        &script,
    ]))?;
    // It printed its pid in its own namespace; the host's is the child of unshare.
    ensure!(workload.pid == 1, "pid in its namespace: {}", workload.pid);
    let unshare = workload.child.id();
    let children = std::fs::read_to_string(format!("/proc/{unshare}/task/{unshare}/children"))?;
    let pid: u32 = children
        .split_whitespace()
        .next()
        .context("unshare's child")?
        .parse()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    ensure!(
        status
            .lines()
            .any(|l| l.starts_with("NSpid:") && l.ends_with("\t1")),
        "{status}"
    );
    let (profile, _, output) = profile_from_go(workload, pid, &dir.join("profile.json"))?;
    check_sites(&profile, &output, "JDK 17 in a container")
}
