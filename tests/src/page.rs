//! The HTML report as people see it: opened in headless Chromium (Debian's), clicked
//! and searched as a user would, its console and network read.

use std::path::{Path, PathBuf};

use allocbpf_harness::browser::Browser;
use allocbpf_profile::{
    aggregate::{Aggregate, SampledAllocation, StackKey},
    estimate::Confidence,
    frame::{Frame, FunctionFrame, Functions, Module, Symbolize},
    report::{KernelFigures, Report},
};
use anyhow::{ensure, Context, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::Value;

/// Where the tests keep their screenshots (artifacts of the run).
pub fn artifacts_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target/test-artifacts")
        .to_path_buf()
}

/// The data a page was drawn from (its embedded JSON).
pub fn page_data(page: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(page)?;
    let marker = r#"type="application/json">"#;
    let start = text.find(marker).context("no data in the page")? + marker.len();
    let end = start
        + text[start..]
            .find("</script>")
            .context("unterminated data")?;
    Ok(serde_json::from_str(&text[start..end])?)
}

/// The browser console's errors and warnings since the last read: (level, message).
pub fn console_errors(browser: &Browser) -> Result<Vec<(String, String)>> {
    Ok(browser
        .console()?
        .into_iter()
        .filter(|(level, _)| level == "SEVERE" || level == "WARNING")
        .collect())
}

/// What the browser saw of a page.
#[derive(Debug)]
pub struct Seen {
    /// Flame-graph frames drawn at first.
    pub frames: u64,
    /// Texts of the frames drawn at first.
    pub frame_texts: Vec<String>,
    /// Texts of the stacks table's cells.
    pub table_texts: Vec<String>,
    /// Points of each drawn chart line (allocation rate, then heap in use).
    pub chart_points: Vec<u64>,
    /// Peak markers drawn.
    pub peak_markers: u64,
    /// Texts of the held-at-the-peak table's cells.
    pub peak_texts: Vec<String>,
}

/// Opens `page` in Chromium and checks what every page must do, with `site` a
/// function the profile names: it is named in the flame graph and the table; the
/// flame graph and the timeline are drawn; a click on `site`'s frame zooms on it; a
/// search for it highlights its frames; the console has no error and no request
/// left the page. Saves a screenshot as `screenshot` under [`artifacts_dir`].
pub fn check_in_browser(page: &Path, site: &str, screenshot: &str) -> Result<Seen> {
    let browser = Browser::start(1400, 2400)?;
    browser.open(page)?;
    let seen = look(&browser)?;
    check_drawn(&seen, site)?;
    check_click_zooms(&browser, site)?;
    check_search_highlights(&browser, site)?;
    check_self_contained(&browser)?;
    browser.screenshot(&artifacts_dir().join(screenshot))?;
    Ok(seen)
}

/// The text of every element of the open page that `css` selects.
fn texts(browser: &Browser, css: &str) -> Result<Vec<String>> {
    let found = browser.script(&format!(
        "return [...document.querySelectorAll({css:?})].map(e => e.textContent)"
    ))?;
    Ok(found
        .as_array()
        .map(|a| {
            a.iter()
                .map(|t| t.as_str().unwrap_or("").to_string())
                .collect()
        })
        .unwrap_or_default())
}

/// What the open page draws at first: the flame graph's frames, the stacks table, the
/// timeline's charts and its peak.
fn look(browser: &Browser) -> Result<Seen> {
    let frame_texts = texts(browser, "#flame-graph .frame")?;
    let table_texts = texts(browser, "#stacks td")?;
    let chart_points: Vec<u64> = browser
        .script(
            "return [...document.querySelectorAll('#timeline-charts polyline.estimate')]\
             .map(l => l.getAttribute('points').trim().split(' ').filter(p => p).length)",
        )?
        .as_array()
        .context("no charts")?
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    let peak_markers = browser
        .script("return document.querySelectorAll('#timeline-charts circle.peak').length")?
        .as_u64()
        .unwrap_or(0);
    let peak_texts = texts(browser, "#peak-stacks td")?;
    Ok(Seen {
        frames: frame_texts.len() as u64,
        frame_texts,
        table_texts,
        chart_points,
        peak_markers,
        peak_texts,
    })
}

/// Checks that the flame graph and the timeline are drawn, and `site` named in the
/// graph and the table.
fn check_drawn(seen: &Seen, site: &str) -> Result<()> {
    ensure!(seen.frames > 2, "the flame graph is not drawn: {seen:?}");
    ensure!(
        seen.frame_texts.iter().any(|t| t.contains(site)),
        "{site} is not named in the flame graph: {:?}",
        seen.frame_texts
    );
    ensure!(
        seen.table_texts.iter().any(|t| t.contains(site)),
        "{site} is not named in the table"
    );
    ensure!(
        !seen.chart_points.is_empty() && seen.chart_points[0] >= 2,
        "the timeline is not drawn: {seen:?}"
    );
    Ok(())
}

/// Checks that a click on `site`'s frame zooms on it (it spans the graph), then
/// resets the zoom.
fn check_click_zooms(browser: &Browser, site: &str) -> Result<()> {
    let node = browser.script(&format!(
        "const f = [...document.querySelectorAll('#flame-graph .frame')]\
           .find(f => f.textContent.includes({site:?})); return f ? f.dataset.node : null"
    ))?;
    let node = node
        .as_str()
        .context("no frame of the site to click")?
        .to_string();
    browser.click(&format!("#flame-graph .frame[data-node=\"{node}\"]"))?;
    let zoom = browser.script(&format!(
        "const g = document.getElementById('flame-graph').clientWidth;\
         const f = document.querySelector('#flame-graph .frame[data-node=\"{node}\"]');\
         return [window.allocbpf.state().zoom, f ? f.getBoundingClientRect().width / g : 0]"
    ))?;
    ensure!(
        zoom[0].as_u64().map(|z| z.to_string()) == Some(node.clone()),
        "the click did not zoom: {zoom}"
    );
    ensure!(
        zoom[1].as_f64().unwrap_or(0.0) > 0.95,
        "the zoomed frame does not span the graph: {zoom}"
    );
    browser.click("#reset")?;
    Ok(())
}

/// Checks that a search for `site` highlights its frames, and only frames that match.
fn check_search_highlights(browser: &Browser, site: &str) -> Result<()> {
    browser.type_into("#search", site)?;
    let matches = browser.script(
        "return [...document.querySelectorAll('#flame-graph .frame.match')]\
         .map(f => f.textContent)",
    )?;
    let matches = matches.as_array().context("no matches")?;
    ensure!(!matches.is_empty(), "the search highlighted nothing");
    let info = browser.script("return document.getElementById('flame-info').textContent")?;
    ensure!(
        info.as_str().unwrap_or("").starts_with("matched"),
        "the search says nothing: {info}"
    );
    Ok(())
}

/// Checks that nothing left the page, and that the console holds no error.
fn check_self_contained(browser: &Browser) -> Result<()> {
    let requests =
        browser.script("return performance.getEntriesByType('resource').map(r => r.name)")?;
    ensure!(
        requests.as_array().is_some_and(|r| r.is_empty()),
        "requests left the page: {requests}"
    );
    let errors = console_errors(browser)?;
    ensure!(errors.is_empty(), "console errors: {errors:?}");
    Ok(())
}

/// A synthetic report's mean sampling interval.
const RATE: u64 = 512 * 1024;
/// The span of a synthetic report's samples.
pub const SYNTHETIC_SECONDS: u64 = 60;

/// Names a frame id `fn_<id>` (a symbolizer of synthetic frames).
struct Synthetic;

impl Symbolize for Synthetic {
    fn prepare(&mut self, _: &mut dyn Iterator<Item = &Frame>) {}
    fn functions(&self, frame: &Frame) -> Functions {
        let id = match frame {
            Frame::Unknown(id) => *id,
            _ => 0,
        };
        vec![FunctionFrame {
            name: format!("namespace::module_{}::function_{id}", id % 37),
            file: Some(format!("src/module_{}.cc", id % 37)),
            line: Some((id % 900) as u32 + 1),
            shown: None,
        }]
        .into()
    }
    fn symbolizes(&self) -> bool {
        true
    }
    fn modules(&self) -> Vec<Module> {
        Vec::new()
    }
}

/// A report of `stacks` stacks of one process: stacks share prefixes (a tree, as real
/// programs' do), each sampled a few times over a minute, half its blocks freed.
pub fn synthetic_report(stacks: usize, seed: u64) -> Report {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut aggregate = Aggregate::with_live_tracking();
    aggregate.record_timeline();
    let mut id = 0u64;
    let origin = 1_000_000_000u64;
    for stack in 0..stacks {
        let depth = rng.random_range(8..30usize);
        // Outer frames from a small set (shared prefixes), inner ones of their own.
        let frames: Vec<Frame> = (0..depth)
            .map(|level| match level {
                l if l >= depth - 3 => Frame::Unknown(1000 + (stack * 3 + l) as u64),
                l => Frame::Unknown((l * 7 + rng.random_range(0..3usize)) as u64),
            })
            .rev()
            .collect();
        let key = StackKey { pid: 4242, frames };
        for _ in 0..rng.random_range(1..5) {
            id += 1;
            let size = rng.random_range(16..65536u64);
            aggregate.add(
                key.clone(),
                &SampledAllocation {
                    sample_id: id,
                    size,
                    offset: size / 2,
                    rate: RATE,
                    certain: false,
                    timestamp_ns: origin + rng.random_range(0..SYNTHETIC_SECONDS * 1_000_000_000),
                    window: None,
                },
            );
            if rng.random_bool(0.5) {
                aggregate.freed(id);
            }
        }
    }
    let end = origin + SYNTHETIC_SECONDS * 1_000_000_000;
    aggregate.finish(end, None);
    let kernel = KernelFigures {
        duration: std::time::Duration::from_secs(SYNTHETIC_SECONDS),
        ..KernelFigures::default()
    };
    let mut report = Report::build(
        &aggregate,
        &mut Synthetic,
        RATE,
        Confidence::DEFAULT,
        kernel,
        None,
    );
    let timeline = aggregate.timeline(end).expect("recorded");
    report.add_timeline(4242, timeline, origin, &aggregate, &mut Synthetic);
    report
}
