//! gzipped pprof `profile.proto` in Go's heap-profile conventions.
//!
//! - sample types `alloc_objects/count`, `alloc_space/bytes`, and with live tracking
//!   `inuse_objects/count`, `inuse_space/bytes` (Go's order, so `go tool pprof`
//!   recognises a heap profile and opens on inuse_space); values are ALREADY unbiased:
//!   readers must not rescale them.
//! - period type `space/bytes`, period = the mean sampling interval.
//! - one mapping per module, with its path and build id; each module is laid out at a
//!   synthetic base `(i + 1) << 40` with `file_offset = 0`, so `address - memory_start`
//!   is the file offset a remote symbolizer needs.
//! - every sample carries a numeric `pid` label, a `samples` label (raw sample count) and
//!   its confidence interval as two numeric labels in bytes, `bytes_ci95_low` and
//!   `bytes_ci95_high` (the number is the confidence level in percent). Numeric
//!   labels are what pprof readers keep per sample: `go tool pprof -tags` and `-raw`
//!   show them; they do not change values, so every other view is unaffected.
//! - the profile comment states the rate, the level, and the total's interval.
//! - unsymbolized reports: locations carry addresses only (no lines, no functions) and the
//!   mappings say so, for a symbolizer that works from build ids.
//! - the agent's stored profiles also carry their process's labels and exact totals
//!   ([`ProfileMeta`]: [`encode`] writes them, [`decode`] reads them back); [`read`]
//!   turns a profile's samples back into stacks.

mod meta;
pub mod proto;
mod read;

use std::{
    collections::HashMap,
    io::{Read, Write},
    path::Path,
};

use flate2::{write::GzEncoder, Compression};
use prost::Message;

pub use self::meta::{
    decode, decode_path, encode, ProfileMeta, EXACT_BYTES_COMMENT, EXACT_CALLS_COMMENT,
    OBSERVED_FRACTION_LABEL, PER_INTERVAL_LABELS,
};
use self::proto::{Function, Label, Line, Location, Mapping, Profile, Sample, ValueType};
pub use self::read::{read, ReadProfile, ReadSample};
use allocbpf_profile::estimate::IntervalInputs;
use allocbpf_profile::{
    frame::{Frame, FunctionFrame},
    report::{Location as ReportLocation, Report, StackReport},
};

/// Address-space size reserved per module in the synthetic layout.
const MODULE_SPAN: u64 = 1 << 40;

/// Builds profile.proto's string table.
#[derive(Default)]
struct Strings {
    table: Vec<String>,
    index: HashMap<String, i64>,
}

impl Strings {
    fn new() -> Self {
        let mut s = Self::default();
        s.intern("");
        s
    }

    fn intern(&mut self, value: &str) -> i64 {
        if let Some(&i) = self.index.get(value) {
            return i;
        }
        let i = self.table.len() as i64;
        self.table.push(value.to_string());
        self.index.insert(value.to_string(), i);
        i
    }
}

/// Numeric labels carrying each stack's confidence-interval inputs, so profiles read
/// back from the agent's store (`allocbpf report`) merge with exact intervals.
pub const INTERVAL_INPUT_LABELS: [&str; 6] = [
    "ci_counted_samples",
    "ci_untried_bytes",
    "ci_sampled_bytes",
    "ci_certain_bytes",
    "ci_rate_sum",
    "ci_rate_scale",
];

/// Numeric label of a time-sampled profile's samples: the stack's byte estimate before
/// time weighting (what its byte-sampling interval is scaled from; see
/// `StackStats::observed_bytes`). Absent when the profile was observed full time.
pub const OBSERVED_BYTES_LABEL: &str = "observed_bytes";

/// The values of [`INTERVAL_INPUT_LABELS`], in order. The mean intervals' sums go as
/// their sum `Σ R_i` and the scale `Σ R_i² / Σ R_i` (a mean interval, so that neither
/// overflows a label): [`interval_inputs_from`] undoes it.
pub fn interval_input_values(inputs: &IntervalInputs) -> [u64; 6] {
    let scale = if inputs.rate_sum > 0.0 {
        inputs.rate_square_sum / inputs.rate_sum
    } else {
        0.0
    };
    [
        inputs.counted_samples,
        inputs.untried_bytes,
        inputs.sampled_bytes,
        inputs.certain_bytes,
        inputs.rate_sum.round() as u64,
        scale.round() as u64,
    ]
}

/// The inverse of [`interval_input_values`]; a profile written before the rates were
/// labelled (both 0) has its samples counted at `rate`.
pub fn interval_inputs_from(values: [u64; 6], rate: u64) -> IntervalInputs {
    let [counted, untried, sampled, certain, rate_sum, scale] = values;
    let (rate_sum, scale) = if rate_sum == 0 || scale == 0 {
        (counted as f64 * rate as f64, rate as f64)
    } else {
        (rate_sum as f64, scale as f64)
    };
    IntervalInputs {
        counted_samples: counted,
        untried_bytes: untried,
        sampled_bytes: sampled,
        certain_bytes: certain,
        rate_sum,
        rate_square_sum: rate_sum * scale,
    }
}

/// Converts a report to a `Profile` message.
pub(crate) fn to_profile(report: &Report, time_nanos: i64) -> Profile {
    // The string table's order follows the order things are interned in below.
    let mut strings = Strings::new();
    let live = report.live.is_some();
    let mut sample_type = vec![
        value_type(&mut strings, "alloc_objects", "count"),
        value_type(&mut strings, "alloc_space", "bytes"),
    ];
    if live {
        // Go's heap profile order: alloc_objects, alloc_space, inuse_objects, inuse_space.
        sample_type.push(value_type(&mut strings, "inuse_objects", "count"));
        sample_type.push(value_type(&mut strings, "inuse_space", "bytes"));
    }
    let period_type = Some(value_type(&mut strings, "space", "bytes"));
    let mapping = mappings(report, &mut strings);
    let mut builder = SampleBuilder::new(report, strings);
    let samples = report
        .stacks
        .iter()
        .map(|stack| builder.sample(stack))
        .collect();
    let SampleBuilder {
        mut strings,
        function_list,
        location_list,
        ..
    } = builder;
    let comment = vec![strings.intern(&summary_comment(report))];
    // Go's heap profiles open on inuse_space when they have it.
    let default_sample_type = strings.intern(if live { "inuse_space" } else { "alloc_space" });
    Profile {
        sample_type,
        sample: samples,
        mapping,
        location: location_list,
        function: function_list,
        string_table: strings.table,
        drop_frames: 0,
        keep_frames: 0,
        time_nanos,
        duration_nanos: report.duration.as_nanos() as i64,
        period_type,
        period: report.rate as i64,
        comment,
        default_sample_type,
    }
}

fn value_type(strings: &mut Strings, t: &str, u: &str) -> ValueType {
    ValueType {
        r#type: strings.intern(t),
        unit: strings.intern(u),
    }
}

/// One mapping per module the report's stacks use. Only those: the module table is
/// shared by every process the agent saw, and another tenant's binaries are none of
/// this profile's business (nor its size's).
fn mappings(report: &Report, strings: &mut Strings) -> Vec<Mapping> {
    let used: std::collections::HashSet<u32> = report
        .stacks
        .iter()
        .flat_map(|stack| &stack.locations)
        .filter_map(|location| location.frame.module())
        .collect();
    report
        .modules
        .iter()
        .enumerate()
        .filter(|(i, _)| used.contains(&(*i as u32)))
        .map(|(i, module)| Mapping {
            id: i as u64 + 1,
            memory_start: (i as u64 + 1) * MODULE_SPAN,
            memory_limit: (i as u64 + 2) * MODULE_SPAN,
            file_offset: 0,
            filename: strings.intern(&module.path.display().to_string()),
            build_id: strings.intern(&module.build_id_hex()),
            has_functions: report.symbolized,
            has_filenames: report.symbolized,
            has_line_numbers: report.symbolized,
            has_inline_frames: report.symbolized,
        })
        .collect()
}

/// The profile's comment: how to read its values.
fn summary_comment(report: &Report) -> String {
    let level = report.confidence.percent_label();
    let total = report.total_interval();
    if let Some(time) = &report.time_sampling {
        let pace = time
            .observer_effect()
            .map(|effect| format!("; {effect}"))
            .unwrap_or_default();
        return format!(
            "allocbpf: Poisson byte sampling, mean interval {} bytes, and time sampling under an \
             overhead budget: observed {:.2}% of the interval (one window per period at a random \
             phase); values are unbiased estimates for the whole interval; total {:.0} bytes, \
             {level}% CI [{:.0}, {:.0}] {}; per-sample {level}% intervals in \
             labels bytes_ci{level}_low/high cover byte sampling in the observed windows only; \
             exact totals {} bytes in {} calls count only calls made while probes were attached{pace}",
            report.rate,
            time.observed_fraction * 100.0,
            report.totals.estimated_bytes,
            total.lo,
            total.hi,
            if report.total_interval_includes_time() {
                "including time sampling"
            } else {
                "of byte sampling (too few periods or samples for time sampling's)"
            },
            report.totals.exact_bytes,
            report.totals.exact_calls
        );
    }
    format!(
        "allocbpf: Poisson byte sampling, mean interval {} bytes; values are unbiased estimates; \
         total {:.0} bytes, {level}% CI [{:.0}, {:.0}]; exact totals {} bytes in {} calls; \
         per-sample {level}% intervals in labels bytes_ci{level}_low/high",
        report.rate,
        report.totals.estimated_bytes,
        total.lo,
        total.hi,
        report.totals.exact_bytes,
        report.totals.exact_calls
    )
}

/// Samples, with the locations and functions they refer to, each interned once.
struct SampleBuilder<'a> {
    report: &'a Report,
    strings: Strings,
    functions: HashMap<(String, Option<String>), u64>,
    function_list: Vec<Function>,
    locations: HashMap<Frame, u64>,
    location_list: Vec<Location>,
    pid_key: i64,
    samples_key: i64,
    ci_low_key: i64,
    ci_high_key: i64,
    bytes_unit: i64,
    input_keys: [i64; 6],
    /// Time-sampled profiles only.
    observed_key: Option<i64>,
}

impl<'a> SampleBuilder<'a> {
    fn new(report: &'a Report, mut strings: Strings) -> Self {
        let level = report.confidence.percent_label();
        SampleBuilder {
            report,
            pid_key: strings.intern("pid"),
            samples_key: strings.intern("samples"),
            ci_low_key: strings.intern(&format!("bytes_ci{level}_low")),
            ci_high_key: strings.intern(&format!("bytes_ci{level}_high")),
            bytes_unit: strings.intern("bytes"),
            input_keys: INTERVAL_INPUT_LABELS.map(|name| strings.intern(name)),
            observed_key: report
                .time_sampling
                .is_some()
                .then(|| strings.intern(OBSERVED_BYTES_LABEL)),
            strings,
            functions: HashMap::new(),
            function_list: Vec::new(),
            locations: HashMap::new(),
            location_list: Vec::new(),
        }
    }

    /// One stack's sample: its locations, values and labels.
    fn sample(&mut self, stack: &StackReport) -> Sample {
        let location_id = stack
            .locations
            .iter()
            .map(|location| self.location_id(location))
            .collect();
        let stats = &stack.stats;
        let interval = self.report.interval(stats);
        let bytes_unit = self.bytes_unit;
        let bytes_label = |key, value: f64| Label {
            key,
            num: value.round() as i64,
            num_unit: bytes_unit,
            ..Label::default()
        };
        let mut value = vec![
            stats.estimated_objects.round() as i64,
            stats.estimated_bytes.round() as i64,
        ];
        if self.report.live.is_some() {
            value.push(stats.inuse_objects.round() as i64);
            value.push(stats.inuse_bytes.round() as i64);
        }
        let count_label = |key, num: u64| Label {
            key,
            num: num as i64,
            ..Label::default()
        };
        Sample {
            location_id,
            value,
            label: [
                count_label(self.pid_key, u64::from(stack.pid)),
                count_label(self.samples_key, stats.samples),
                bytes_label(self.ci_low_key, interval.lo),
                bytes_label(self.ci_high_key, interval.hi),
            ]
            .into_iter()
            .chain(
                self.input_keys
                    .iter()
                    .zip(interval_input_values(&stats.interval_inputs))
                    .map(|(&key, num)| count_label(key, num)),
            )
            .chain(
                self.observed_key
                    .map(|key| bytes_label(key, stats.observed_bytes)),
            )
            .collect(),
        }
    }

    /// The id of `location`'s pprof location, added at its first use.
    fn location_id(&mut self, location: &ReportLocation) -> u64 {
        if let Some(&id) = self.locations.get(&location.frame) {
            return id;
        }
        // Unsymbolized profiles: addresses and mappings (with build ids) only.
        let shown: &[_] = if self.report.symbolized {
            &location.functions
        } else {
            &[]
        };
        let line = shown
            .iter()
            .map(|f| Line {
                function_id: self.function_id(f),
                line: f.line.unwrap_or(0) as i64,
                column: 0,
            })
            .collect();
        let (mapping_id, address) = match location.frame {
            Frame::Module { module, offset } => (
                module as u64 + 1,
                (module as u64 + 1) * MODULE_SPAN + offset,
            ),
            Frame::Unknown(addr) => (0, addr),
            Frame::Lost | Frame::Runtime(_) => (0, 0),
        };
        let id = self.location_list.len() as u64 + 1;
        self.location_list.push(Location {
            id,
            mapping_id,
            address,
            line,
            is_folded: false,
        });
        self.locations.insert(location.frame, id);
        id
    }

    /// The id of function `f` (by name and file), added at its first use.
    fn function_id(&mut self, f: &FunctionFrame) -> u64 {
        let key = (f.name.clone(), f.file.clone());
        if let Some(&id) = self.functions.get(&key) {
            return id;
        }
        let id = self.function_list.len() as u64 + 1;
        let name = self.strings.intern(&f.name);
        self.function_list.push(Function {
            id,
            name,
            system_name: name,
            filename: self.strings.intern(f.file.as_deref().unwrap_or("")),
            start_line: 0,
        });
        self.functions.insert(key, id);
        id
    }
}

/// Why a file is not a gzipped pprof profile.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The file cannot be opened or read.
    #[error(transparent)]
    Open(std::io::Error),
    /// It is not gzip.
    #[error("not gzip")]
    NotGzip(#[source] std::io::Error),
    /// Its content is not a pprof profile.
    #[error("not a pprof profile")]
    NotPprof(#[source] prost::DecodeError),
    /// It decompresses to more than the bound given.
    #[error("larger than {0} bytes decompressed")]
    TooLarge(u64),
}

/// Reads a gzipped pprof profile (as [`write()`] writes them).
pub fn decode_file(path: &Path) -> Result<Profile, DecodeError> {
    let file = std::fs::File::open(path).map_err(DecodeError::Open)?;
    decode_gzipped(file, u64::MAX)
}

/// Decodes a gzipped pprof profile of at most `max_bytes` decompressed (a larger one is
/// [`DecodeError::TooLarge`]: a bound on what a corrupt or hostile input can take).
pub fn decode_gzipped(gzipped: impl Read, max_bytes: u64) -> Result<Profile, DecodeError> {
    let mut bytes = Vec::new();
    flate2::read::GzDecoder::new(gzipped)
        .take(max_bytes.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(DecodeError::NotGzip)?;
    if bytes.len() as u64 > max_bytes {
        return Err(DecodeError::TooLarge(max_bytes));
    }
    Profile::decode(&*bytes).map_err(DecodeError::NotPprof)
}

/// Adds string labels to every sample and as `key=value` comments: the process labels
/// of the agent's per-process profiles (hostname, pid, comm, exe, build ids, cgroup).
pub(crate) fn add_labels<K: AsRef<str>, V: AsRef<str>>(profile: &mut Profile, labels: &[(K, V)]) {
    let mut intern = |value: &str| -> i64 {
        match profile.string_table.iter().position(|s| s == value) {
            Some(i) => i as i64,
            None => {
                profile.string_table.push(value.to_string());
                profile.string_table.len() as i64 - 1
            }
        }
    };
    let pairs: Vec<(i64, i64)> = labels
        .iter()
        .map(|(key, value)| (key.as_ref(), value.as_ref()))
        // The numeric pid label is already there.
        .filter(|(key, value)| *key != "pid" && !value.is_empty())
        .map(|(key, value)| (intern(key), intern(value)))
        .collect();
    let comments: Vec<i64> = labels
        .iter()
        .map(|(key, value)| intern(&format!("{}={}", key.as_ref(), value.as_ref())))
        .collect();
    for sample in &mut profile.sample {
        sample.label.extend(pairs.iter().map(|&(key, str)| Label {
            key,
            str,
            ..Default::default()
        }));
    }
    profile.comment.extend(comments);
}

/// Adds one comment line to a profile.
pub(crate) fn add_comment(profile: &mut Profile, text: &str) {
    profile.string_table.push(text.to_string());
    profile.comment.push(profile.string_table.len() as i64 - 1);
}

/// Gzips an encoded profile.
pub fn gzip(profile: &Profile) -> Vec<u8> {
    let mut gz = GzEncoder::new(Vec::new(), Compression::default());
    gz.write_all(&profile.encode_to_vec())
        .expect("writing to a Vec cannot fail");
    gz.finish().expect("writing to a Vec cannot fail")
}

/// Writes the report as a gzipped profile.proto: [`encode`] without labels or exact
/// totals' comments, started `report.duration` ago.
pub fn write(report: &Report, out: &mut dyn Write) -> std::io::Result<()> {
    let time_nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64 - report.duration.as_nanos() as i64)
        .unwrap_or(0);
    let meta = ProfileMeta {
        time_nanos,
        ..ProfileMeta::default()
    };
    out.write_all(&encode(report, &meta))
}

#[cfg(test)]
mod tests;
