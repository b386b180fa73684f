use super::proto::{any_value, ProfilesDictionary};
use super::*;
use crate::pprof::proto as pp;

/// Base of the one mapping of [`small_pprof`].
const BASE: u64 = 1 << 40;

/// The string table of [`small_pprof`].
const SMALL_STRINGS: [&str; 20] = [
    "",
    "alloc_objects",
    "count",
    "alloc_space",
    "bytes",
    "space",
    "main",
    "site_a",
    "work.c",
    "/usr/bin/work",
    "abcd",
    "pid",
    "samples",
    "bytes_ci95_low",
    "bytes_ci95_high",
    "allocbpf: a comment",
    "hostname",
    "host1",
    "thread",
    "worker",
];

/// The index of `text` in [`SMALL_STRINGS`], as [`small_pprof`] refers to strings.
fn string_id(text: &str) -> i64 {
    SMALL_STRINGS.iter().position(|s| *s == text).unwrap() as i64
}

/// A sample type or unit of [`small_pprof`] by its strings.
fn small_value_type(r#type: &str, unit: &str) -> pp::ValueType {
    pp::ValueType {
        r#type: string_id(r#type),
        unit: string_id(unit),
    }
}

/// A sample of [`small_pprof`]: process `pid`'s, with labels of both kinds.
fn small_sample(location_id: Vec<u64>, value: Vec<i64>, pid: i64) -> pp::Sample {
    let num = |key, num, unit: &str| pp::Label {
        key: string_id(key),
        num,
        num_unit: string_id(unit),
        ..Default::default()
    };
    let string = |key, value| pp::Label {
        key: string_id(key),
        str: string_id(value),
        ..Default::default()
    };
    pp::Sample {
        location_id,
        value,
        label: vec![
            num("pid", pid, ""),
            num("samples", 3, ""),
            num("bytes_ci95_low", 1000, "bytes"),
            num("bytes_ci95_high", 9000, "bytes"),
            // On the resource too: not repeated per sample.
            string("hostname", "host1"),
            string("thread", "worker"),
        ],
    }
}

/// A location of [`small_pprof`]'s one mapping, `offset` into it, of one line.
fn small_location(id: u64, offset: u64, function_id: u64, line: i64) -> pp::Location {
    pp::Location {
        id,
        mapping_id: 7,
        address: BASE + offset,
        line: vec![pp::Line {
            function_id,
            line,
            column: 0,
        }],
        is_folded: false,
    }
}

/// A function of [`small_pprof`], in `work.c`.
fn small_function(id: u64, name: &str) -> pp::Function {
    pp::Function {
        id,
        name: string_id(name),
        system_name: string_id(name),
        filename: string_id("work.c"),
        start_line: 0,
    }
}

/// Two sample types, three samples over two functions in one mapping, labels of both
/// kinds, a comment. Ids are not 1..n, as pprof allows.
fn small_pprof() -> pp::Profile {
    pp::Profile {
        sample_type: vec![
            small_value_type("alloc_objects", "count"),
            small_value_type("alloc_space", "bytes"),
        ],
        sample: vec![
            small_sample(vec![11, 12], vec![5, 20_480], 42),
            small_sample(vec![12], vec![2, 8_192], 42),
            // No objects: absent from the alloc_objects profile.
            small_sample(vec![11, 12], vec![0, 100], 43),
        ],
        mapping: vec![pp::Mapping {
            id: 7,
            memory_start: BASE,
            memory_limit: 2 * BASE,
            file_offset: 0,
            filename: string_id("/usr/bin/work"),
            build_id: string_id("abcd"),
            has_functions: true,
            ..Default::default()
        }],
        location: vec![
            small_location(11, 0x1234, 21, 5),
            small_location(12, 0x2000, 20, 9),
        ],
        function: vec![small_function(20, "main"), small_function(21, "site_a")],
        string_table: SMALL_STRINGS.iter().map(|s| s.to_string()).collect(),
        time_nanos: 1_000,
        duration_nanos: 2_000,
        period_type: Some(small_value_type("space", "bytes")),
        period: 4096,
        comment: vec![string_id("allocbpf: a comment")],
        default_sample_type: string_id("alloc_space"),
        ..Default::default()
    }
}

fn resource_labels() -> Vec<(&'static str, String)> {
    [
        ("hostname", "host1"),
        ("pid", "42"),
        ("comm", "work"),
        ("exe", "/usr/bin/work"),
        ("exe_build_id", "abcd"),
        ("cgroup", "/system.slice/work.service"),
        ("container_id", ""),
        ("custom", "v"),
    ]
    .map(|(k, v)| (k, v.to_string()))
    .to_vec()
}

fn dict(request: &ExportProfilesServiceRequest) -> &ProfilesDictionary {
    request.dictionary.as_ref().unwrap()
}

fn round_trip() -> ExportProfilesServiceRequest {
    let request = request_from_pprof(&small_pprof(), &resource_labels(), 0, 0);
    let decoded = decode(&encode(&request)).unwrap();
    assert_eq!(decoded, request);
    decoded
}

fn any_string(value: &str) -> Option<AnyValue> {
    Some(AnyValue {
        value: Some(any_value::Value::StringValue(value.to_string())),
    })
}

/// The attribute `key` among `indices`: (value, unit).
fn attribute(
    request: &ExportProfilesServiceRequest,
    indices: &[i32],
    key: &str,
) -> Option<(Option<AnyValue>, String)> {
    let d = dict(request);
    indices.iter().find_map(|&i| {
        let a = &d.attribute_table[i as usize];
        (d.string_table[a.key_strindex as usize] == key).then(|| {
            (
                a.value.clone(),
                d.string_table[a.unit_strindex as usize].clone(),
            )
        })
    })
}

#[test]
fn totals_and_stacks_survive_encoding() {
    let request = round_trip();
    assert_eq!(
        totals_by_type(&request),
        [
            ("alloc_objects".to_string(), "count".to_string(), 7),
            ("alloc_space".to_string(), "bytes".to_string(), 28_772),
        ]
    );
    let names = |names: &[&str]| names.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        stacks(&request, "alloc_space"),
        [
            (names(&["site_a", "main"]), 20_580),
            (names(&["main"]), 8_192)
        ]
    );
    assert_eq!(
        stacks(&request, "alloc_objects"),
        [(names(&["site_a", "main"]), 5), (names(&["main"]), 2)]
    );
    assert!(stacks(&request, "inuse_space").is_empty());
}

#[test]
fn one_profile_per_sample_type_over_one_dictionary() {
    let request = round_trip();
    let scope = &request.resource_profiles[0].scope_profiles[0];
    let scope_meta = scope.scope.as_ref().unwrap();
    assert_eq!(scope_meta.name, "allocbpf");
    assert_eq!(scope_meta.version, env!("CARGO_PKG_VERSION"));
    assert_eq!(
        scope_meta.attributes[0].value,
        any_string("alloc_space"),
        "pprof.scope.default_sample_type"
    );
    let [objects, space] = &scope.profiles[..] else {
        panic!("{} profiles", scope.profiles.len())
    };
    assert_eq!(
        objects.samples.len(),
        2,
        "the zero-valued sample is left out"
    );
    assert_eq!(space.samples.len(), 3);
    assert!(space.samples.iter().all(|s| s.values.len() == 1));
    // The same stacks: one table entry per distinct stack, shared.
    assert_eq!(objects.samples[0].stack_index, space.samples[0].stack_index);
    assert_eq!(space.samples[0].stack_index, space.samples[2].stack_index);
    assert_eq!(dict(&request).stack_table.len(), 3, "zero + two stacks");
    let d = dict(&request);
    let s = |i: i32| d.string_table[i as usize].as_str();
    for p in [objects, space] {
        let period_type = p.period_type.as_ref().unwrap();
        assert_eq!((s(period_type.type_strindex), p.period), ("space", 4096));
        assert_eq!((p.time_unix_nano, p.duration_nano), (1_000, 2_000));
        assert_eq!(p.profile_id.len(), 16);
        assert!(p.profile_id.iter().any(|&b| b != 0));
        let (comment, _) = attribute(&request, &p.attribute_indices, "pprof.profile.comment")
            .expect("comment attribute");
        let Some(any_value::Value::ArrayValue(array)) = comment.unwrap().value else {
            panic!("comment is not an array")
        };
        assert_eq!(array.values, [any_string("allocbpf: a comment").unwrap()]);
    }
    assert_ne!(objects.profile_id, space.profile_id);
    // Derived from the content: the same input, the same ids.
    let again = request_from_pprof(&small_pprof(), &resource_labels(), 0, 0);
    assert_eq!(again, request);
    let timed = request_from_pprof(&small_pprof(), &resource_labels(), 5, 6);
    let timed = &timed.resource_profiles[0].scope_profiles[0].profiles[0];
    assert_eq!((timed.time_unix_nano, timed.duration_nano), (5, 6));
    assert_ne!(timed.profile_id, objects.profile_id);
}

#[test]
fn resource_attributes_use_semantic_convention_keys() {
    let request = round_trip();
    let resource = request.resource_profiles[0].resource.as_ref().unwrap();
    let attributes: Vec<(&str, Option<AnyValue>)> = resource
        .attributes
        .iter()
        .map(|a| (a.key.as_str(), a.value.clone()))
        .collect();
    let pid = Some(AnyValue {
        value: Some(any_value::Value::IntValue(42)),
    });
    assert_eq!(
        attributes,
        [
            ("host.name", any_string("host1")),
            ("process.pid", pid),
            // There is an exe: it names the executable, comm keeps its own key.
            ("comm", any_string("work")),
            ("process.executable.path", any_string("/usr/bin/work")),
            ("process.executable.name", any_string("work")),
            ("process.executable.build_id.gnu", any_string("abcd")),
            (
                "process.linux.cgroup",
                any_string("0::/system.slice/work.service")
            ),
            // container_id was empty: left out.
            ("custom", any_string("v")),
        ]
    );
    // Owned pairs, as the agent's push has them.
    let owned: Vec<(String, String)> =
        vec![("comm".into(), "work".into()), ("pid".into(), "x".into())];
    let without_exe = resource_from_labels(&owned);
    let keys: Vec<&str> = without_exe
        .attributes
        .iter()
        .map(|a| a.key.as_str())
        .collect();
    assert_eq!(keys, ["process.executable.name", "pid"]);
}

#[test]
fn sample_mapping_and_location_attributes() {
    let request = round_trip();
    let space = &request.resource_profiles[0].scope_profiles[0].profiles[1];
    let indices = &space.samples[0].attribute_indices;
    let int = |i| {
        Some(AnyValue {
            value: Some(any_value::Value::IntValue(i)),
        })
    };
    assert_eq!(
        attribute(&request, indices, "pid"),
        Some((int(42), String::new()))
    );
    assert_eq!(
        attribute(&request, indices, "bytes_ci95_high"),
        Some((int(9000), "By".to_string()))
    );
    assert_eq!(
        attribute(&request, indices, "thread"),
        Some((any_string("worker"), String::new()))
    );
    assert_eq!(
        attribute(&request, indices, "hostname"),
        None,
        "on the resource"
    );
    // The two samples of pid 42 share their label attributes' entries.
    let other = &space.samples[1].attribute_indices;
    assert_eq!(indices, other);
    assert_ne!(indices, &space.samples[2].attribute_indices);

    let d = dict(&request);
    let [_, mapping] = &d.mapping_table[..] else {
        panic!("{} mappings", d.mapping_table.len())
    };
    assert_eq!(
        d.string_table[mapping.filename_strindex as usize],
        "/usr/bin/work"
    );
    assert_eq!(
        (mapping.memory_start, mapping.memory_limit),
        (BASE, 2 * BASE)
    );
    let build_id = attribute(
        &request,
        &mapping.attribute_indices,
        "process.executable.build_id.gnu",
    );
    assert_eq!(build_id, Some((any_string("abcd"), String::new())));
    let has_functions = attribute(
        &request,
        &mapping.attribute_indices,
        "pprof.mapping.has_functions",
    );
    let yes = Some(AnyValue {
        value: Some(any_value::Value::BoolValue(true)),
    });
    assert_eq!(has_functions, Some((yes, String::new())));
    assert_eq!(
        mapping.attribute_indices.len(),
        2,
        "false flags are left out"
    );

    let leaf = &d.location_table
        [d.stack_table[space.samples[0].stack_index as usize].location_indices[0] as usize];
    assert_eq!((leaf.mapping_index, leaf.address), (1, BASE + 0x1234));
    assert_eq!(leaf.lines[0].line, 5);
    let function = &d.function_table[leaf.lines[0].function_index as usize];
    assert_eq!(d.string_table[function.name_strindex as usize], "site_a");
    assert_eq!(
        d.string_table[function.filename_strindex as usize],
        "work.c"
    );
}

#[test]
fn index_zero_of_every_table_is_the_zero_entry_and_only_there() {
    let request = round_trip();
    let d = dict(&request);
    assert_eq!(d.string_table[0], "");
    assert_eq!(d.mapping_table[0], Default::default());
    assert_eq!(d.location_table[0], Default::default());
    assert_eq!(d.function_table[0], Default::default());
    assert_eq!(d.attribute_table[0], Default::default());
    assert_eq!(d.stack_table[0], Default::default());
    assert_eq!(
        (&d.link_table[0].trace_id[..], &d.link_table[0].span_id[..]),
        (&[0u8; 16][..], &[0u8; 8][..])
    );
    assert_eq!(d.link_table.len(), 1);
    // 0 means unset, so nothing set points there.
    assert!(d.string_table[1..].iter().all(|s| !s.is_empty()));
    assert!(d.mapping_table[1..]
        .iter()
        .all(|m| *m != Default::default()));
    assert!(d.location_table[1..]
        .iter()
        .all(|l| l.mapping_index > 0 && l.lines.iter().all(|line| line.function_index > 0)));
    assert!(d.function_table[1..].iter().all(|f| f.name_strindex > 0));
    assert!(d.attribute_table[1..].iter().all(|a| a.key_strindex > 0));
    assert!(d.stack_table[1..]
        .iter()
        .all(|s| !s.location_indices.is_empty() && s.location_indices.iter().all(|&l| l > 0)));
    for p in &request.resource_profiles[0].scope_profiles[0].profiles {
        assert!(p
            .samples
            .iter()
            .all(|s| s.stack_index > 0 && s.link_index == 0));
        let sample_type = p.sample_type.as_ref().unwrap();
        assert!(sample_type.type_strindex > 0 && sample_type.unit_strindex > 0);
    }
}

#[test]
fn our_own_pprof_converts_with_its_totals() {
    let mut report = crate::test_report();
    report.live = Some(allocbpf_profile::aggregate::LiveCounts::default());
    report.stacks[0].stats.inuse_bytes = 4096.0;
    report.stacks[0].stats.inuse_objects = 1.0;
    let mut profile = crate::pprof::to_profile(&report, 123);
    let labels = [("hostname", "h".to_string()), ("pid", "42".to_string())];
    crate::pprof::add_labels(&mut profile, &labels);
    let request = decode(&encode(&request_from_pprof(&profile, &labels, 0, 0))).unwrap();
    let s = |i: i64| profile.string_table[i as usize].clone();
    let expected: Vec<(String, String, i64)> = profile
        .sample_type
        .iter()
        .enumerate()
        .map(|(i, t)| {
            (
                s(t.r#type),
                s(t.unit),
                profile.sample.iter().map(|x| x.value[i]).sum(),
            )
        })
        .collect();
    assert_eq!(expected.len(), 4);
    assert_eq!(totals_by_type(&request), expected);
    // The report's two stacks share their leaf frame, which pprof keys its locations
    // by: both read as the first's functions there, and here they add up.
    let names = |names: &[&str]| names.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        stacks(&request, "alloc_space"),
        [(names(&["inlined_helper", "site_a", "main"]), expected[1].2)]
    );
    assert_eq!(stacks(&request, "inuse_space").len(), 1);
    let time = request.resource_profiles[0].scope_profiles[0].profiles[0].time_unix_nano;
    assert_eq!(time, 123, "pprof's time when none is given");
}

#[test]
fn garbage_is_an_error_not_a_panic() {
    assert!(decode(&[0xff; 16]).is_err());
    let bytes = encode(&round_trip());
    assert!(decode(&bytes[..bytes.len() - 3]).is_err(), "truncated");
    // Whatever decodes, reading it back does not panic either.
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    for len in 0..2000 {
        let junk: Vec<u8> = (0..len % 97)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect();
        // Also valid prefixes with one corrupted byte.
        let mut corrupt = bytes.clone();
        let at = state as usize % corrupt.len();
        corrupt[at] ^= state.to_le_bytes()[3] | 1;
        for input in [&junk[..], &corrupt[..]] {
            if let Ok(request) = decode(input) {
                let _ = totals_by_type(&request);
                let _ = stacks(&request, "alloc_space");
            }
        }
    }
}

#[test]
fn out_of_range_indices_read_as_unset() {
    let mut request = round_trip();
    let d = request.dictionary.as_mut().unwrap();
    d.stack_table.push(proto::Stack {
        location_indices: vec![-1, 999],
    });
    let stack_index = d.stack_table.len() as i32 - 1;
    let profile = &mut request.resource_profiles[0].scope_profiles[0].profiles[1];
    profile.samples.push(Sample {
        stack_index,
        values: vec![1],
        ..Default::default()
    });
    profile.samples.push(Sample {
        stack_index: 12345,
        timestamps_unix_nano: vec![1, 2],
        ..Default::default()
    });
    let found = stacks(&request, "alloc_space");
    assert!(found.contains(&(vec!["0x0".to_string(), "0x0".to_string()], 1)));
    assert!(found.contains(&(Vec::new(), 2)), "timestamps count 1 each");
}
