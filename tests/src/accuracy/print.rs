//! Tables of the harness's figures, as `cargo xtask accuracy` prints them.

use std::fmt::Write;

use super::{IntervalQuality, ProbabilityCheck, SiteSummary};

/// The per-site table.
pub fn site_table(rows: &[SiteSummary]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<16} {:<18} {:>13} {:>7} {:>8} {:>11} {:>9} {:>9}",
        "workload", "site", "truth", "samples", "bias/SE", "sd obs/pred", "var ratio", "coverage"
    );
    for r in rows {
        let (ratio, coverage) = if r.is_exact() {
            ("exact".to_string(), "exact".to_string())
        } else {
            (
                format!("{:.3}", r.variance_ratio),
                format!("{:.1}%", 100.0 * r.coverage),
            )
        };
        let _ = writeln!(
            out,
            "{:<16} {:<18} {:>13.0} {:>7.1} {:>+8.2} {:>11} {:>9} {:>9}",
            r.workload,
            r.site,
            r.truth,
            r.mean_samples,
            r.z,
            format!(
                "{:.2}/{:.2}%",
                100.0 * r.sd_observed / r.truth,
                100.0 * r.sd_predicted / r.truth
            ),
            ratio,
            coverage
        );
    }
    out
}

/// The sampling-probability table.
pub fn probability_table(rows: &[ProbabilityCheck]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:>10} {:>10} {:>9} {:>9} {:>9} {:>7}",
        "size", "rate", "observed", "expected", "sd", "z"
    );
    for r in rows {
        let z = if r.sd > 0.0 {
            (r.observed - r.expected) / r.sd
        } else {
            0.0
        };
        let _ = writeln!(
            out,
            "{:>10} {:>10} {:>9.4} {:>9.4} {:>9.5} {:>+7.2}",
            r.size, r.rate, r.observed, r.expected, r.sd, z
        );
    }
    out
}

/// The interval-table quality lines.
pub fn quality_lines(label: &str, q: &IntervalQuality) -> String {
    format!(
        "{label}: {} draws, mean/rate {:.4}, KS distance {:.5} (critical at {}: {:.5}), \
         lag-1..5 autocorrelation {:?}, cross-thread correlation {:+.4} (5 sd = {:.4})\n",
        q.draws,
        q.mean_ratio,
        q.ks_distance,
        q.ks_alpha,
        q.ks_critical,
        q.autocorrelations
            .iter()
            .map(|r| format!("{r:+.4}"))
            .collect::<Vec<_>>(),
        q.cross_thread,
        5.0 / ((q.draws / 2) as f64).sqrt(),
    )
}
