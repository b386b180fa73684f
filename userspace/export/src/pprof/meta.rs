//! What a stored profile carries beyond its report, written and read in one place.
//!
//! The agent's per-process profiles add to `to_profile`'s message, in this order: a
//! string label on every sample and a `key=value` comment for each process label (the
//! interval's observed fraction last, when time-sampled), then the comments
//! `exact_bytes=` and `exact_calls=`. `allocbpf report` and the push transports read
//! them back. A profile's string table order is part of its bytes, so [`encode`] runs
//! exactly the steps the writer always ran, through the same functions.

use std::{io::Read, path::Path};

use allocbpf_profile::report::Report;

use super::{
    add_comment, add_labels, decode_gzipped, gzip, proto::Profile, to_profile, DecodeError,
};

/// Label of a time-sampled profile: the share of its interval observed, `{:.4}`.
pub const OBSERVED_FRACTION_LABEL: &str = "observed_fraction";

/// Comment key of a stored profile's exact bytes (as counted while probes were in).
pub const EXACT_BYTES_COMMENT: &str = "exact_bytes";

/// Comment key of a stored profile's exact number of calls.
pub const EXACT_CALLS_COMMENT: &str = "exact_calls";

/// Labels that change every interval: kept in the profile itself, never in a series'
/// labels (each value would be a new series).
pub const PER_INTERVAL_LABELS: &[&str] = &[OBSERVED_FRACTION_LABEL];

/// What a profile carries beyond its report.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProfileMeta {
    /// `Profile::time_nanos`: the start of the interval, ns since the epoch.
    pub time_nanos: i64,
    /// In order: a string label on every sample (but `pid`, which is numeric there,
    /// and empty values) and a `key=value` comment each (all of them).
    pub labels: Vec<(String, String)>,
    /// The `exact_bytes=` comment, after the labels'.
    pub exact_bytes: Option<u64>,
    /// The `exact_calls=` comment, after `exact_bytes=`.
    pub exact_calls: Option<u64>,
}

impl ProfileMeta {
    /// One process's profile: `process_labels`, then the observed fraction when
    /// `report` is time-sampled (the estimates are scaled to the whole interval; see
    /// the profile comment); the exact totals from `report.totals`.
    pub fn of_process(
        report: &Report,
        time_nanos: i64,
        process_labels: &[(&str, String)],
    ) -> ProfileMeta {
        let mut labels: Vec<(String, String)> = process_labels
            .iter()
            .map(|(key, value)| (key.to_string(), value.clone()))
            .collect();
        if let Some(time) = &report.time_sampling {
            labels.push((
                OBSERVED_FRACTION_LABEL.to_string(),
                format!("{:.4}", time.observed_fraction),
            ));
        }
        ProfileMeta {
            time_nanos,
            labels,
            exact_bytes: Some(report.totals.exact_bytes),
            exact_calls: Some(report.totals.exact_calls),
        }
    }

    /// Reads it back: the labels from the comments after the first (which is
    /// `to_profile`'s summary), each split at its first `=`; each exact total from
    /// the first comment with its key, `None` if that one does not parse (a stored
    /// profile's figures are never guessed from a later line).
    pub fn read(profile: &Profile) -> ProfileMeta {
        let mut meta = ProfileMeta {
            time_nanos: profile.time_nanos,
            ..ProfileMeta::default()
        };
        let (mut exact_bytes, mut exact_calls) = (None, None);
        let comments = profile
            .comment
            .iter()
            .skip(1)
            .filter_map(|&i| profile.string_table.get(i as usize));
        for comment in comments {
            let Some((key, value)) = comment.split_once('=') else {
                continue;
            };
            match key {
                EXACT_BYTES_COMMENT => {
                    exact_bytes.get_or_insert(value);
                }
                EXACT_CALLS_COMMENT => {
                    exact_calls.get_or_insert(value);
                }
                _ => meta.labels.push((key.to_string(), value.to_string())),
            }
        }
        meta.exact_bytes = exact_bytes.and_then(|v| v.parse().ok());
        meta.exact_calls = exact_calls.and_then(|v| v.parse().ok());
        meta
    }

    /// The value of label `key` (the first, should there be several).
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, value)| value.as_str())
    }

    /// The observed fraction of a time-sampled profile.
    pub fn observed_fraction(&self) -> Option<f64> {
        self.label(OBSERVED_FRACTION_LABEL)?.parse().ok()
    }
}

/// The gzipped pprof of `report` with `meta`: `to_profile`, `add_labels`, the exact
/// totals' comments (appended as they are, never merged with an equal string already
/// in the table), [`gzip`].
pub fn encode(report: &Report, meta: &ProfileMeta) -> Vec<u8> {
    let mut profile = to_profile(report, meta.time_nanos);
    add_labels(&mut profile, &meta.labels);
    if let Some(bytes) = meta.exact_bytes {
        add_comment(&mut profile, &format!("{EXACT_BYTES_COMMENT}={bytes}"));
    }
    if let Some(calls) = meta.exact_calls {
        add_comment(&mut profile, &format!("{EXACT_CALLS_COMMENT}={calls}"));
    }
    gzip(&profile)
}

/// Decodes a gzipped pprof of at most `max_bytes` decompressed ([`decode_gzipped`])
/// and reads its [`ProfileMeta`].
pub fn decode(gzipped: impl Read, max_bytes: u64) -> Result<(Profile, ProfileMeta), DecodeError> {
    let profile = decode_gzipped(gzipped, max_bytes)?;
    let meta = ProfileMeta::read(&profile);
    Ok((profile, meta))
}

/// Reads a gzipped pprof file and its [`ProfileMeta`].
pub fn decode_path(path: &Path) -> Result<(Profile, ProfileMeta), DecodeError> {
    let file = std::fs::File::open(path).map_err(DecodeError::Open)?;
    decode(file, u64::MAX)
}

impl Profile {
    /// Takes the string labels off every sample and keeps the numeric ones: for
    /// stores that make string sample labels series labels (Pyroscope).
    pub fn drop_string_labels(&mut self) {
        for sample in &mut self.sample {
            sample.label.retain(|label| label.str == 0);
        }
    }

    /// Takes every label off every sample: for receivers that make sample attributes
    /// series labels (OTLP), where ours would be a series per stack and interval.
    pub fn drop_labels(&mut self) {
        for sample in &mut self.sample {
            sample.label.clear();
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::pprof::decode_gzipped;
    use allocbpf_profile::aggregate::StackStats;
    use allocbpf_profile::frame::{Frame, FunctionFrame};
    use allocbpf_profile::report::Location;

    /// [`crate::test_report`] time-sampled, with a third stack whose one function is
    /// named like an exact total's comment, and interval inputs whose mean interval
    /// goes through its labels exactly.
    pub(in crate::pprof) fn stored_report() -> Report {
        let mut report = crate::test_report();
        report.time_sampling = Some(crate::quarter_observed());
        let mut odd = report.stacks[1].clone();
        odd.locations = vec![Location {
            frame: Frame::Module {
                module: 0,
                offset: 0x3000,
            },
            functions: vec![FunctionFrame {
                name: "exact_bytes=30000".into(),
                file: None,
                line: None,
                shown: None,
            }]
            .into(),
        }];
        odd.stats = StackStats {
            samples: 1,
            estimated_bytes: 4096.0,
            estimated_objects: 64.0,
            observed_bytes: 1024.0,
            ..odd.stats
        };
        odd.stats.interval_inputs.counted_samples = 1;
        report.stacks.push(odd);
        for stack in &mut report.stacks {
            let inputs = &mut stack.stats.interval_inputs;
            let n = inputs.counted_samples as f64;
            inputs.rate_sum = n * 4096.0;
            inputs.rate_square_sum = n * 4096.0 * 4096.0;
        }
        report
    }

    /// An agent's process labels: `main` is also a function's name (the label reuses
    /// its string), the build id is empty (a comment, no sample label), the cgroup has
    /// an `=` in it.
    pub(in crate::pprof) fn process_labels() -> Vec<(&'static str, String)> {
        [
            ("hostname", "h"),
            ("pid", "42"),
            ("comm", "work"),
            ("exe", "/usr/bin/work"),
            ("exe_build_id", ""),
            ("cgroup", "/a=b"),
            ("container_id", "main"),
        ]
        .map(|(key, value)| (key, value.to_string()))
        .to_vec()
    }

    fn decoded(gzipped: &[u8]) -> Profile {
        decode_gzipped(gzipped, u64::MAX).unwrap()
    }

    #[test]
    fn meta_round_trips_through_the_encoded_profile() {
        let report = stored_report();
        let meta = ProfileMeta::of_process(&report, 123, &process_labels());
        let gzipped = encode(&report, &meta);
        let (profile, read) = decode(&gzipped[..], u64::MAX).unwrap();
        assert_eq!(read, meta);
        assert_eq!(profile.time_nanos, 123);
        assert_eq!(meta.time_nanos, 123);
        assert_eq!(meta.label("pid"), Some("42"));
        assert_eq!(meta.label("exe_build_id"), Some(""));
        assert_eq!(meta.label("cgroup"), Some("/a=b"));
        assert_eq!(meta.label(OBSERVED_FRACTION_LABEL), Some("0.2500"));
        assert_eq!(meta.observed_fraction(), Some(0.25));
        assert_eq!(meta.labels.last().unwrap().0, OBSERVED_FRACTION_LABEL);
        assert_eq!(
            (meta.exact_bytes, meta.exact_calls),
            (Some(30_000), Some(400))
        );

        // Not time-sampled: no observed fraction.
        let mut full_time = report.clone();
        full_time.time_sampling = None;
        let meta = ProfileMeta::of_process(&full_time, 123, &process_labels());
        assert_eq!(meta.labels.len(), process_labels().len());
        assert_eq!(meta.observed_fraction(), None);
    }

    #[test]
    fn comments_are_the_summary_then_the_labels_then_the_exact_totals() {
        let report = stored_report();
        let meta = ProfileMeta::of_process(&report, 123, &process_labels());
        let profile = decoded(&encode(&report, &meta));
        let s = |i: i64| profile.string_table[i as usize].as_str();
        let comments: Vec<&str> = profile.comment.iter().map(|&i| s(i)).collect();
        assert!(comments[0].starts_with("allocbpf: Poisson byte sampling"));
        let mut expected: Vec<String> = meta
            .labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        expected.extend([
            "exact_bytes=30000".to_string(),
            "exact_calls=400".to_string(),
        ]);
        assert_eq!(comments[1..], expected);
        // The exact totals are the table's last strings, not the function's name.
        let last = profile.string_table.len() as i64;
        assert_eq!(
            profile.comment[profile.comment.len() - 2..],
            [last - 2, last - 1]
        );
        assert_eq!(
            profile
                .string_table
                .iter()
                .filter(|s| *s == "exact_bytes=30000")
                .count(),
            2
        );
    }

    #[test]
    fn samples_carry_the_numbers_then_the_process_labels() {
        let report = stored_report();
        let meta = ProfileMeta::of_process(&report, 123, &process_labels());
        let profile = decoded(&encode(&report, &meta));
        let s = |i: i64| profile.string_table[i as usize].as_str();
        let numeric = [
            "pid",
            "samples",
            "bytes_ci95_low",
            "bytes_ci95_high",
            "ci_counted_samples",
            "ci_untried_bytes",
            "ci_sampled_bytes",
            "ci_certain_bytes",
            "ci_rate_sum",
            "ci_rate_scale",
            "observed_bytes",
        ];
        let strings = [
            ("hostname", "h"),
            ("comm", "work"),
            ("exe", "/usr/bin/work"),
            ("cgroup", "/a=b"),
            ("container_id", "main"),
            ("observed_fraction", "0.2500"),
        ];
        assert_eq!(profile.sample.len(), 3);
        for sample in &profile.sample {
            let (numbers, texts) = sample.label.split_at(numeric.len());
            let keys: Vec<&str> = numbers.iter().map(|l| s(l.key)).collect();
            assert_eq!(keys, numeric);
            assert!(numbers.iter().all(|l| l.str == 0));
            let pairs: Vec<(&str, &str)> = texts.iter().map(|l| (s(l.key), s(l.str))).collect();
            assert_eq!(pairs, strings);
        }
        // `main` the label is `main` the function: one string.
        let container = &profile.sample[0].label[numeric.len() + 4];
        assert_eq!(s(container.key), "container_id");
        assert!(profile.function.iter().any(|f| f.name == container.str));
    }

    /// What the agent's writer wrote before [`encode`] was its one encoder: the same
    /// bytes, string table order included.
    #[test]
    fn encode_is_the_writers_sequence_byte_for_byte() {
        let report = stored_report();
        let labels = process_labels();
        let meta = ProfileMeta::of_process(&report, 123, &labels);
        let mut with_fraction = labels.clone();
        with_fraction.push(("observed_fraction", "0.2500".to_string()));
        let mut old = to_profile(&report, 123);
        add_labels(&mut old, &with_fraction);
        add_comment(
            &mut old,
            &format!("exact_bytes={}", report.totals.exact_bytes),
        );
        add_comment(
            &mut old,
            &format!("exact_calls={}", report.totals.exact_calls),
        );
        assert_eq!(encode(&report, &meta), gzip(&old));
    }

    /// `allocbpf -o x.pb.gz` writes no labels and no exact totals' comments.
    #[test]
    fn a_profile_without_meta_reads_as_none() {
        let report = stored_report();
        assert_eq!(
            ProfileMeta::read(&to_profile(&report, 7)),
            ProfileMeta {
                time_nanos: 7,
                ..ProfileMeta::default()
            }
        );
    }

    /// The first comment with an exact total's key counts, parsed or not.
    #[test]
    fn the_first_exact_comment_counts() {
        let mut profile = to_profile(&stored_report(), 0);
        add_comment(&mut profile, "exact_bytes=many");
        add_comment(&mut profile, "exact_bytes=5");
        add_comment(&mut profile, "exact_calls=6");
        add_comment(&mut profile, "exact_calls=7");
        let meta = ProfileMeta::read(&profile);
        assert_eq!((meta.exact_bytes, meta.exact_calls), (None, Some(6)));
        assert!(meta.labels.is_empty());
    }

    fn labelled() -> Profile {
        use crate::pprof::proto::{Label, Sample};
        Profile {
            string_table: vec!["".into(), "comm".into(), "x".into(), "pid".into()],
            sample: vec![Sample {
                value: vec![1],
                label: vec![
                    Label {
                        key: 1,
                        str: 2,
                        ..Default::default()
                    },
                    Label {
                        key: 3,
                        num: 42,
                        ..Default::default()
                    },
                ],
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn string_labels_leave_the_samples_and_numbers_stay() {
        let mut profile = labelled();
        profile.drop_string_labels();
        assert_eq!(profile.sample[0].label.len(), 1);
        assert_eq!(profile.sample[0].label[0].num, 42);
    }

    #[test]
    fn every_label_leaves_the_samples() {
        let mut profile = labelled();
        profile.drop_labels();
        assert!(profile.sample[0].label.is_empty());
        assert_eq!(profile.sample[0].value, [1]);
    }
}
