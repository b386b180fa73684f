//! End to end, as root: what the agent spends itself, in the budget (docs/design.md,
//! "Cost" and "Windows"): a process whose samples cost the agent too much is sampled
//! coarser, and window moves that cost it too much come in a share of the periods; in
//! both, estimates stay unbiased. The tests take the agent tests' lock: they measure
//! the agent's own cost, and must not run beside each other.

use std::{path::Path, time::Duration};

use allocbpf_e2e::{
    agent::{
        metric, one_agent_test, scrape_within, start_filtered, stored_profiles, write_config,
        AgentProcess,
    },
    compile_workload,
    stored::{read_stored, Stored},
    Workload,
};
use allocbpf_profile::estimate::sample_probability;

/// A `workloads/steady.c` run to its end under an agent.
struct SteadyRun {
    pid: u32,
    /// The agent's first line saying what the test waits for.
    line: String,
    /// Its calls and bytes allocated: the truth.
    calls: f64,
    truth: f64,
}

/// Starts `steady` (the compiled workload) with `args` (ending in "wait"), lets it go, waits up to `within`
/// for the agent to say `said`, then for the run's end.
fn run_steady(
    agent: &mut AgentProcess,
    steady: &Path,
    args: &[&str],
    said: &str,
    within: Duration,
) -> SteadyRun {
    let mut workload = Workload::start(steady, args).unwrap();
    workload.go().unwrap();
    let line = agent.stderr.wait_for(said, within).unwrap();
    let done = workload
        .stdout
        .wait_for("allocated", Duration::from_secs(90))
        .unwrap();
    workload.wait(Duration::from_secs(10)).unwrap();
    let field = |i: usize| -> f64 { done.split_whitespace().nth(i).unwrap().parse().unwrap() };
    SteadyRun {
        pid: workload.pid,
        line,
        calls: field(1),
        truth: field(2),
    }
}

/// The estimate and samples of `pid`'s stored profiles, summed.
fn stored_sums(store: &Path, pid: u32) -> (f64, u64) {
    let mine: Vec<Stored> = stored_profiles(store)
        .iter()
        .map(|path| read_stored(path))
        .filter(|stored| stored.pid == pid)
        .collect();
    (
        mine.iter().map(|s| s.estimated_bytes).sum(),
        mine.iter().map(|s| s.samples).sum(),
    )
}

/// The agent's own cost in the budget (docs/design.md, "Cost"): an
/// agent allowed almost no CPU for a process's samples (`agent_cpu_percent`, probes
/// otherwise unbudgeted) raises that process's sampling interval to the largest
/// coarsening, 32x, once its steady per-sample cost is known, and its estimate stays
/// unbiased. The workload (`workloads/steady.c`) makes 4 KiB calls at 10 k/s for 6 s
/// at a 64 KiB rate:
/// - Its samples are far fewer than uncoarsened: were none coarsened, their count would
///   be `n p` (`p = p(4096, 64 KiB)`, ~3,600, sd ~60); coarsened 32x from the first
///   second on they are at most `(1 + 5/32)/6` ~0.19 of that (~0.08 seen: the
///   coarsening comes within the first second). The bound is a third.
/// - Its estimate is within 5 standard deviations of the truth it printed. The sd is
///   derived at the coarsest rate for every call, `n S² (1-p')/p'` with
///   `p' = p(4096, 32 x 64 KiB)` (9% of the truth): the calls sampled at the finer
///   rate before the coarsening only lower the variance, so the bound only widens.
///   An estimator that weighed coarsened samples at the base rate would read ~0.2 of
///   the truth or less, 9 sd below it.
#[test]
fn a_process_whose_samples_cost_the_agent_too_much_is_sampled_coarser_unbiased() {
    let (_one, scratch, store) = one_agent_test("budget-coarsening");
    let steady = compile_workload("steady", &["-O1", "-g", "-fno-omit-frame-pointer"]).unwrap();
    let config = write_config(
        &scratch,
        "comm = \"^steady\"\nrate = \"64KiB\"\nmetrics_address = \"off\"\n[budget]\n\
         cpu_percent = 100\nhost_cpu_percent = 100\nagent_cpu_percent = 0.0001\n",
    );
    let mut agent = start_filtered(&config, &store, "2s", &[], &[]);
    let run = run_steady(
        &mut agent,
        &steady,
        &["6", "4096", "100", "1", "wait"],
        "its samples would cost the agent",
        Duration::from_secs(10),
    );
    let (pid, line) = (run.pid, &run.line);
    let coarsened = format!("pid {pid} (");
    let coarsened_line = |l: &str| l.contains(&coarsened) && l.contains("its samples would cost");
    std::thread::sleep(Duration::from_secs(3));
    let seen = agent.stderr.seen.join("\n");
    let log = seen + &agent.terminate(Duration::from_secs(30)).unwrap();
    let largest = log
        .lines()
        .any(|l| coarsened_line(l) && l.contains("sampling interval x32"));
    assert!(largest, "not coarsened to the largest: {line}\n{log}");
    let (estimate, samples) = stored_sums(&store, pid);
    let (calls, truth) = (run.calls, run.truth);
    let base = 64 << 10;
    let uncoarsened = calls * sample_probability(4096, base);
    let coarsest = sample_probability(4096, 32 * base);
    let sd = (calls * 4096.0 * 4096.0 * (1.0 - coarsest) / coarsest).sqrt();
    eprintln!(
        "coarsened: {samples} samples (uncoarsened ~{uncoarsened:.0}); estimate {estimate:.0} vs truth {truth:.0} ({:+.1}%), sd {:.1}%",
        (estimate / truth - 1.0) * 100.0,
        sd / truth * 100.0
    );
    assert!(
        (samples as f64) < uncoarsened / 3.0,
        "{samples} samples: not coarsened"
    );
    assert!(
        (estimate - truth).abs() <= 5.0 * sd,
        "estimate {estimate:.0} vs truth {truth:.0}: more than 5 sd ({sd:.0})"
    );
}

/// Window moves held to a share of the agent's CPU (docs/statistics.md, "Activation"):
/// an agent allowed almost no CPU for moving probes (`window_moves_cpu_percent`)
/// gives windows to the fewest periods allowed, 1/8, once it has timed a move. The
/// workload (`workloads/steady.c`) makes 4 KiB calls at 100 k/s for 30 s, far over a
/// budget of 1% of a CPU, so libc is probed in windows (at a duty of a few percent):
/// - Its image's probes go in far less often than once a period: at 1/8 of the ~30
///   periods (after the first two, drawn before the first move was timed), the window
///   attaches are about Binomial(28, 1/8) + 2, mean 5.5, sd 1.75; windows in every
///   period would attach at least once a period (gaps of most of a period, longer
///   than `KEEP_ATTACHED_GAP`). The bound, 15, is 5.4 sd above the mean and half the
///   periods.
/// - Its estimate, summed over its profiles, is within 4 standard deviations of the
///   truth it printed. The sd is the time sampling's, derived for a steady process:
///   each period's total is `r P / max(q, d)` or 0, so the total's relative sd is
///   `sqrt((1-q')/(q' K))` for `q' = max(q, d) >= 1/8` and `K` the periods it lived
///   (the byte sampling's is under 1% here, added in quadrature). Its lower side is
///   not binding at K = 30 (1.27 truths); the upper side catches a weight that left
///   the share out (8x the truth).
#[test]
fn window_moves_that_cost_the_agent_too_much_come_in_a_share_of_periods_unbiased() {
    let (_one, scratch, store) = one_agent_test("budget-activation");
    let steady = compile_workload("steady", &["-O1", "-g", "-fno-omit-frame-pointer"]).unwrap();
    let metrics = "127.0.0.1:19482";
    let config = write_config(
        &scratch,
        &format!(
            "comm = \"^steady\"\nrate = \"512KiB\"\nmetrics_address = \"{metrics}\"\n\
             [budget]\ncpu_percent = 1\nwindow_moves_cpu_percent = 0.0001\n"
        ),
    );
    let mut agent = start_filtered(&config, &store, "10s", &[], &[]);
    let run = run_steady(
        &mut agent,
        &steady,
        &["30", "4096", "100", "10", "wait"],
        "% of periods: moving probes",
        Duration::from_secs(20),
    );
    let (line, calls, truth) = (&run.line, run.calls, run.truth);
    let text = scrape_within(metrics, Duration::from_secs(5)).unwrap();
    let attaches = metric(&text, "allocbpf_window_attaches_total").unwrap();
    let share = metric(&text, "allocbpf_budget_periods_with_windows_percent").unwrap();
    std::thread::sleep(Duration::from_secs(3));
    agent.terminate(Duration::from_secs(30)).unwrap();
    let (estimate, _) = stored_sums(&store, run.pid);
    let (q, periods): (f64, f64) = (1.0 / 8.0, 30.0);
    let time_sd = ((1.0 - q) / (q * periods)).sqrt();
    let p = sample_probability(4096, 512 << 10);
    let byte_sd = (calls * 4096.0 * 4096.0 * (1.0 - p) / p).sqrt() / truth;
    let sd = (time_sd * time_sd + byte_sd * byte_sd).sqrt() * truth;
    eprintln!(
        "{line}\nwindow attaches {attaches}, periods with windows {share}%; estimate {estimate:.0} vs truth {truth:.0} ({:+.1}%), sd {:.1}%",
        (estimate / truth - 1.0) * 100.0,
        sd / truth * 100.0
    );
    assert!(share <= 13.0, "windows in {share}% of periods");
    assert!(
        attaches <= 15.0,
        "{attaches} window attaches in ~30 periods"
    );
    assert!(
        (estimate - truth).abs() <= 4.0 * sd,
        "estimate {estimate:.0} vs truth {truth:.0}: more than 4 sd ({sd:.0})"
    );
}
