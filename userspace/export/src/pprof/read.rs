//! Stacks back from a pprof profile as [`encode`](super::encode) writes them: each sample's
//! estimates, raw sample count and confidence-interval inputs (its numeric labels), and
//! its locations as function chains, for `allocbpf report` to merge stored profiles
//! with exact intervals.
//!
//! A profile from elsewhere reads too: what it lacks reads as 0, a function it does
//! not name as its location's address.

use std::collections::HashMap;

use allocbpf_profile::aggregate::StackStats;
use allocbpf_profile::frame::{shown_with_file, FunctionFrame};

use super::{
    interval_inputs_from,
    proto::{Location, Profile},
    INTERVAL_INPUT_LABELS, OBSERVED_BYTES_LABEL,
};

/// A profile's samples as stacks.
#[derive(Clone, Debug, PartialEq)]
pub struct ReadProfile {
    /// The sampling interval (`Profile::period`), bytes.
    pub rate: u64,
    /// True if it has in-use values (an `inuse_space` sample type).
    pub live: bool,
    /// `Profile::time_nanos`: the start of the interval, ns since the epoch.
    pub time_nanos: i64,
    /// `Profile::duration_nanos`.
    pub duration_nanos: i64,
    /// One per sample, in the profile's order.
    pub samples: Vec<ReadSample>,
}

/// One sample: a stack of one process.
#[derive(Clone, Debug, PartialEq)]
pub struct ReadSample {
    /// Its numeric `pid` label (0 without one).
    pub pid: u32,
    /// Its locations, leaf first; each location's functions innermost first. A
    /// location id the profile does not define is skipped; a function id it does not
    /// define reads as a function named by the location's address (`0x...`, no file,
    /// its line kept), and a location without lines as one such function, no line.
    pub locations: Vec<Vec<FunctionFrame>>,
    /// Its raw sample count, estimates by sample type name, interval inputs, and the
    /// observed bytes (its estimate, when not time-sampled).
    pub stats: StackStats,
    /// True if it carries [`OBSERVED_BYTES_LABEL`]: its profile was time-sampled.
    pub time_sampled: bool,
}

/// The stacks of `profile`.
pub fn read(profile: &Profile) -> ReadProfile {
    let s = |i: i64| {
        profile
            .string_table
            .get(i as usize)
            .map_or("", String::as_str)
    };
    let types: Vec<&str> = profile.sample_type.iter().map(|t| s(t.r#type)).collect();
    let column = |name: &str| types.iter().position(|t| *t == name);
    let (alloc_objects, alloc_space) = (column("alloc_objects"), column("alloc_space"));
    let (inuse_objects, inuse_space) = (column("inuse_objects"), column("inuse_space"));
    let functions: HashMap<u64, (String, Option<String>)> = profile
        .function
        .iter()
        .map(|f| {
            let file = s(f.filename);
            (
                f.id,
                (
                    s(f.name).to_string(),
                    (!file.is_empty()).then(|| file.to_string()),
                ),
            )
        })
        .collect();
    let location_by_id: HashMap<u64, &Location> =
        profile.location.iter().map(|l| (l.id, l)).collect();
    let samples = profile
        .sample
        .iter()
        .map(|sample| {
            let value = |column: Option<usize>| {
                column
                    .and_then(|c| sample.value.get(c))
                    .copied()
                    .unwrap_or(0) as f64
            };
            let label = |name: &str| {
                sample
                    .label
                    .iter()
                    .find(|l| s(l.key) == name)
                    .map_or(0, |l| l.num.max(0) as u64)
            };
            let inputs =
                interval_inputs_from(INTERVAL_INPUT_LABELS.map(label), profile.period as u64);
            let estimated_bytes = value(alloc_space);
            let time_sampled = sample
                .label
                .iter()
                .any(|l| s(l.key) == OBSERVED_BYTES_LABEL);
            let stats = StackStats {
                samples: label("samples"),
                estimated_bytes,
                observed_bytes: if time_sampled {
                    label(OBSERVED_BYTES_LABEL) as f64
                } else {
                    estimated_bytes
                },
                estimated_objects: value(alloc_objects),
                interval_inputs: inputs,
                inuse_bytes: value(inuse_space),
                inuse_objects: value(inuse_objects),
                inuse_inputs: Default::default(),
                inuse_observed_bytes: 0.0,
            };
            let locations = sample
                .location_id
                .iter()
                .filter_map(|id| location_by_id.get(id))
                .map(|location| chain(location, &functions))
                .collect();
            ReadSample {
                pid: label("pid") as u32,
                locations,
                stats,
                time_sampled,
            }
        })
        .collect();
    ReadProfile {
        rate: profile.period as u64,
        live: inuse_space.is_some(),
        time_nanos: profile.time_nanos,
        duration_nanos: profile.duration_nanos,
        samples,
    }
}

/// The functions of `location`, innermost first.
fn chain(
    location: &Location,
    functions: &HashMap<u64, (String, Option<String>)>,
) -> Vec<FunctionFrame> {
    let unnamed = || format!("0x{:x}", location.address);
    let chain: Vec<FunctionFrame> = location
        .line
        .iter()
        .map(|line| {
            let (name, file) = functions
                .get(&line.function_id)
                .cloned()
                .unwrap_or_else(|| (unnamed(), None));
            let line = (line.line > 0).then_some(line.line as u32);
            // A location without a mapping but with a source file is a runtime's frame
            // (native frames have their module's mapping).
            let shown = match (&file, location.mapping_id) {
                (Some(file), 0) => Some(shown_with_file(&name, file, line)),
                _ => None,
            };
            FunctionFrame {
                name,
                file,
                line,
                shown,
            }
        })
        .collect();
    if chain.is_empty() {
        vec![FunctionFrame {
            name: unnamed(),
            file: None,
            line: None,
            shown: None,
        }]
    } else {
        chain
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pprof::meta::tests::{process_labels, stored_report};
    use crate::pprof::proto::{Function, Label, Line, Sample};
    use crate::pprof::{decode, encode, ProfileMeta};

    #[test]
    fn stacks_read_back_as_written() {
        let report = stored_report();
        let meta = ProfileMeta::of_process(&report, 123, &process_labels());
        let (profile, _) = decode(&encode(&report, &meta)[..], u64::MAX).unwrap();
        let read = read(&profile);
        assert_eq!((read.rate, read.live), (4096, false));
        assert_eq!(read.time_nanos, 123);
        assert_eq!(read.duration_nanos, report.duration.as_nanos() as i64);
        assert_eq!(read.samples.len(), report.stacks.len());
        for (sample, stack) in read.samples.iter().zip(&report.stacks) {
            assert_eq!(sample.pid, 42);
            assert!(sample.time_sampled);
            assert_eq!(sample.stats, stack.stats);
        }
        let functions = |i: usize| -> Vec<Vec<FunctionFrame>> {
            report.stacks[i]
                .locations
                .iter()
                .map(|l| l.functions.to_vec())
                .collect()
        };
        assert_eq!(read.samples[0].locations, functions(0));
        // pprof keys locations by frame: stack 1's leaf is stack 0's frame, and reads
        // back with stack 0's functions.
        assert_eq!(read.samples[1].locations[0], functions(0)[0]);
        assert_eq!(read.samples[1].locations[1], functions(1)[1]);
        assert_eq!(read.samples[2].locations, functions(2));
    }

    /// What a profile does not define reads as addresses and zeros.
    #[test]
    fn missing_functions_and_locations_read_as_addresses() {
        let profile = Profile {
            string_table: ["", "pid", "f"].map(String::from).to_vec(),
            function: vec![Function {
                id: 1,
                name: 2,
                ..Default::default()
            }],
            location: vec![
                Location {
                    id: 1,
                    address: 0xab,
                    line: vec![
                        Line {
                            function_id: 9,
                            line: 4,
                            column: 0,
                        },
                        Line {
                            function_id: 1,
                            line: 0,
                            column: 0,
                        },
                    ],
                    ..Default::default()
                },
                Location {
                    id: 2,
                    address: 0xcd,
                    ..Default::default()
                },
            ],
            sample: vec![Sample {
                location_id: vec![1, 7, 2],
                value: vec![5],
                label: vec![Label {
                    key: 1,
                    num: -3,
                    ..Default::default()
                }],
            }],
            period: 512,
            ..Default::default()
        };
        let read = read(&profile);
        let frame = |name: &str, line| FunctionFrame {
            name: name.to_string(),
            file: None,
            line,
            shown: None,
        };
        let sample = &read.samples[0];
        assert_eq!(
            sample.locations,
            [
                vec![frame("0xab", Some(4)), frame("f", None)],
                vec![frame("0xcd", None)]
            ]
        );
        assert_eq!(sample.pid, 0);
        assert!(!sample.time_sampled);
        // No sample types: no values.
        assert_eq!(sample.stats.estimated_bytes, 0.0);
        assert_eq!((read.rate, read.live), (512, false));
    }
}
