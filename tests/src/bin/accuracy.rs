//! `cargo xtask accuracy`: runs the accuracy harness and prints its figures.
//! With `--plots DIR` it also draws the PNG figures used in docs/statistics.md.

use std::path::PathBuf;

use allocbpf_e2e::accuracy::{
    self,
    kernel::{self, KernelCoverage},
    plot::{self, RatioPanel},
    print, workloads, HEAPPROFD_SIZES, MEMORYLESS_TRIALS, TRIALS,
};
use anyhow::Result;

/// Expected-sample counts of the coverage curve.
const LAMBDAS: [f64; 12] = [
    1.0, 2.0, 3.0, 5.0, 8.0, 12.0, 20.0, 30.0, 50.0, 80.0, 120.0, 200.0,
];

fn main() -> Result<()> {
    let plots: Option<PathBuf> = std::env::args()
        .skip_while(|a| a != "--plots")
        .nth(1)
        .map(PathBuf::from);
    let started = std::time::Instant::now();

    let mut rows = Vec::new();
    for (i, workload) in workloads::all().iter().enumerate() {
        println!("{:<16} {}", workload.name, workload.what);
        rows.extend(accuracy::run_workload(
            workload,
            TRIALS,
            1_000_000 * (i as u64 + 1),
        ));
    }
    println!(
        "scaled rates     64 B-64 KiB at 64 KiB, countdowns switching between R/16 and 32R (ring pressure, windows)"
    );
    rows.push(accuracy::scaled_rates(TRIALS, 26));
    println!("\n{TRIALS} simulated trials per workload at R = 64 KiB (bias/SE: mean minus truth in standard errors):");
    print!("{}", print::site_table(&rows));

    println!("\nP(sampled) at R = 512 KiB, 20,000 allocations per size (certain threshold R ln 100 = 2.30 MiB):");
    print!(
        "{}",
        print::probability_table(&accuracy::sampling_probabilities(
            512 << 10,
            &HEAPPROFD_SIZES,
            20_000,
            3
        ))
    );

    let (single, split) = accuracy::memorylessness(MEMORYLESS_TRIALS, 4);
    println!("\nMemorylessness at R = 512 KiB, {MEMORYLESS_TRIALS} trials each:");
    print!("{}", print::site_table(&[single, split]));

    println!();
    print!(
        "{}",
        print::quality_lines(
            "interval picks (simulated probe, table refreshed every 65,536 draws)",
            &accuracy::interval_quality(512 << 10, 500_000, 5)
        )
    );

    let curve = accuracy::coverage_by_samples(&LAMBDAS, 4_000, 6);
    println!("\nCoverage of the 95% interval by expected samples (4,000 trials each):");
    for (lambda, coverage) in &curve {
        println!("  {lambda:>5} samples: {:.1}%", 100.0 * coverage);
    }
    println!("\nharness time {:.1?}", started.elapsed());

    let kernel = if std::env::args().any(|a| a == "--kernel") {
        let run = kernel::run_coverage_workload()?;
        print_kernel(&run);
        Some(run)
    } else {
        println!("(run with --kernel, as root, for the end-to-end coverage run)");
        None
    };

    if let Some(dir) = plots {
        std::fs::create_dir_all(&dir)?;
        plot::register_font()?;
        let pick = |w: &str, s: &str| rows.iter().find(|r| r.workload == w && r.site == s);
        let mut panels: Vec<RatioPanel> = [("periodic", "periodic_64B"), ("mix", "realloc_chain")]
            .iter()
            .filter_map(|(w, s)| pick(w, s))
            .map(|site| RatioPanel::from_trials(site, 80))
            .collect();
        if let Some(run) = &kernel {
            panels.push(kernel_panel(run, 80));
        }
        let estimates = dir.join("estimates-with-intervals.png");
        plot::estimates_with_intervals(&estimates, &panels)?;
        let coverage = dir.join("interval-coverage.png");
        plot::coverage_curve(&coverage, &curve, 4_000)?;
        println!("wrote {} and {}", estimates.display(), coverage.display());
    }
    Ok(())
}

fn print_kernel(run: &KernelCoverage) {
    println!(
        "\nEnd to end through the kernel (workloads/coverage.c, R = 64 KiB, two threads):\n  \
         {} of {} sites analysed, {} samples, {} dropped\n  \
         95% interval coverage {:.2}%; standardized error mean {:+.3}, variance {:.3}",
        run.results.len(),
        run.sites,
        run.samples,
        run.drops,
        100.0 * run.coverage,
        run.z_mean,
        run.z_variance
    );
    for (band, observed, expected, sd) in &run.probability_bands {
        println!(
            "  P(sampled) {band:>10}: {observed:.0} samples, expected {expected:.0} (z {:+.2})",
            (observed - expected) / sd
        );
    }
    print!(
        "{}",
        print::quality_lines("  kernel interval picks", &run.intervals)
    );
}

/// The first `shown` sites of the kernel run, smallest blocks first.
fn kernel_panel(run: &KernelCoverage, shown: usize) -> RatioPanel {
    let mut sites = run.results.clone();
    sites.sort_by_key(|r| r.size);
    let step = (sites.len() / shown).max(1);
    RatioPanel {
        title: "kernel run, sites by block size".into(),
        points: sites
            .iter()
            .step_by(step)
            .take(shown)
            .map(|r| {
                (
                    r.estimate / r.truth,
                    r.interval.0 / r.truth,
                    r.interval.1 / r.truth,
                )
            })
            .collect(),
        x_label: "site (1 KiB to 192 KiB blocks)",
    }
}
