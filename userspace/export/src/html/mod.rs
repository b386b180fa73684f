//! One self-contained HTML page: a flame graph (and icicle) of estimated bytes
//! allocated or in use, searchable and zoomable, with each frame's interval on hover;
//! a sortable table of stacks and of processes; the timeline of each process's
//! allocation rate and heap in use with their interval bands and the stacks held at
//! the peak; and a header for the run.
//!
//! The page holds its data as JSON ([`data`]) and a script of our own that draws it
//! (docs/design.md, "HTML report", says why no library): it fetches nothing, and its
//! Content-Security-Policy forbids any request, so it opens from a file, offline.
//! Names from the profile (other processes' symbols) are data, never markup.

pub mod data;

use std::io::Write;

use allocbpf_profile::report::Report;

const SCRIPT: &str = include_str!("report.js");
const STYLE: &str = include_str!("report.css");

/// Forbids every request (no `connect-src`, `img-src` beyond inline data, no
/// remote script): the page works offline, and a name that slipped through as markup
/// could not reach out.
const CONTENT_SECURITY_POLICY: &str =
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'";

/// JSON safe inside a `<script>` element: `<`, `>` and `&` escaped as JSON escapes
/// (so no `</script>` can end it), and the two line separators JavaScript once
/// refused in strings.
fn script_safe(json: &str) -> String {
    json.replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026")
        .replace('\u{2028}', "\\u2028")
        .replace('\u{2029}', "\\u2029")
}

fn html_escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Writes the page of `report`; `command`: the command line that made it, shown in
/// the header.
pub fn write(report: &Report, command: &str, out: &mut dyn Write) -> std::io::Result<()> {
    let data = data::page_data(report, command);
    let json = script_safe(&data.to_string());
    write!(
        out,
        r#"<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{CONTENT_SECURITY_POLICY}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>allocbpf: {title}</title>
<style>
{STYLE}</style>
</head>
<body>
<header id="header"></header>
<section id="flame">
<h2>Flame graph of estimated bytes</h2>
<div class="controls">
<button data-view="alloc">allocated</button><button data-view="inuse">in use</button>
<button data-layout="flame">flame</button><button data-layout="icicle">icicle</button>
<button id="reset">all</button>
<input id="search" type="search" placeholder="search functions" aria-label="search functions">
<span id="flame-info" class="muted"></span>
</div>
<div id="flame-graph"></div>
</section>
<section id="timeline">
<h2>Timeline</h2>
<div class="controls"><label>process <select id="timeline-process"></select></label></div>
<div id="timeline-charts"></div>
<div id="peak-stacks"></div>
</section>
<section>
<h2>Stacks</h2>
<div id="stacks"></div>
<h2>Processes</h2>
<div id="processes"></div>
</section>
<div id="tooltip" hidden></div>
<script id="allocbpf-data" type="application/json">{json}</script>
<script>
{SCRIPT}</script>
</body>
</html>
"#,
        title = html_escape(&page_title(report)),
    )
}

/// The processes' names, the largest first, for the page's title.
fn page_title(report: &Report) -> String {
    let mut names: Vec<&str> = report
        .processes
        .values()
        .map(|p| p.name.as_str())
        .filter(|n| !n.is_empty())
        .collect();
    names.dedup();
    match names.len() {
        0 => "heap allocation profile".to_string(),
        1..=3 => names.join(", "),
        n => format!("{} processes", n),
    }
}

#[cfg(test)]
mod tests;
