use super::*;
use crate::test_report;

fn page(report: &Report) -> String {
    let mut out = Vec::new();
    write(report, "allocbpf --pid 42 --format html", &mut out).unwrap();
    String::from_utf8(out).unwrap()
}

/// The data the page draws from, parsed back out of it.
fn data_of(page: &str) -> serde_json::Value {
    let start = page.find(r#"type="application/json">"#).unwrap() + 24;
    let end = start + page[start..].find("</script>").unwrap();
    serde_json::from_str(&page[start..end]).unwrap()
}

/// A sample of 4096 bytes at a mean interval of 4096 bytes.
fn sample(sample_id: u64, timestamp_ns: u64) -> allocbpf_profile::aggregate::SampledAllocation {
    allocbpf_profile::aggregate::SampledAllocation {
        sample_id,
        size: 4096,
        offset: 100,
        rate: 4096,
        certain: false,
        timestamp_ns,
        window: None,
    }
}

/// Names frame 1 `grow_cache`, any other `other`.
struct Named;
impl allocbpf_profile::frame::Symbolize for Named {
    fn prepare(&mut self, _: &mut dyn Iterator<Item = &allocbpf_profile::frame::Frame>) {}
    fn symbolizes(&self) -> bool {
        true
    }
    fn modules(&self) -> Vec<allocbpf_profile::frame::Module> {
        Vec::new()
    }
    fn functions(
        &self,
        frame: &allocbpf_profile::frame::Frame,
    ) -> allocbpf_profile::frame::Functions {
        let name = match frame {
            allocbpf_profile::frame::Frame::Unknown(1) => "grow_cache",
            _ => "other",
        };
        vec![allocbpf_profile::frame::FunctionFrame {
            name: name.into(),
            file: None,
            line: None,
            shown: None,
        }]
        .into()
    }
}

#[test]
fn the_page_is_one_document_that_fetches_nothing() {
    let page = page(&test_report());
    assert!(page.starts_with("<!DOCTYPE html>"));
    assert!(page.contains("Content-Security-Policy"));
    // Only the SVG namespace (a name, never fetched) looks like an address.
    let addresses = page.matches("http://").count() + page.matches("https://").count();
    assert_eq!(
        addresses,
        page.matches("http://www.w3.org/2000/svg").count()
    );
    for fetching in ["<link", " src=", "import(", "fetch(", "XMLHttpRequest"] {
        assert!(!page.contains(fetching), "{fetching}");
    }
}

#[test]
fn the_data_names_sites_with_their_intervals() {
    let report = test_report();
    let data = data_of(&page(&report));
    let names: Vec<&str> = data["names"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    for site in ["site_a", "site_b", "inlined_helper", "main"] {
        assert!(names.contains(&site), "{site} in {names:?}");
    }
    let stacks = data["stacks"].as_array().unwrap();
    assert_eq!(stacks.len(), 2);
    let first = &stacks[0];
    assert_eq!(first["bytes"], 20480.0);
    let ci = first["ci"].as_array().unwrap();
    assert!(ci[0].as_f64().unwrap() <= 20480.0 && ci[1].as_f64().unwrap() >= 20480.0);
    // The flame graph's root holds everything; every node's parent comes before it.
    let alloc = &data["tree"];
    assert_eq!(alloc["value"][0], 28672.0);
    for (i, parent) in alloc["parent"].as_array().unwrap().iter().enumerate() {
        let parent = parent.as_i64().unwrap();
        assert!(parent < i as i64);
    }
    assert_eq!(data["command"], "allocbpf --pid 42 --format html");
    assert!(
        data["tree"]["inuse"].is_null(),
        "no in-use view without --live"
    );
    // A stack names its leaf node; its path up to the process node is its frames.
    let leaf = first["node"].as_u64().unwrap() as usize;
    let name_of = |node: usize| names[alloc["name"][node].as_u64().unwrap() as usize];
    assert_eq!(name_of(leaf), "inlined_helper");
    let parent = alloc["parent"][leaf].as_u64().unwrap() as usize;
    assert_eq!(name_of(parent), "site_a");
}

/// Names are another process's symbols: hostile. None can end the data's script
/// element or become markup.
#[test]
fn hostile_names_stay_data() {
    let mut report = test_report();
    let evil = "</script><script>alert(1)</script><img src=x onerror=alert(2)>\u{2028}";
    report.stacks[0].locations[0].functions = vec![allocbpf_profile::frame::FunctionFrame {
        name: evil.into(),
        file: None,
        line: None,
        shown: None,
    }]
    .into();
    report.processes.insert(
        42,
        allocbpf_profile::report::ProcessSummary {
            name: "<b>x</b>".into(),
            ..Default::default()
        },
    );
    let page = page(&report);
    assert_eq!(page.matches("</script>").count(), 2, "only the page's own");
    assert!(!page.contains("<img"));
    assert!(!page.contains("<b>x</b>"));
    let data = data_of(&page);
    assert!(data["names"]
        .as_array()
        .unwrap()
        .iter()
        .any(|n| n.as_str() == Some(evil)));
}

/// A timeline recorded by an aggregate reaches the page with its points, bands and
/// the stacks held at the peak.
#[test]
fn the_timeline_and_its_peak_reach_the_page() {
    use allocbpf_profile::aggregate::{Aggregate, StackKey};
    use allocbpf_profile::frame::Frame;
    let mut aggregate = Aggregate::with_live_tracking();
    aggregate.record_timeline();
    let key = StackKey {
        pid: 42,
        frames: vec![Frame::Unknown(1)],
    };
    for i in 0..10u64 {
        let sample = sample(i, 1_000_000_000 + i * 100_000_000);
        aggregate.add(key.clone(), &sample);
    }
    for i in 0..5u64 {
        aggregate.freed_at(i, 2_100_000_000 + i);
    }
    let mut report = test_report();
    report.live = Some(Default::default());
    let timeline = aggregate.timeline(2_500_000_000).unwrap();
    report.add_timeline(42, timeline, 1_000_000_000, &aggregate, &mut Named);
    let data = data_of(&page(&report));
    let timeline = &data["timelines"][0];
    assert_eq!(timeline["pid"], 42);
    assert!(timeline["live"].as_bool().unwrap());
    let points = timeline["points"].as_array().unwrap();
    assert!(points.len() >= 10, "{points:?}");
    let first = points[0].as_array().unwrap();
    assert_eq!(first[0], 0.0, "times are seconds since the report's start");
    assert!(first[3].as_f64().unwrap() <= first[2].as_f64().unwrap());
    assert!(first[4].as_f64().unwrap() >= first[2].as_f64().unwrap());
    let peak = &timeline["peak"];
    let frames = peak["stacks"][0]["frames"].as_array().unwrap();
    let names = data["names"].as_array().unwrap();
    assert_eq!(names[frames[0].as_u64().unwrap() as usize], "grow_cache");
    let high = timeline["high"].as_array().unwrap();
    assert!((high[0].as_f64().unwrap() - 0.9).abs() < 1e-9, "{high:?}");
    assert_eq!(peak["bytes"], high[1]);
}

/// Observed part time (an overhead budget): the timeline's points have no interval of
/// their own and the heap in use is not drawn (docs/statistics.md, "Timeline").
#[test]
fn a_time_sampled_timeline_has_no_bands_and_no_heap() {
    use allocbpf_profile::aggregate::{Aggregate, StackKey};
    use allocbpf_profile::frame::Frame;
    let mut aggregate = Aggregate::with_live_tracking();
    aggregate.record_timeline();
    let key = StackKey {
        pid: 42,
        frames: vec![Frame::Unknown(1)],
    };
    aggregate.add(key, &sample(1, 1_000_000_000));
    let mut report = test_report();
    report.live = Some(Default::default());
    report.time_sampling = Some(crate::quarter_observed());
    let timeline = aggregate.timeline(1_100_000_000).unwrap();
    report.add_timeline(42, timeline, 1_000_000_000, &aggregate, &mut Named);
    let data = data_of(&page(&report));
    let timeline = &data["timelines"][0];
    assert_eq!(timeline["time_sampled"], true);
    assert_eq!(timeline["live"], false);
    assert!(timeline["peak"].is_null());
    let point = timeline["points"][0].as_array().unwrap();
    assert!(point[2].as_f64().unwrap() > 0.0);
    assert!(point[3].is_null() && point[4].is_null(), "{point:?}");
}
