//! What the HTML report costs (`cargo xtask bench --parts report`): pages of 100,
//! 1,000 and 10,000 stacks (each with a timeline of a minute, live tracking, a peak)
//! made through the real path (an aggregate, a report, the exporter), then opened in
//! headless Chromium (Debian's). Per size: the page's bytes, the time to write it, and
//! in the browser the time to first contentful paint (the page's static headings), to
//! the load event and to the first paint of everything the script drew (two animation
//! frames after it drew); medians over the rounds, with ratios to a page of no stack
//! measured in the same run (the floor: Chromium's own start of a page).

use std::time::Instant;

use allocbpf_e2e::{
    bench::median,
    bench::rounds_arg,
    page::{synthetic_report, SYNTHETIC_SECONDS as SECONDS},
    scratch_dir,
};
use allocbpf_harness::browser::Browser;
use anyhow::{Context, Result};

/// One size's figures: bytes, then medians of write, first paint, load and the drawn
/// page's first paint (ms).
struct Figures {
    bytes: usize,
    write_ms: f64,
    paint_ms: f64,
    load_ms: f64,
    drawn_ms: f64,
}

fn measure(browser: &Browser, stacks: usize, rounds: usize) -> Result<Figures> {
    let dir = scratch_dir("report-bench");
    let page = dir.join(format!("stacks-{stacks}.html"));
    let report = synthetic_report(stacks, stacks as u64);
    let (mut writes, mut paints, mut loads, mut drawn) = (vec![], vec![], vec![], vec![]);
    let mut bytes = 0;
    for _ in 0..rounds {
        let started = Instant::now();
        let mut out = Vec::new();
        allocbpf_export::html::write(&report, "report_bench", &mut out)?;
        writes.push(started.elapsed().as_secs_f64() * 1e3);
        bytes = out.len();
        std::fs::write(&page, &out)?;
        browser.open(&page)?;
        // The paints are recorded after the script has drawn: wait for them.
        let waited = Instant::now();
        while browser.script(
            "return performance.getEntriesByName('first-contentful-paint').length > 0 \
             && window.allocbpf.paintedAt !== null",
        )? == serde_json::json!(false)
            && waited.elapsed().as_secs() < 5
        {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let timing = browser.script(
            "const p = performance.getEntriesByName('first-contentful-paint')[0];\
             const n = performance.getEntriesByType('navigation')[0];\
             return [p ? p.startTime : -1, n ? n.loadEventEnd : -1, window.allocbpf.paintedAt]",
        )?;
        let at = |i: usize| timing[i].as_f64().context("a timing");
        paints.push(at(0)?);
        loads.push(at(1)?);
        drawn.push(at(2)?);
    }
    Ok(Figures {
        bytes,
        write_ms: median(&writes),
        paint_ms: median(&paints),
        load_ms: median(&loads),
        drawn_ms: median(&drawn),
    })
}

fn main() -> Result<()> {
    let rounds = rounds_arg(5)?;
    let browser = Browser::start(1400, 1000)?;
    let floor = measure(&browser, 0, rounds)?;
    println!("HTML report: pages of N stacks with a {SECONDS} s timeline in headless Chromium, medians of {rounds} rounds");
    println!(
        "{:>7} {:>10} {:>9} {:>12} {:>9} {:>12} {:>9}",
        "stacks", "page", "write", "first paint", "load", "drawn+paint", "vs empty"
    );
    for stacks in [0, 100, 1_000, 10_000] {
        let f = if stacks == 0 {
            Figures { ..floor }
        } else {
            measure(&browser, stacks, rounds)?
        };
        println!(
            "{stacks:>7} {:>7.0} KiB {:>6.1} ms {:>9.0} ms {:>6.0} ms {:>9.0} ms {:>8.2}x",
            f.bytes as f64 / 1024.0,
            f.write_ms,
            f.paint_ms,
            f.load_ms,
            f.drawn_ms,
            f.drawn_ms / floor.drawn_ms.max(1e-9),
        );
    }
    Ok(())
}
