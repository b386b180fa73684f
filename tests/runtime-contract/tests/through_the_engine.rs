//! A runtime defined only in this crate (`FakeLang`) runs through the engine (with the
//! fake kernel) and every exporter: its map entry is written and released, its
//! captures become its frames, its label is on the profile, and the reports name its
//! frames as its locations say, with no edit anywhere else.

use std::{
    process::Command,
    sync::OnceLock,
    time::{Duration, Instant},
};

use allocbpf_collect::{
    engine::Collector,
    kernel::fake::FakeLoader,
    options::{CollectOptions, RuntimeList, Scope, UnwindMode},
};
use allocbpf_export::{pprof, Format};
use allocbpf_probe::{
    events::{Event, RawSample, RuntimeCapture},
    sampler::monotonic_now_ns,
};
use allocbpf_profile::report::Report;
use allocbpf_runtime::Runtime;
use allocbpf_runtime_contract::{
    capture_of, entry_of, shown_name, FakeLang, CAPTURE_FLAG, MAP, NAME, VERSION_LABEL,
};

/// The process the fake runtime claims: a child that sleeps until killed (its pid is
/// handed to the runtimes' maker, which takes no arguments).
static TARGET: OnceLock<u32> = OnceLock::new();

/// The runtimes of this test's collections: the fake one, claiming the target.
fn runtimes() -> Vec<Box<dyn Runtime>> {
    let mut fake = FakeLang::default();
    fake.claims.extend(TARGET.get());
    vec![Box::new(fake)]
}

/// A sample of `pid` with the fake runtime's capture of `functions`.
fn sample(pid: u32, id: u64, functions: &[u32]) -> Event {
    Event::Sample(RawSample {
        sample_id: id,
        pid,
        tid: pid,
        timestamp_ns: monotonic_now_ns(),
        size: 4096,
        rate: 4096,
        next_interval: 4096,
        stack: vec![0x1000, 0x2000],
        capture: Some(RuntimeCapture {
            flag: CAPTURE_FLAG,
            bytes: capture_of(functions).into(),
        }),
        ..RawSample::default()
    })
}

#[test]
fn a_runtime_of_its_own_crate_runs_through_the_engine_and_the_exporters() {
    let mut child = Command::new("sleep").arg("60").spawn().unwrap();
    let me = child.id();
    TARGET.set(me).unwrap();
    // The loader maps libc's text after its first pages: the engine needs an allocator.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !std::fs::read_to_string(format!("/proc/{me}/maps")).is_ok_and(|m| m.contains("libc"))
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(5));
    }
    let fake = FakeLoader::new(false);
    let options = CollectOptions {
        rate: 4096,
        unwind: UnwindMode::Fp,
        runtimes: RuntimeList(runtimes),
        ..CollectOptions::default()
    };
    let mut collector = Collector::start(&fake, options, Scope::Process(me)).unwrap();
    assert_eq!(
        fake.state
            .borrow()
            .entries
            .get(MAP)
            .and_then(|m| m.get(&me)),
        Some(&entry_of(me)),
        "the runtime's own map entry is written through the generic interface"
    );

    // Two stacks: 3 samples in fn_1 < fn_2, 1 in fn_3 < fn_2.
    fake.send((0..3).map(|id| sample(me, id, &[1, 2])));
    fake.send([sample(me, 3, &[3, 2])]);
    let profiles = collector.cut();
    let profile = (profiles.iter())
        .find(|p| p.info.pid == me)
        .expect("this process's profile");
    let labels = profile.info.labels("host");
    assert!(
        labels.contains(&("runtime", NAME.to_string())),
        "{labels:?}"
    );
    assert!(
        labels.contains(&(VERSION_LABEL.0, VERSION_LABEL.1.to_string())),
        "{labels:?}"
    );
    let report = &profile.report;
    assert_eq!(report.totals.samples, 4);
    check_frames(report);
    check_exporters(report);
    check_pprof(report);

    // Its exit releases the process at the next cut: its entry goes with it.
    child.kill().unwrap();
    child.wait().unwrap();
    fake.send([Event::Exit { pid: me }]);
    let _ = collector.cut();
    assert!(
        fake.state
            .borrow()
            .entries
            .get(MAP)
            .is_none_or(|m| !m.contains_key(&me)),
        "the runtime's entry is forgotten when its process leaves"
    );
}

/// The report's stacks name the runtime's frames as their locations say.
fn check_frames(report: &Report) {
    let shown: Vec<Vec<String>> = (report.stacks.iter())
        .map(|stack| {
            (stack.locations.iter())
                .flat_map(|location| location.functions.iter())
                .map(|function| function.shown_name().to_string())
                .collect()
        })
        .collect();
    assert!(
        shown.contains(&vec![shown_name(1), shown_name(2)]),
        "{shown:?}"
    );
    assert!(
        shown.contains(&vec![shown_name(3), shown_name(2)]),
        "{shown:?}"
    );
}

/// Every exporter that shows names names the runtime's frames.
fn check_exporters(report: &Report) {
    for format in [
        Format::Text,
        Format::Json,
        Format::Folded,
        Format::Svg,
        Format::Html,
    ] {
        let mut out = Vec::new();
        allocbpf_export::write(report, format, "contract test", &mut out).unwrap();
        let text = String::from_utf8_lossy(&out);
        for id in [1, 2, 3] {
            let name = match format {
                // A flamegraph and a page escape what they draw; the name is enough.
                Format::Svg | Format::Html => format!("fn_{id}"),
                // Folded stacks are separated by spaces: names have none.
                Format::Folded => shown_name(id).replace(' ', "_"),
                _ => shown_name(id),
            };
            assert!(text.contains(&name), "{format:?} lacks {name}:\n{text}");
        }
    }
}

/// pprof carries the runtime's function, file and line apart.
fn check_pprof(report: &Report) {
    let mut gzipped = Vec::new();
    allocbpf_export::write(report, Format::Pprof, "", &mut gzipped).unwrap();
    let read = pprof::read(&pprof::decode_gzipped(&gzipped[..], 1 << 24).unwrap());
    let functions: Vec<(String, Option<String>, Option<u32>)> = (read.samples.iter())
        .flat_map(|sample| sample.locations.iter().flatten())
        .map(|f| (f.name.clone(), f.file.clone(), f.line))
        .collect();
    for id in [1, 2, 3] {
        let expected = (format!("fn_{id}"), Some("prog.fake".to_string()), Some(id));
        assert!(
            functions.contains(&expected),
            "pprof lacks {expected:?}: {functions:?}"
        );
    }
}
