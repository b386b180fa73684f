//! End to end, as root: the overhead budget (docs/design.md, "Overhead budget").
//!
//! The agent's: a malloc-heavy program nobody here wrote (gcc's cc1 on a generated
//! 5,000-function file, ~3 s per compile) runs again and again beside a light, steady
//! allocator with a known byte rate (`workloads/steady.c`); both share the host's libc,
//! which the budget probes part time for cc1's sake, and the light one is probed full
//! time all the same, through its own links (the budget is per process). The
//! agent is the default one (budget on; only the store, interval and metrics address
//! set). And `--pid --budget` on one heavy process. The tests take the agent tests'
//! lock: they measure speed, and must not run beside each other.

use std::time::{Duration, Instant};

use allocbpf_e2e::{
    agent::{metric, one_agent_test, scrape_within, stored_profiles, AgentProcess},
    bench::{compile_big, median, write_malloc_heavy_source, CompileTimes},
    compile_workload,
    stored::{read_stored, Stored},
    Profiler, Workload,
};
use allocbpf_profile::estimate::sample_probability;

const METRICS: &str = "127.0.0.1:19481";

/// The default sampling rate (the agent's).
const RATE: u64 = 512 << 10;

/// The least share of time the default budget probes an image: one `min_window`
/// (10 ms) per `period` (1 s).
const MIN_DUTY: f64 = 0.01;

/// The standard deviation bound of an estimate of `calls` allocations of `size` bytes
/// observed at the budget's floor (derivation in the tests' docs): `n S² (1-π)/π` with
/// `π = p(S)·MIN_DUTY`.
fn derived_sd(calls: f64, size: f64) -> f64 {
    let inclusion = sample_probability(size as u64, RATE) * MIN_DUTY;
    (calls * size * size * (1.0 - inclusion) / inclusion).sqrt()
}

/// - The probes cost the compiles a few percent of their own CPU time: the median of
///   their system time per user second (gcc, cc1 and as, from `wait4`) under the
///   agent (the first left out: it pays the start-up allowances, once per program) is
///   at most 0.06 over its median in six bare compiles (three before, three after).
///   Derived: cc1 costs far more than the budget full time, so the budget holds
///   libc at its floor, one 10 ms window per 1 s period, whose probes go in at most
///   `MAX_LEAD` (40 ms) before it and are out at its end (a link's close removes its
///   breakpoints at once): probes in at most 5% of the time, traps at most all of it,
///   so at most 0.05/0.9 ≈ 0.056 more system time per user second. Traps run in the
///   kernel, so this is the cost itself; a slower host stretches user and system
///   time alike, so the ratio holds still where wall time does not.
/// - The compiles' wall time, median under the agent over the bare median, is at most
///   1.25: a guard against gross slowdowns (the agent this budget replaced doubled
///   them), not the measure of the cost. Back-to-back bare compiles on this VM have
///   spread from 3.5 to 5.2 s, and blocks of them drift by 10% against each other, so
///   a tighter wall bound fails on noise; `cargo xtask bench --parts agent` reports
///   the wall ratios.
/// - Every cc1 (each lives ~3 s, over the ~2 s that one window per 1 s period
///   guarantees to catch) has a stored profile with samples. That holds while windows
///   come in every period (`budget_periods_with_windows_percent` 100, asserted): moving
///   libc's probes costs the agent ~0.8 ms of CPU a period on this host, against the
///   5 ms of `budget.window_moves_cpu_percent` (docs/statistics.md, "Activation").
/// - The light allocator is probed full time, cc1's windows on the libc they share
///   notwithstanding: every profile of it says it was observed at least 99% of its
///   interval (its own links go in at the budget check that lowers libc's duty, tens
///   of milliseconds of an interval of 10 s observed through the windows only).
/// - The light allocator's estimate, summed over its profiles, is within 4 standard
///   deviations of the truth it printed. The deviation is derived, not measured: each
///   of its `n` calls of `S` bytes is in a window with probability `d`, at least 1%
///   (the default budget never probes an image less than one 10 ms window per 1 s
///   period; taking the floor rather than what the profiles report keeps the bound
///   independent of the code under test, and only widens it) and sampled with
///   probability `p = 1 - exp(-S/R)`; were calls included independently
///   with probability `π = p·d`, the Horvitz-Thompson sum `Σ S/π` would have variance
///   `n S² (1-π)/π`. Windows include calls in runs, but the calls here are evenly
///   spaced (one per ms), so whole windows vary less than independent calls: the
///   bound is conservative. Four deviations: a two-sided normal tail of 6e-5.
#[test]
fn the_default_budget_keeps_compiles_fast_and_sees_every_process() {
    let (_one, scratch, store) = one_agent_test("agent-budget");
    write_malloc_heavy_source(&scratch, 5000).unwrap();
    let steady = compile_workload("steady", &["-O1", "-g", "-fno-omit-frame-pointer"]).unwrap();
    let compile = || compile_big(&scratch).unwrap();
    let mut bare: Vec<CompileTimes> = (0..3).map(|_| compile()).collect();

    let agent = AgentProcess::start_storing(&store, "10s", METRICS).unwrap();
    // 30 s of 64 KiB every millisecond: 1.9 GiB requested in 30,000 calls. Light: its
    // traps and the recording of its ~120 samples a second cost it ~0.3% of a CPU.
    let mut light = Workload::start(&steady, &["30", "65536", "1000"]).unwrap();
    let started = Instant::now();
    let mut profiled = Vec::new();
    while started.elapsed() < Duration::from_secs(26) {
        profiled.push(compile());
    }
    let done = light
        .stdout
        .wait_for("allocated", Duration::from_secs(30))
        .unwrap();
    let truth: f64 = done.split_whitespace().nth(2).unwrap().parse().unwrap();
    let calls: f64 = done.split_whitespace().nth(1).unwrap().parse().unwrap();
    light.wait(Duration::from_secs(10)).unwrap();
    let metrics = scrape_within(METRICS, Duration::from_secs(5)).unwrap();
    agent.terminate(Duration::from_secs(60)).unwrap();
    bare.extend((0..3).map(|_| compile()));

    // The first compile under the new agent is left out of the cost: its cc1 and as
    // are the first of their programs, probed full time for their start-up allowance
    // (docs/design.md, "Start-up allowances"), which a program gets at most once per
    // `allowance / process_cpu` (50 s, longer than this test). Its figures are printed.
    let steady = &profiled[1..];
    let (bare_walls, profiled_walls) = (CompileTimes::walls(&bare), CompileTimes::walls(steady));
    let (bare_system, profiled_system) = (
        CompileTimes::systems_per_user(&bare),
        CompileTimes::systems_per_user(steady),
    );
    let ratio = median(&profiled_walls) / median(&bare_walls);
    let extra_system = median(&profiled_system) - median(&bare_system);
    eprintln!(
        "first compile under the agent (start-up allowances): {:.2} s, {:.3} system s per user s",
        CompileTimes::walls(&profiled[..1])[0],
        CompileTimes::systems_per_user(&profiled[..1])[0],
    );
    eprintln!(
        "bare {bare_walls:.2?} s, under the agent {profiled_walls:.2?} s: median ratio {ratio:.3}; system s per user s: bare {bare_system:.3?}, under the agent {profiled_system:.3?}: median +{extra_system:.3}; windows opened {:?}, blind {:?}",
        metric(&metrics, "allocbpf_window_attaches_total"),
        metric(&metrics, "allocbpf_window_blind_spots_total"),
    );
    assert!(
        extra_system <= 0.06,
        "the probes cost the compiles +{extra_system:.3} system s per user s"
    );
    assert!(ratio <= 1.25, "compiles under the agent: x{ratio:.3}");
    let share = metric(&metrics, "allocbpf_budget_periods_with_windows_percent");
    assert_eq!(
        share,
        Some(100.0),
        "windows came in a share of the periods: moving libc's probes cost the agent more \
         than budget.window_moves_cpu_percent on this host, and a cc1 can go unseen"
    );

    let stored: Vec<Stored> = stored_profiles(&store)
        .iter()
        .map(|p| read_stored(p))
        .collect();
    let mut cc1: std::collections::HashMap<u32, u64> = Default::default();
    for s in stored.iter().filter(|s| s.comm == "cc1") {
        *cc1.entry(s.pid).or_default() += s.samples;
    }
    eprintln!("cc1 samples per process: {cc1:?}");
    assert_eq!(
        cc1.len(),
        profiled.len(),
        "one cc1 per compile in the store"
    );
    assert!(
        cc1.values().all(|&n| n > 0),
        "every cc1 has samples: {cc1:?}"
    );

    let mine: Vec<&Stored> = stored.iter().filter(|s| s.pid == light.pid).collect();
    let estimate: f64 = mine.iter().map(|s| s.estimated_bytes).sum();
    let d = mine
        .iter()
        .filter_map(|s| s.observed_fraction)
        .fold(1.0f64, f64::min);
    assert!(
        mine.iter().all(|s| s.observed_fraction.is_some()),
        "every profile says how much was observed"
    );
    let sd = derived_sd(calls, truth / calls);
    eprintln!(
        "light allocator: truth {truth:.0}, estimate {estimate:.0} ({:+.1}%), observed fraction >= {d:.4} (reported), sd at most {sd:.0} ({:.1}%), {} profiles",
        (estimate / truth - 1.0) * 100.0,
        sd / truth * 100.0,
        mine.len()
    );
    assert!(
        d >= 0.99,
        "the light allocator shares libc with cc1 but is light: probed full time ({d})"
    );
    assert!(
        (estimate - truth).abs() <= 4.0 * sd,
        "estimate {estimate:.0} vs truth {truth:.0}: more than 4 sd ({sd:.0})"
    );
}

/// `--pid PID --budget 1%` on a process that would spend ~15% of a CPU in probes full
/// time (100,000 calls of 64 KiB a second): the report says it was time-sampled, how
/// much was observed, and its estimate of the whole run is within 4 standard
/// deviations of the truth the workload printed. The deviation is derived as in the
/// agent test above, with the smallest inclusion the budget can give (one 10 ms window
/// per 1 s period: d = 1%), which only widens it: `n S² (1-π)/π`, `π = p·d`, 3.3% of the
/// truth here. The same run without `--budget` says nothing of time sampling (probed
/// full time, as before the budget existed).
#[test]
fn a_budget_on_one_process_probes_it_part_time_and_scales_its_estimate() {
    let (_one, scratch, _) = one_agent_test("pid-budget");
    let steady = compile_workload("steady", &["-O1", "-g", "-fno-omit-frame-pointer"]).unwrap();
    for budget in [true, false] {
        let mut heavy = Workload::start(&steady, &["8", "65536", "1000", "100", "wait"]).unwrap();
        let out = scratch.join(format!("budget-{budget}.json"));
        let pid = heavy.pid.to_string();
        let mut args = vec![
            "--pid",
            pid.as_str(),
            "--format",
            "json",
            "--output",
            out.to_str().unwrap(),
        ];
        if budget {
            args.extend(["--budget", "1%"]);
        }
        let profiler = Profiler::attach(&args).unwrap();
        heavy.go().unwrap();
        let done = heavy
            .stdout
            .wait_for("allocated", Duration::from_secs(60))
            .unwrap();
        heavy.wait(Duration::from_secs(10)).unwrap();
        let finished = profiler.finish(Duration::from_secs(60)).unwrap();
        assert_eq!(finished.code, Some(0), "{}", finished.stderr);
        let json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
        if !budget {
            assert!(json.get("time_sampling").is_none(), "{json}");
            continue;
        }
        let observed = json["time_sampling"]["observed_fraction"].as_f64().unwrap();
        let truth: f64 = done.split_whitespace().nth(2).unwrap().parse().unwrap();
        let calls: f64 = done.split_whitespace().nth(1).unwrap().parse().unwrap();
        let estimate = json["totals"]["estimated_bytes"].as_f64().unwrap();
        // The per-call bound ignores that a window takes or leaves whole runs of
        // calls together: the time-sampling estimator's own interval carries that
        // variance (docs/statistics.md, "Time sampling"), as a 95% interval of 1.96 sd
        // on each side.
        let ci = &json["totals"]["bytes_ci"];
        let (lo, hi) = (ci[0].as_f64().unwrap(), ci[1].as_f64().unwrap());
        let sd = derived_sd(calls, truth / calls).max((hi - lo) / (2.0 * 1.96));
        eprintln!(
            "--pid --budget 1%: observed {observed:.4}, truth {truth:.0}, estimate {estimate:.0} ({:+.1}%), sd {:.1}%, reported interval {}",
            (estimate / truth - 1.0) * 100.0,
            sd / truth * 100.0,
            json["totals"]["bytes_ci"]
        );
        assert!(
            observed > 0.0 && observed < 0.5,
            "probed part time: {observed}"
        );
        assert!(
            (estimate - truth).abs() <= 4.0 * sd,
            "estimate {estimate:.0} vs truth {truth:.0}: more than 4 sd ({sd:.0})"
        );
    }
}

/// The observer effect, corrected (docs/statistics.md, "Pace"): a CPU-bound process
/// nobody paces (`workloads/busy.c`: ~1.1 us of its own work, then a 4 KiB malloc and
/// free, 4 M times) spends ~45% of its probed CPU in traps, so inside its windows it
/// allocates at about half its unprobed pace. Under the default budget (system-wide,
/// `--comm` selecting it), its profile must say so (`pace` well under 1, a large
/// `probe_share`), its uncorrected estimate far below the truth it printed, and the
/// truth within what its pace range allows (the estimates a hit costing 0.85x to 2x
/// its calibrated cost in place would give, widened by 4 sd). Its corrected estimate
/// is mostly within the bound below; a run outside it (seen once in CI: -50%, the
/// range 1.53-6.20 around a factor of 1.69 where 3.4 was needed) is said.
///
/// The bound: 4 derived standard deviations plus the pace's own error. The deviation is
/// derived as above (`n S² (1-π)/π`, `π = p·d` at the budget's floor `d` = 1%: 5.7% of
/// the truth here), widened by `1/√r` because a window sees `r` times fewer calls than
/// an unslowed one would (the variance of a sum over `r·n` calls stood for by `n`). The
/// pace is work per second probed over unprobed, work being CPU time less the traps'
/// measured cost; a relative error `δ` in the cost of a hit moves it by `f/(1-f) · δ`
/// for a trap share `f` (the `probe_share` reported). The calibrated hit and what a hit
/// costs this process in place differ by up to ~10% here (its extra system time per
/// probed call measured 0.73-0.80 us, the calibration 0.85-0.89 us), so `δ` = 15%:
/// with `f` ~0.42, about 11%, ~37-41% in all. The uncorrected estimate must be low by
/// more than 3 deviations (~22%; it is ~42% low, -33% at its highest in 10 runs): the
/// effect is there, and the correction is what brings the estimate within its bound.
#[test]
fn a_cpu_bound_process_is_estimated_at_its_pace_while_probed() {
    let (_one, scratch, _) = one_agent_test("pace");
    let busy = compile_workload("busy", &["-O1", "-g", "-fno-omit-frame-pointer"]).unwrap();
    let out = scratch.join("busy.json");
    let mut profiler = Profiler::spawn(&[
        "--comm",
        "^busy-",
        "--duration",
        "16s",
        "--format",
        "json",
        "--output",
        out.to_str().unwrap(),
    ])
    .unwrap();
    profiler
        .stderr
        .wait_for("allocbpf: profiling every process", Duration::from_secs(60))
        .unwrap();
    let mut workload = Workload::start(&busy, &["4000000", "4096", "1000", "wait"]).unwrap();
    workload.go().unwrap();
    let done = workload
        .stdout
        .wait_for("allocated", Duration::from_secs(14))
        .unwrap();
    workload.wait(Duration::from_secs(10)).unwrap();
    let finished = profiler.finish(Duration::from_secs(60)).unwrap();
    assert_eq!(finished.code, Some(0), "{}", finished.stderr);
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let truth: f64 = done.split_whitespace().nth(2).unwrap().parse().unwrap();
    let calls: f64 = done.split_whitespace().nth(1).unwrap().parse().unwrap();
    let estimate = json["totals"]["estimated_bytes"].as_f64().unwrap();
    let time = &json["time_sampling"];
    let pace = time["pace"].as_f64().expect("the pace was measured");
    let factor = time["pace_factor"].as_f64().unwrap();
    let share = time["probe_share"].as_f64().expect("a large probe share");
    let sd = derived_sd(calls, truth / calls) / truth / pace.sqrt();
    let bound = 4.0 * sd + share / (1.0 - share) * 0.15;
    let error = estimate / truth - 1.0;
    let observed = time["observed_fraction"].as_f64().unwrap();
    let uncorrected = estimate / factor / truth - 1.0;
    let range = &time["pace_factor_range"];
    let (low, high) = (range[0].as_f64().unwrap(), range[1].as_f64().unwrap());
    let ci = &json["totals"]["bytes_ci95"];
    eprintln!(
        "busy: truth {truth:.0}, estimate {estimate:.0} ({:+.1}%), uncorrected {:+.1}%, pace {pace:.3}, factor {factor:.3} ({low:.3}-{high:.3}), probe share {share:.3}, observed {:.4}, bound {:.1}%, 95% CI {ci}",
        error * 100.0,
        uncorrected * 100.0,
        observed,
        bound * 100.0
    );
    // A hit costing 0.85x to 2x its calibrated cost in place moves the factor both
    // ways at this trap share.
    assert!(
        low < factor && factor < high,
        "factor {factor} in its range {low}-{high}"
    );
    assert!(
        share > 0.2,
        "its probes take a large share of its CPU: {share}"
    );
    assert!(pace < 0.8, "it is slowed while probed: pace {pace}");
    assert!(
        uncorrected < -3.0 * sd,
        "uncorrected, the estimate is low by more than 3 sd ({:.1}%): {:+.1}%",
        3.0 * sd * 100.0,
        uncorrected * 100.0
    );
    // What a hit costs this process in place is known only within `IN_PLACE_COST`
    // (its factor range): the truth must lie in the range of estimates those costs
    // give, widened by the sampling's 4 sd. Where the cost is near the calibration (as
    // it mostly is for busy.c) the corrected estimate is within the tighter bound too;
    // a run where it is not is one whose in-place cost moved within the range, said.
    let lowest = estimate / factor * low * (1.0 - 4.0 * sd);
    let highest = estimate / factor * high * (1.0 + 4.0 * sd);
    assert!(
        lowest <= truth && truth <= highest,
        "truth {truth:.0} outside what the pace range allows: {lowest:.0}-{highest:.0}"
    );
    if error.abs() > bound {
        let needed = truth / (estimate / factor);
        eprintln!(
            "busy: the estimate is outside {:.1}% ({:+.1}%): this run's hits cost it more \
             in place than the calibration (factor {needed:.2} needed, {factor:.2} measured)",
            bound * 100.0,
            error * 100.0
        );
    }
}

/// Time sampling keeps sample counts (issue: a program allocating ~65 MB in 3.3 s in
/// small blocks was stored with 0 samples at a 4.5% observed fraction). Inside its
/// windows an image's probes sample `2^k` times denser, `k` the largest with
/// `2^k <= 1/duty` up to 4 (`budget::windows::window_shift`), so a process observed a
/// fraction `d` of the time expects `min(1, d 2^k)` of the samples it would get probed
/// full time: between half and all of them for `d >= 1/16`, `16 d` below.
/// `workloads/steady.c` makes 300,000 calls of 256 bytes in 3 s (100 k calls/s: its
/// traps alone take ~10% of a CPU, so the 1% budget windows libc); probed full time it
/// expects `n p(256) = 300,000 x 4.88e-4 = 146` samples. The bound: half of what the
/// shift promises at the reported observed fraction (the duty changes during the run,
/// and the fraction is a mean), less 4 Poisson standard deviations. Without the shift
/// the expectation is `146 d`, under that bound at small `d` (at the 0.045: 6.6
/// expected, against a floor of 12).
#[test]
fn a_heavy_process_observed_part_time_gets_about_its_full_time_samples() {
    let (_one, scratch, _) = one_agent_test("window-samples");
    let steady = compile_workload("steady", &["-O1", "-g", "-fno-omit-frame-pointer"]).unwrap();
    let out = scratch.join("steady.json");
    // Running before the profiler starts, it has no start-up allowance (only programs
    // exec'd under the profiler do: docs/design.md, "Start-up allowances"), so the
    // budget acts on it at its first check; it waits to allocate until probes are in.
    let mut workload = Workload::start(&steady, &["3", "256", "100", "10", "wait"]).unwrap();
    let mut profiler = Profiler::spawn(&[
        "--comm",
        "^steady",
        "--duration",
        "8s",
        "--format",
        "json",
        "--output",
        out.to_str().unwrap(),
    ])
    .unwrap();
    profiler
        .stderr
        .wait_for("allocbpf: profiling every process", Duration::from_secs(60))
        .unwrap();
    workload.go().unwrap();
    let done = workload
        .stdout
        .wait_for("allocated", Duration::from_secs(20))
        .unwrap();
    workload.wait(Duration::from_secs(10)).unwrap();
    let finished = profiler.finish(Duration::from_secs(60)).unwrap();
    assert_eq!(finished.code, Some(0), "{}", finished.stderr);
    let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let calls: f64 = done.split_whitespace().nth(1).unwrap().parse().unwrap();
    let truth: f64 = done.split_whitespace().nth(2).unwrap().parse().unwrap();
    let samples = json["totals"]["samples"].as_f64().unwrap();
    let observed = json["time_sampling"]["observed_fraction"]
        .as_f64()
        .expect("the budget windowed the heavy process");
    let full_time = calls * sample_probability(256, RATE);
    // What the shift promises at this observed fraction (module docs), halved for the
    // rounding to a power of two and the duty changing during the run.
    let shift = ((1.0 / observed).log2().floor()).clamp(0.0, 4.0);
    let promised = full_time * (observed * shift.exp2()).min(1.0);
    let floor = 0.5 * promised - 4.0 * promised.sqrt();
    let estimate = json["totals"]["estimated_bytes"].as_f64().unwrap();
    eprintln!(
        "steady 256 B x {calls}: observed {observed:.4}, samples {samples} (full time expects {full_time:.0}, the shift promises {promised:.0}, floor {floor:.0}, without it {:.0}), estimate {estimate:.0} of {truth:.0} ({:+.1}%)",
        full_time * observed,
        (estimate / truth - 1.0) * 100.0
    );
    assert!(observed < 0.5, "probed part time: {observed}");
    assert!(
        samples >= floor.max(1.0),
        "{samples} samples, at least {floor:.0} expected"
    );
    let sd = derived_sd(calls, 256.0);
    assert!(
        (estimate - truth).abs() <= 4.0 * sd,
        "estimate {estimate:.0} vs truth {truth:.0}: more than 4 sd ({sd:.0})"
    );
}
