//! Folded stacks (`outer;...;inner estimated_bytes`) and flamegraphs made from them.

use std::io::Write;

use inferno::flamegraph::{self, Options};

use allocbpf_profile::report::Report;

/// The folded lines, one per (pid, function names); the process is the root frame so
/// that several processes do not merge.
pub fn lines(report: &Report) -> Vec<String> {
    report
        .stacks_by_name()
        .into_iter()
        .filter(|(_, _, stats)| stats.estimated_bytes >= 0.5)
        .map(|(pid, names, stats)| {
            // `;` separates frames and the last space separates the value.
            let frames: Vec<String> = std::iter::once(format!("pid {pid}"))
                .chain(names.iter().map(|n| n.replace(';', ":").replace(' ', "_")))
                .collect();
            format!(
                "{} {}",
                frames.join(";"),
                stats.estimated_bytes.round() as u64
            )
        })
        .collect()
}

/// Writes folded stacks.
pub fn write(report: &Report, out: &mut dyn Write) -> std::io::Result<()> {
    for line in lines(report) {
        writeln!(out, "{line}")?;
    }
    Ok(())
}

/// Writes an SVG flamegraph of estimated bytes.
pub fn write_svg(report: &Report, out: &mut dyn Write) -> std::io::Result<()> {
    let lines = lines(report);
    if lines.is_empty() {
        // inferno refuses an empty graph; an empty profile is still a valid answer.
        let note = report.note.as_deref().unwrap_or("no samples");
        return write!(
            out,
            concat!(
                r#"<?xml version="1.0" standalone="no"?>"#,
                r#"<svg version="1.1" width="1200" height="80" xmlns="http://www.w3.org/2000/svg">"#,
                r#"<text x="600" y="40" text-anchor="middle" font-family="Verdana" font-size="16">allocbpf: {}</text></svg>"#,
                "\n"
            ),
            note.replace('&', "&amp;")
                .replace('<', "&lt;")
                .replace('>', "&gt;")
        );
    }
    let mut options = Options::default();
    options.title = format!(
        "allocbpf: estimated bytes allocated (rate {} bytes)",
        report.rate
    );
    options.count_name = "bytes".to_string();
    options.colors = flamegraph::color::Palette::Basic(flamegraph::color::BasicPalette::Mem);
    flamegraph::from_lines(&mut options, lines.iter().map(String::as_str), out)
        .map_err(std::io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_report;

    #[test]
    fn an_empty_report_is_an_empty_valid_graph() {
        let mut report = test_report();
        report.stacks.clear();
        report.note = Some("no profiled process allocated anything".into());
        let mut out = Vec::new();
        write_svg(&report, &mut out).unwrap();
        let svg = String::from_utf8(out).unwrap();
        assert!(svg.starts_with("<?xml") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("no profiled process allocated anything"));
    }

    #[test]
    fn folded_lines_are_outermost_first_with_bytes() {
        let lines = lines(&test_report());
        assert_eq!(
            lines,
            [
                "pid 42;main;site_a;inlined_helper 20480",
                "pid 42;main;site_b 8192"
            ]
        );
    }

    #[test]
    fn svg_is_a_flamegraph() {
        let mut out = Vec::new();
        write_svg(&test_report(), &mut out).unwrap();
        let svg = String::from_utf8(out).unwrap();
        assert!(svg.starts_with("<?xml"));
        assert!(svg.contains("site_a"));
    }
}
