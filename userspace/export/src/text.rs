//! The default output: a table of the top stacks for people.

use std::io::Write;

use allocbpf_profile::report::Report;
use allocbpf_profile::units::format_bytes;

/// Stacks shown in the table.
pub const TOP_STACKS: usize = 20;
/// Frames shown per stack (innermost first, the allocation site on top).
const FRAMES_SHOWN: usize = 8;

/// What overload did to the profile, if anything: raised intervals, samples that kept
/// their weight without a stack, samples lost outright.
pub fn overload_note(report: &Report) -> Option<String> {
    let c = &report.counters;
    let drops = report.totals.drops;
    if c.pressure_raises == 0 && drops == 0 {
        return None;
    }
    let mut parts = Vec::new();
    if c.pressure_raises > 0 {
        parts.push(format!(
            "the reader fell behind and the sampling interval was doubled {} time(s) until it caught up (each sample is weighed at the interval it was drawn at)",
            c.pressure_raises
        ));
    }
    let kept = drops.saturating_sub(c.lost_unrecorded);
    if kept > 0 {
        parts.push(format!(
            "{kept} sample(s) found the ring full and are counted with their weight under \"{}\", without their stacks",
            allocbpf_profile::frame::LOST_SAMPLES_NAME
        ));
    }
    if c.lost_unrecorded > 0 {
        let share = c.lost_unrecorded as f64 / (report.totals.samples + c.lost_unrecorded) as f64;
        parts.push(format!(
            "{} sample(s) were lost outright: the estimates miss them, about {:.2}% of the samples",
            c.lost_unrecorded,
            share * 100.0
        ));
    }
    Some(parts.join("; "))
}

/// Writes the summary and the top stacks by estimated bytes.
pub fn write(report: &Report, out: &mut dyn Write) -> std::io::Result<()> {
    write_summary(report, out)?;
    write_stacks(report, out)
}

/// The summary as lines: totals with their interval, and every note on what was not
/// seen or not counted (the HTML page's header shows them too).
pub fn summary_lines(report: &Report) -> Vec<String> {
    let mut out = Vec::new();
    // Writing into a vector cannot fail.
    let _ = write_summary(report, &mut out);
    String::from_utf8_lossy(&out)
        .lines()
        .map(str::to_string)
        .collect()
}

/// Writes the summary: totals with their interval, notes, time sampling, in use.
fn write_summary(report: &Report, out: &mut dyn Write) -> std::io::Result<()> {
    let t = &report.totals;
    writeln!(
        out,
        "allocbpf: {:.1}s at a mean sampling interval of {}",
        report.duration.as_secs_f64(),
        format_bytes(report.rate as f64)
    )?;
    let total = report.total_interval();
    let level = report.confidence.percent_label();
    writeln!(
        out,
        "estimated {} ({level}% CI {}) allocated, of exactly {} in {} calls ({} samples, {} dropped, {} without stack)",
        format_bytes(t.estimated_bytes),
        format_interval(total.lo, total.hi),
        format_bytes(t.exact_bytes as f64),
        t.exact_calls,
        t.samples,
        t.drops,
        report.counters.stack_errors,
    )?;
    if let Some(note) = &report.note {
        writeln!(out, "note: {note}")?;
    }
    if let Some(note) = overload_note(report) {
        writeln!(out, "note: {note}")?;
    }
    if let Some(time) = &report.time_sampling {
        writeln!(
            out,
            "time-sampled under the overhead budget: {:.2}% of the interval observed; estimates are for the whole interval; {}, the stacks' cover the observed windows only; exact figures count only calls made while probes were attached",
            time.observed_fraction * 100.0,
            if report.total_interval_includes_time() {
                "the total's CI includes time sampling"
            } else {
                "the total's CI does not include time sampling (too few periods or samples)"
            }
        )?;
        if let Some(effect) = time.observer_effect() {
            writeln!(out, "{effect}")?;
        }
    }
    if let Some(counts) = &report.live {
        writeln!(
            out,
            "in use at the end: estimated {} in {:.0} objects ({} sampled blocks live, {} freed, {} untracked{})",
            format_bytes(t.inuse_bytes),
            t.inuse_objects,
            counts.live_samples,
            counts.freed_samples,
            counts.untracked_samples,
            match counts.expired_samples {
                0 => String::new(),
                n => format!(", {n} no longer followed after their window closed"),
            },
        )?;
    }
    Ok(())
}

/// Writes the table of the top stacks.
fn write_stacks(report: &Report, out: &mut dyn Write) -> std::io::Result<()> {
    let t = &report.totals;
    let level = report.confidence.percent_label();
    let live = report.live.is_some();
    let stacks = report.stacks_by_name();
    if stacks.is_empty() {
        writeln!(out, "no allocation was sampled")?;
        return Ok(());
    }
    writeln!(out)?;
    writeln!(
        out,
        "{:>12} {:>21} {:>6} {:>8} {}{:>10}  stack (allocation site first)",
        "est. bytes",
        format!("{level}% CI"),
        "share",
        "samples",
        if live {
            format!("{:>12} ", "in use")
        } else {
            String::new()
        },
        "pid"
    )?;
    for (pid, names, stats) in stacks.iter().take(TOP_STACKS) {
        let share = if t.estimated_bytes > 0.0 {
            100.0 * stats.estimated_bytes / t.estimated_bytes
        } else {
            0.0
        };
        let interval = report.interval(stats);
        writeln!(
            out,
            "{:>12} {:>21} {:>5.1}% {:>8} {}{:>10}  {}",
            format_bytes(stats.estimated_bytes),
            format_interval(interval.lo, interval.hi),
            share,
            stats.samples,
            if live {
                format!("{:>12} ", format_bytes(stats.inuse_bytes))
            } else {
                String::new()
            },
            pid,
            stack_text(names),
        )?;
    }
    if stacks.len() > TOP_STACKS {
        writeln!(out, "... {} more stacks", stacks.len() - TOP_STACKS)?;
    }
    write_leaks(report, out)
}

/// The leak section: live sampled blocks older than the minimum age, by stack.
fn write_leaks(report: &Report, out: &mut dyn Write) -> std::io::Result<()> {
    let Some(min_age) = report.leaks.as_ref().map(|l| l.min_age) else {
        return Ok(());
    };
    let leaks = report.leaks_by_name();
    writeln!(out)?;
    if leaks.is_empty() {
        writeln!(
            out,
            "no possible leak: no sampled allocation was still live after {:.1}s",
            min_age.as_secs_f64()
        )?;
        return Ok(());
    }
    writeln!(
        out,
        "possible leaks: sampled allocations still live at the end and at least {:.1}s old",
        min_age.as_secs_f64()
    )?;
    writeln!(
        out,
        "{:>12} {:>10} {:>8} {:>15} {:>10}  stack (allocation site first)",
        "est. bytes", "objects", "samples", "age (s)", "pid"
    )?;
    for (pid, names, leak) in leaks.iter().take(TOP_STACKS) {
        writeln!(
            out,
            "{:>12} {:>10.0} {:>8} {:>15} {:>10}  {}",
            format_bytes(leak.estimated_bytes),
            leak.estimated_objects,
            leak.samples,
            format!(
                "{:.1}-{:.1}",
                leak.min_age_ns as f64 / 1e9,
                leak.max_age_ns as f64 / 1e9
            ),
            pid,
            stack_text(names),
        )?;
    }
    Ok(())
}

/// `name` safe for a terminal: symbol names and comms come from other users'
/// binaries, and a control character (an escape sequence that rewrites the screen) or a
/// bidirectional override (text that reads differently than it is) is shown escaped,
/// as `\u{1b}`, never written raw.
fn printable(name: &str) -> std::borrow::Cow<'_, str> {
    let unsafe_char =
        |c: char| c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
    if !name.chars().any(unsafe_char) {
        return name.into();
    }
    name.chars()
        .map(|c| {
            if unsafe_char(c) {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            }
        })
        .collect::<String>()
        .into()
}

/// Innermost frames first, joined with `<`, cut after [`FRAMES_SHOWN`].
fn stack_text(names: &[&str]) -> String {
    let shown: Vec<String> = names
        .iter()
        .rev()
        .take(FRAMES_SHOWN)
        .map(|name| printable(name).into_owned())
        .collect();
    let more = names.len().saturating_sub(FRAMES_SHOWN);
    if more > 0 {
        format!("{} < ({more} more)", shown.join(" < "))
    } else {
        shown.join(" < ")
    }
}

/// `lo-hi` with units, e.g. `1.2 MiB-1.9 MiB`.
fn format_interval(lo: f64, hi: f64) -> String {
    format!("{}-{}", format_bytes(lo), format_bytes(hi))
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::test_report;

    #[test]
    fn hostile_names_are_escaped() {
        assert_eq!(printable("malloc"), "malloc");
        assert_eq!(printable("evil\x1b[2Jname"), "evil\\u{1b}[2Jname");
        assert_eq!(printable("a\u{202e}b"), "a\\u{202e}b");
        assert_eq!(stack_text(&["x\ny"]), "x\\u{a}y");
    }

    #[test]
    fn table_names_sites_and_totals() {
        let mut out = Vec::new();
        write(&test_report(), &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.contains("of exactly 29.3 KiB in 400 calls"), "{text}");
        assert!(text.contains("inlined_helper < site_a < main"), "{text}");
        assert!(text.contains("71.4%"), "{text}");
        assert!(text.contains("95% CI"), "{text}");
        let interval = report_interval_of_first_stack();
        assert!(text.contains(&interval), "{interval} in {text}");
    }

    fn report_interval_of_first_stack() -> String {
        let report = test_report();
        let stacks = report.stacks_by_name();
        let i = report.interval(&stacks[0].2);
        format_interval(i.lo, i.hi)
    }
}
