use super::*;
use crate::test_report;
use flate2::read::GzDecoder;
use std::io::Read;

#[test]
fn live_profiles_have_go_heap_inuse_types() {
    let mut report = test_report();
    report.live = Some(allocbpf_profile::aggregate::LiveCounts::default());
    report.stacks[0].stats.inuse_bytes = 4096.0;
    let profile = to_profile(&report, 0);
    let s = |i: i64| profile.string_table[i as usize].as_str();
    let types: Vec<&str> = profile.sample_type.iter().map(|t| s(t.r#type)).collect();
    assert_eq!(
        types,
        [
            "alloc_objects",
            "alloc_space",
            "inuse_objects",
            "inuse_space"
        ]
    );
    assert_eq!(s(profile.default_sample_type), "inuse_space");
    assert_eq!(profile.sample[0].value[3], 4096);
}

#[test]
fn a_profile_carries_only_the_mappings_its_stacks_use() {
    let mut report = test_report();
    report.modules.push(allocbpf_profile::frame::Module {
        path: "/home/other-tenant/secret-service".into(),
        build_id: None,
    });
    let profile = to_profile(&report, 0);
    assert_eq!(profile.mapping.len(), 1);
    assert!(
        !profile
            .string_table
            .iter()
            .any(|s| s.contains("other-tenant")),
        "another process's binary leaked into the profile"
    );
}

#[test]
fn encode_then_decode_round_trips() {
    let report = test_report();
    let mut gz = Vec::new();
    write(&report, &mut gz).unwrap();
    let mut raw = Vec::new();
    GzDecoder::new(&gz[..]).read_to_end(&mut raw).unwrap();
    let profile = Profile::decode(&raw[..]).unwrap();

    let s = |i: i64| profile.string_table[i as usize].as_str();
    assert_eq!(s(0), "");
    let types: Vec<(&str, &str)> = profile
        .sample_type
        .iter()
        .map(|t| (s(t.r#type), s(t.unit)))
        .collect();
    assert_eq!(
        types,
        [("alloc_objects", "count"), ("alloc_space", "bytes")]
    );
    let period_type = profile.period_type.as_ref().unwrap();
    assert_eq!(
        (s(period_type.r#type), s(period_type.unit)),
        ("space", "bytes")
    );
    assert_eq!(profile.period, report.rate as i64);
    assert_eq!(profile.sample.len(), report.stacks.len());

    // Values and leaf-first function names survive.
    let first = &profile.sample[0];
    assert_eq!(
        first.value[1],
        report.stacks[0].stats.estimated_bytes.round() as i64
    );
    let leaf = profile
        .location
        .iter()
        .find(|l| l.id == first.location_id[0])
        .unwrap();
    let function = profile
        .function
        .iter()
        .find(|f| f.id == leaf.line[0].function_id)
        .unwrap();
    assert_eq!(s(function.name), "inlined_helper");
    assert_eq!(leaf.line.len(), 2, "inlined frame kept in one location");

    // Mapping carries the build id; address - start is the file offset.
    let mapping = &profile.mapping[0];
    assert_eq!(s(mapping.build_id), "abcd");
    assert_eq!(leaf.address - mapping.memory_start, 0x1234);
    assert_eq!(first.label[0].num, 42);
    let label = |key: &str| {
        first
            .label
            .iter()
            .find(|l| s(l.key) == key)
            .unwrap_or_else(|| panic!("label {key}"))
    };
    let interval = report.interval(&report.stacks[0].stats);
    assert_eq!(label("bytes_ci95_low").num, interval.lo.round() as i64);
    assert_eq!(label("bytes_ci95_high").num, interval.hi.round() as i64);
    assert_eq!(s(label("bytes_ci95_high").num_unit), "bytes");
}

/// `allocbpf -o x.pb.gz` writes what [`encode`] makes without meta: the message as
/// `to_profile` builds it, gzipped.
#[test]
fn write_is_encode_without_meta() {
    let report = test_report();
    let mut written = Vec::new();
    write(&report, &mut written).unwrap();
    let (profile, meta) = decode(&written[..], u64::MAX).unwrap();
    assert_eq!(
        meta,
        ProfileMeta {
            time_nanos: profile.time_nanos,
            ..ProfileMeta::default()
        }
    );
    assert_eq!(written, encode(&report, &meta));
    assert_eq!(written, gzip(&to_profile(&report, profile.time_nanos)));
}
