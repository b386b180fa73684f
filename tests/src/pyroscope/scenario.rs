//! The helpers the tests of `tests/pyroscope.rs` share: the agent's config, the
//! `leaks.c` workload, the labels a process's series carry, and the assertions built
//! on them and on the comparison with the store (`Pyroscope::check_matches_store`...).

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use allocbpf_export::pprof;

use super::{profile_type_id, PushSeries, Pyroscope};
use crate::{
    agent::write_config,
    compile_workload, gnu_build_id,
    stores::{default_service_name, sum_stored, truth_bound, StoredProfile},
    Workload,
};

/// The profile types of a heap profile with live tracking, pushed as pprof.
pub const MEMORY_TYPES: [&str; 4] = [
    "memory:alloc_objects:count:space:bytes",
    "memory:alloc_space:bytes:space:bytes",
    "memory:inuse_objects:count:space:bytes",
    "memory:inuse_space:bytes:space:bytes",
];

/// The agent's config for these tests: the workloads only (`agentwl`, `leaks`),
/// metrics on `metrics_port`, `push` (the `[push]` lines that say where to), then
/// `extra`.
pub fn pyroscope_config(scratch: &Path, metrics_port: u16, push: &str, extra: &str) -> PathBuf {
    write_config(
        scratch,
        &format!(
            "comm = \"^(agentwl|leaks)\"\nmetrics_address = \"127.0.0.1:{metrics_port}\"\n[push]\n\
             {push}\ntimeout = \"5s\"\n{extra}"
        ),
    )
}

/// `url = "ENDPOINT"`: Pyroscope's push API, the default protocol.
pub fn push_to(pyroscope: &Pyroscope) -> String {
    format!("url = \"{}\"", pyroscope.endpoint())
}

/// `workloads/leaks.c`, which keeps 20 MiB and more in use: the agent's workload
/// frees each block at once, so its in-use values are zero at almost every cut, and
/// Pyroscope keeps no series of a type whose values are all zero.
pub fn start_leaks() -> Workload {
    let binary = compile_workload("leaks", &["-O1", "-g", "-fno-omit-frame-pointer"]).unwrap();
    Workload::start(&binary, &[]).unwrap()
}

/// Lets `leaks.c` run once the agent has seen it, to its end.
pub fn run_leaks(leaks: &mut Workload) {
    std::thread::sleep(Duration::from_secs(2));
    leaks.go().unwrap();
    leaks.wait(Duration::from_secs(30)).unwrap();
}

/// The profile types `stored` should show up under in Pyroscope: those of the
/// sample types with a value other than zero (`name` as in [`profile_type_id`]),
/// sorted.
pub fn stored_types(stored: &[StoredProfile], name: &str) -> Vec<String> {
    sum_stored(stored)
        .stacks
        .keys()
        .map(|sample_type| profile_type_id(name, sample_type))
        .collect()
}

/// The selector of each process's series: its default service name (read while it
/// runs) and its pid, as the agent labels them.
pub fn by_pid(pids: &[u32]) -> impl Fn(u32) -> String {
    let services: BTreeMap<u32, String> = pids
        .iter()
        .map(|&pid| (pid, default_service_name(pid)))
        .collect();
    move |pid| {
        format!(
            "{{service_name=\"{}\", pid=\"{pid}\"}}",
            services.get(&pid).map_or("?", String::as_str)
        )
    }
}

/// The labels the agent gives a running process's profiles, read from `/proc`:
/// its service name and hostname, pid, comm, exe, exe_build_id and cgroup (v2 path).
pub fn process_labels(pid: u32) -> BTreeMap<&'static str, String> {
    let proc = |file: &str| std::fs::read_to_string(format!("/proc/{pid}/{file}")).unwrap();
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap();
    let exe = exe.to_str().unwrap();
    BTreeMap::from([
        ("service_name", default_service_name(pid)),
        (
            "hostname",
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .unwrap()
                .trim()
                .to_string(),
        ),
        ("pid", pid.to_string()),
        ("comm", proc("comm").trim_end().to_string()),
        ("exe", exe.strip_suffix(DELETED).unwrap_or(exe).to_string()),
        (
            "exe_build_id",
            gnu_build_id(Path::new(&format!("/proc/{pid}/exe"))),
        ),
        (
            "cgroup",
            proc("cgroup")
                .lines()
                .find_map(|line| line.strip_prefix("0::"))
                .unwrap_or_default()
                .to_string(),
        ),
    ])
}

/// What the kernel appends to `/proc/PID/exe` once the file was replaced or removed
/// (another test run compiling the same workload into `target/e2e/bin` does that):
/// the agent's `exe` label then says so.
pub const DELETED: &str = " (deleted)";

/// The labels Pyroscope adds to every series of a profile type.
pub const SERVER_LABELS: [&str; 6] = [
    "__period_type__",
    "__period_unit__",
    "__profile_type__",
    "__service_name__",
    "__type__",
    "__unit__",
];

/// Every series of `selector` carries `labels`, `__name__=name`, and the labels the
/// server adds (`SERVER_LABELS`, and `extra`), and no other: not `observed_fraction`
/// (it changes every interval: a series each), not `__delta__` (the server reads and
/// removes it), none of the labels of the samples (`pid`, `samples`, `bytes_ci95_*`,
/// `ci_*`: a series per stack and interval); one series per profile type, which are
/// `types`.
pub fn assert_series_labels(
    pyroscope: &Pyroscope,
    (selector, name): (&str, &str),
    labels: &BTreeMap<&str, String>,
    extra: &[&str],
    types: &[String],
    (start, end): (u64, u64),
) {
    let series = pyroscope.series(&[selector], start, end, None).unwrap();
    let mut names: Vec<&str> = labels.keys().copied().collect();
    names.extend(SERVER_LABELS);
    names.extend(extra);
    names.push("__name__");
    names.sort_unstable();
    for set in &series {
        for (label, value) in labels {
            let got = set
                .get(*label)
                .map(|v| v.strip_suffix(DELETED).unwrap_or(v));
            assert_eq!(got, Some(value.as_str()), "{label} in {set:?}");
        }
        assert_eq!(
            set.get("__name__").map(String::as_str),
            Some(name),
            "{set:?}"
        );
        let got: Vec<&str> = set.keys().map(String::as_str).collect();
        assert_eq!(got, names, "label names of {set:?}");
    }
    let mut seen: Vec<&str> = series
        .iter()
        .map(|set| set["__profile_type__"].as_str())
        .collect();
    seen.sort_unstable();
    assert_eq!(seen, types, "{selector}: {series:?}");
}

/// Pyroscope's view matches the store, or the test fails with its log's tail.
pub fn assert_matches_store(
    pyroscope: &Pyroscope,
    stored: &[StoredProfile],
    name: &str,
    selector: &dyn Fn(u32) -> String,
    tenant: Option<&str>,
    agent_log: &str,
) -> usize {
    pyroscope
        .wait_matches_store(stored, name, selector, tenant, Duration::from_secs(60))
        .unwrap_or_else(|error| {
            panic!(
                "{error:#}\nagent log: {agent_log}\npyroscope log: {}",
                pyroscope.log_tail(30)
            )
        })
}

/// Pyroscope's figures agree with the workloads' truth (`pids[i]` allocates blocks of
/// `sizes[i]` bytes at `agentwl_alloc_site`, profiled at `--rate 64KiB`): bytes per
/// object at the site is its block size, and the estimate is within the derived bound
/// ([`truth_bound`]) of the probe's exact count.
pub fn assert_sites_match_truth(
    pyroscope: &Pyroscope,
    stored: &[StoredProfile],
    pids: &[u32],
    sizes: [f64; 2],
    selector: &dyn Fn(u32) -> String,
    (start, end): (u64, u64),
) {
    for (pid, size) in pids.iter().zip(sizes) {
        let merged = |sample_type: &str| {
            pyroscope
                .select_merge_profile(
                    &profile_type_id("memory", sample_type),
                    &selector(*pid),
                    start,
                    end,
                    None,
                )
                .unwrap()
        };
        let (space, objects) = (merged("alloc_space"), merged("alloc_objects"));
        // The site's own stack: bytes per object is its block size.
        let site_space = space.with_function("agentwl_alloc_site") as f64;
        let site_objects = objects.with_function("agentwl_alloc_site") as f64;
        assert!(
            site_objects > 0.0,
            "pid {pid}: no sampled calls at agentwl_alloc_site: {:?}",
            space.top(5)
        );
        // Each profile's objects value of a stack is its estimate rounded (at most half
        // an object off), its bytes exact: bytes per object is the block size within
        // size * (profiles / 2) / objects.
        let profiles = stored.iter().filter(|p| p.pid == *pid).count() as f64;
        let per_object = site_space / site_objects;
        assert!(
            (per_object - size).abs() <= size * (profiles / 2.0) / site_objects + 1e-9,
            "pid {pid}: {per_object} bytes per object where the site allocates {size}"
        );
        // The estimate against the probe's exact count.
        let exact: u64 = stored
            .iter()
            .filter(|p| p.pid == *pid)
            .filter_map(|p| p.exact_bytes)
            .sum();
        let calls = exact as f64 / size;
        let bound = truth_bound(size, 65536.0, calls);
        let error = (space.total as f64 / exact as f64 - 1.0).abs();
        assert!(
            error <= bound,
            "pid {pid}: Pyroscope's estimate {} vs exact {exact} ({error:.4} > {bound:.4})",
            space.total
        );
    }
}

/// `stored` (one process's profiles, oldest first) pushed again as the agent sends
/// them (string sample labels removed) but without `__delta__=false`, under another
/// service, the first one also with it (a control, to a third) in the same request:
/// the server differences them itself, so the first one's `alloc_space`
/// (`alloc_space` is its profile type ID) is dropped and the total over `range` falls
/// below `stored_total`, while the control lands whole.
pub fn assert_a_push_without_delta_false_is_differenced(
    pyroscope: &Pyroscope,
    stored: &[StoredProfile],
    alloc_space: &str,
    range: (u64, u64),
    stored_total: i64,
) {
    // The same profiles, as the agent sends them (string sample labels removed), but
    // without __delta__=false, under another service; the first one also with it
    // (a control) in the same request.
    let demo = "allocbpf-delta-demo";
    let control = "allocbpf-delta-control";
    let demo_labels = [("__name__", "memory"), ("service_name", demo)];
    let control_labels = [
        ("__name__", "memory"),
        ("__delta__", "false"),
        ("service_name", control),
    ];
    for (i, profile) in stored.iter().enumerate() {
        let mut message = pprof::decode_file(&profile.path).unwrap();
        for sample in &mut message.sample {
            sample.label.retain(|label| label.str == 0);
        }
        let raw = pprof::gzip(&message);
        let mut series: Vec<PushSeries> = vec![(&demo_labels, &raw)];
        if i == 0 {
            series.push((&control_labels, &raw));
        }
        let (status, body) = pyroscope.push(&series, None).unwrap();
        assert_eq!(status, 200, "{body}");
    }
    let first = &stored[0];
    let ms = first.time_nanos / 1_000_000;
    let query = |service: &str| {
        pyroscope
            .select_merge_profile(
                alloc_space,
                &format!("{{service_name=\"{service}\"}}"),
                ms,
                ms + 1,
                None,
            )
            .unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while query(control).total != first.totals["alloc_space"] {
        assert!(
            Instant::now() < deadline,
            "the control push has {} alloc_space of {}",
            query(control).total,
            first.totals["alloc_space"]
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let dropped = query(demo);
    assert_eq!(
        (dropped.total, dropped.samples),
        (0, 0),
        "without __delta__=false the server kept the first alloc profile"
    );
    let demo_selector = format!("{{service_name=\"{demo}\"}}");
    let (start, end) = range;
    let demo_total = pyroscope
        .select_merge_profile(alloc_space, &demo_selector, start, end, None)
        .unwrap()
        .total;
    assert!(
        demo_total < stored_total,
        "differenced: {demo_total}, as sent: {stored_total}"
    );
}

/// `observed_fraction` is in every stored profile (the overhead budget's comment) but
/// no label of the series of `selector` in `[start, end]`: one series per profile
/// type, not one per interval.
pub fn assert_observed_fraction_is_no_series_label(
    pyroscope: &Pyroscope,
    stored: &[StoredProfile],
    selector: &str,
    (start, end): (u64, u64),
) {
    // observed_fraction: in every stored profile, in no series.
    for profile in stored {
        let message = pprof::decode_file(&profile.path).unwrap();
        let has = message
            .comment
            .iter()
            .any(|&i| message.string_table[i as usize].starts_with("observed_fraction="));
        assert!(has, "{}: no observed_fraction", profile.path.display());
    }
    let names = pyroscope
        .label_names(&[selector], start, end, None)
        .unwrap();
    assert!(names.iter().any(|n| n == "pid"), "{names:?}");
    assert!(!names.iter().any(|n| n == "observed_fraction"), "{names:?}");
    let series = pyroscope.series(&[selector], start, end, None).unwrap();
    let types: std::collections::BTreeSet<&str> = series
        .iter()
        .map(|labels| labels["__profile_type__"].as_str())
        .collect();
    assert_eq!(
        series.len(),
        types.len(),
        "one series per type, not one per interval: {series:?}"
    );
}
