//! OTLP profiles: our pprof profiles as an OpenTelemetry `ExportProfilesServiceRequest`.
//!
//! The profiles signal is alpha: its proto package is `opentelemetry.proto.profiles.
//! v1development`, its OTLP/HTTP path [`HTTP_PATH`] (`/v1development/profiles`, body
//! [`CONTENT_TYPE`], `application/x-protobuf`), and its layout still changes between
//! releases without compatibility. We pin the layout that OpenTelemetry Collector
//! v0.161.0 (pdata v1.67.0) decodes ([`proto`] records how each field was checked);
//! that Collector accepts profiles only with its alpha feature gate
//! `service.profilesSupport` enabled. A receiver of another layout version may reject
//! the request or misread it, so the pin moves only with a re-check of [`proto`].
//!
//! The conversion ([`request_from_pprof`]):
//!
//! - one `ResourceProfiles`, whose resource attributes are the process labels under
//!   their semantic-convention keys ([`resource_from_labels`]), holding one
//!   `ScopeProfiles` of scope [`SCOPE_NAME`] at this crate's version;
//! - one OTLP `Profile` per pprof sample type (`alloc_objects/count`,
//!   `alloc_space/bytes` and, with live tracking, `inuse_objects/count`,
//!   `inuse_space/bytes`): an OTLP profile has exactly one sample type, where a pprof
//!   sample carries one value per type. Each profile holds the pprof samples whose
//!   value of its type is non-zero, one value each, so a consumer summing a profile
//!   gets that type's pprof total. Values stay as pprof has them: unbiased estimates,
//!   not to be rescaled by the period.
//! - the profiles share one dictionary (strings, stacks, locations, functions,
//!   mappings, attributes): a stack common to the four profiles is sent once. pprof's
//!   nonzero ids (not necessarily 1..n) become table indices; index 0 of every table is
//!   the zero entry and means "unset", so an id pprof leaves at 0 (no mapping) stays 0.
//! - pprof sample labels become sample attributes under the same keys (numbers as
//!   integers with their `num_unit`, in UCUM where one exists: `bytes` is `By`),
//!   except string labels repeating a resource label (the agent's per-process labels):
//!   those are on the resource already.
//! - mappings carry the GNU build id as `process.executable.build_id.gnu` and pprof's
//!   `has_*` flags as `pprof.mapping.has_*`; folded locations `pprof.location.is_folded`;
//!   the comments become the profile attribute `pprof.profile.comment` (a string array:
//!   this layout has no comment field); the default sample type the scope attribute
//!   `pprof.scope.default_sample_type` (the `pprof.*` keys are the semantic
//!   conventions' pprof compatibility attributes).
//! - no trace links, timestamps or original payload.
//!
//! [`totals_by_type`] and [`stacks`] read a request back through its dictionary.

mod dictionary;
pub mod proto;
mod read;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};

use prost::Message;

use self::dictionary::{Dictionary, Value};
use self::proto::{
    any_value, AnyValue, ExportProfilesServiceRequest, Function, InstrumentationScope, KeyValue,
    Line, Location, Mapping, Profile, ProfilesDictionary, Resource, ResourceProfiles, Sample,
    ScopeProfiles, ValueType,
};
use crate::pprof::proto as pprof;

pub use self::read::{stacks, totals_by_type};

/// The OTLP/HTTP path of profile exports, under the receiver's base URL.
pub const HTTP_PATH: &str = "/v1development/profiles";

/// The content type of an [`encode`]d request posted to [`HTTP_PATH`].
pub const CONTENT_TYPE: &str = "application/x-protobuf";

/// The instrumentation scope's name; its version is this crate's.
pub const SCOPE_NAME: &str = "allocbpf";

/// Our process labels (as `allocbpf_collect`'s `ProcessInfo::labels` names them) and
/// the semantic-convention resource attribute each becomes. `exe` also gives
/// `process.executable.name` (the semantic conventions define it as the base name of
/// `/proc/PID/exe`'s target); `comm` (`/proc/PID/comm`, which a process may change
/// and which is cut at 15 bytes) fills it only when there is no `exe`, and is kept
/// under `comm` otherwise.
pub const RESOURCE_KEYS: [(&str, &str); 8] = [
    ("hostname", "host.name"),
    ("pid", "process.pid"),
    ("comm", "process.executable.name"),
    ("exe", "process.executable.path"),
    ("exe_build_id", "process.executable.build_id.gnu"),
    // The value is the cgroup v2 path; the convention wants /proc/PID/cgroup's text,
    // whose line for that path is `0::PATH`, so the path gets that prefix.
    ("cgroup", "process.linux.cgroup"),
    ("container_id", "container.id"),
    ("service_name", "service.name"),
];

/// The OTLP resource of a process's labels: [`RESOURCE_KEYS`] under their
/// semantic-convention keys (`process.pid` an integer; a pid that does not parse stays
/// a string under `pid`), any other label under its own key as a string. Empty values
/// are left out; of two values for one key, the first is kept (resource keys are
/// unique).
pub fn resource_from_labels<K: AsRef<str>, V: AsRef<str>>(labels: &[(K, V)]) -> Resource {
    let labels: Vec<(&str, &str)> = labels
        .iter()
        .map(|(k, v)| (k.as_ref(), v.as_ref()))
        .filter(|(_, v)| !v.is_empty())
        .collect();
    let has_exe = labels.iter().any(|(k, _)| *k == "exe");
    let mut attributes: Vec<KeyValue> = Vec::new();
    let mut push = |key: &str, value: any_value::Value| {
        if !attributes.iter().any(|a| a.key == key) {
            attributes.push(KeyValue {
                key: key.to_string(),
                value: Some(AnyValue { value: Some(value) }),
                key_strindex: 0,
            });
        }
    };
    let string = |s: &str| any_value::Value::StringValue(s.to_string());
    for (key, value) in labels {
        let semconv = RESOURCE_KEYS
            .iter()
            .find(|(ours, _)| *ours == key)
            .map(|(_, theirs)| *theirs);
        match (key, semconv) {
            ("pid", Some(semconv)) => match value.parse::<i64>() {
                Ok(pid) => push(semconv, any_value::Value::IntValue(pid)),
                Err(_) => push(key, string(value)),
            },
            ("exe", Some(semconv)) => {
                push(semconv, string(value));
                let name = value.rsplit('/').next().unwrap_or(value);
                if !name.is_empty() {
                    push("process.executable.name", string(name));
                }
            }
            ("comm", Some(semconv)) if !has_exe => push(semconv, string(value)),
            ("comm", Some(_)) => push(key, string(value)),
            ("cgroup", Some(semconv)) if value.starts_with('/') => {
                push(semconv, string(&format!("0::{value}")))
            }
            (_, Some(semconv)) => push(semconv, string(value)),
            (_, None) => push(key, string(value)),
        }
    }
    Resource {
        attributes,
        dropped_attributes_count: 0,
    }
}

/// Converts a pprof profile (as [`crate::pprof::encode`] makes them) to an OTLP export
/// request, as the module documentation describes.
///
/// `resource` is the process's labels ([`resource_from_labels`]). `start_unix_nanos`
/// and `duration_nanos` are the profile's collection start and length; 0 takes the
/// pprof's `time_nanos` and `duration_nanos` instead.
///
/// Each profile's id is derived from its content (a 128-bit FNV-1a hash of the encoded
/// resource and profile): sending the same profile again, as a retry does, repeats
/// its id, which receivers MAY use to deduplicate.
pub fn request_from_pprof<K: AsRef<str>, V: AsRef<str>>(
    profile: &pprof::Profile,
    resource: &[(K, V)],
    start_unix_nanos: u64,
    duration_nanos: u64,
) -> ExportProfilesServiceRequest {
    let resource_pairs: HashSet<(&str, &str)> = resource
        .iter()
        .map(|(k, v)| (k.as_ref(), v.as_ref()))
        .collect();
    let mut converter = Converter::new(profile);
    let sample_attributes: Vec<Vec<i32>> = profile
        .sample
        .iter()
        .map(|sample| converter.sample_attributes(sample, &resource_pairs))
        .collect();
    let stack_indices: Vec<i32> = profile
        .sample
        .iter()
        .map(|sample| converter.stack(sample))
        .collect();
    let profile_attributes = converter.profile_attributes();
    let text = |i: i64| text(profile, i);
    let time_unix_nano = match start_unix_nanos {
        0 => u64::try_from(profile.time_nanos).unwrap_or(0),
        t => t,
    };
    let duration_nano = match duration_nanos {
        0 => u64::try_from(profile.duration_nanos).unwrap_or(0),
        d => d,
    };
    let dict = &mut converter.dict;
    let period_type = profile.period_type.as_ref().map(|t| ValueType {
        type_strindex: dict.string(text(t.r#type)),
        unit_strindex: dict.string(text(t.unit)),
    });
    let resource = resource_from_labels(resource);
    let resource_bytes = resource.encode_to_vec();
    let profiles = profile
        .sample_type
        .iter()
        .enumerate()
        .map(|(type_index, sample_type)| {
            let samples = samples_of_type(profile, type_index, &stack_indices, &sample_attributes);
            let mut otlp = Profile {
                sample_type: Some(ValueType {
                    type_strindex: dict.string(text(sample_type.r#type)),
                    unit_strindex: dict.string(text(sample_type.unit)),
                }),
                samples,
                time_unix_nano,
                duration_nano,
                period_type: period_type.clone(),
                period: profile.period,
                profile_id: Vec::new(),
                dropped_attributes_count: 0,
                original_payload_format: String::new(),
                original_payload: Vec::new(),
                attribute_indices: profile_attributes.clone(),
            };
            otlp.profile_id = profile_id(&resource_bytes, &otlp.encode_to_vec()).to_vec();
            otlp
        })
        .collect();
    let scope_attributes = scope_attributes(text(profile.default_sample_type));
    one_scope_request(
        resource,
        scope_attributes,
        profiles,
        converter.dict.finish(),
    )
}

/// The samples of `profile` with a non-zero value of sample type `type_index`, one
/// value each (an OTLP profile has one sample type), with the stack and attributes
/// each was given (`stack_indices`, `sample_attributes`: by sample).
fn samples_of_type(
    profile: &pprof::Profile,
    type_index: usize,
    stack_indices: &[i32],
    sample_attributes: &[Vec<i32>],
) -> Vec<Sample> {
    profile
        .sample
        .iter()
        .enumerate()
        .filter_map(|(i, sample)| {
            // A sample without a value for this type has none to report.
            let value = *sample.value.get(type_index)?;
            (value != 0).then(|| Sample {
                stack_index: stack_indices[i],
                attribute_indices: sample_attributes[i].clone(),
                link_index: 0,
                values: vec![value],
                timestamps_unix_nano: Vec::new(),
            })
        })
        .collect()
}

/// The scope's attributes: pprof's default sample type, when it names one (this
/// layout has no field for it).
fn scope_attributes(default_sample_type: &str) -> Vec<KeyValue> {
    match default_sample_type {
        "" => Vec::new(),
        default => vec![KeyValue {
            key: "pprof.scope.default_sample_type".to_string(),
            value: Some(AnyValue {
                value: Some(any_value::Value::StringValue(default.to_string())),
            }),
            key_strindex: 0,
        }],
    }
}

/// The request holding `profiles` of one `resource` under our one instrumentation
/// scope (with `scope_attributes`), and the `dictionary` they share.
fn one_scope_request(
    resource: Resource,
    scope_attributes: Vec<KeyValue>,
    profiles: Vec<Profile>,
    dictionary: ProfilesDictionary,
) -> ExportProfilesServiceRequest {
    ExportProfilesServiceRequest {
        resource_profiles: vec![ResourceProfiles {
            resource: Some(resource),
            scope_profiles: vec![ScopeProfiles {
                scope: Some(InstrumentationScope {
                    name: SCOPE_NAME.to_string(),
                    version: env!("CARGO_PKG_VERSION").to_string(),
                    attributes: scope_attributes,
                    dropped_attributes_count: 0,
                }),
                profiles,
                schema_url: String::new(),
            }],
            schema_url: String::new(),
        }],
        dictionary: Some(dictionary),
    }
}

/// Encodes a request (the body of an OTLP/HTTP export, uncompressed).
pub fn encode(request: &ExportProfilesServiceRequest) -> Vec<u8> {
    request.encode_to_vec()
}

/// Decodes a request; malformed bytes are an error, never a panic.
pub fn decode(bytes: &[u8]) -> Result<ExportProfilesServiceRequest, prost::DecodeError> {
    ExportProfilesServiceRequest::decode(bytes)
}

/// pprof string `i`, or "" if the index is out of the table.
fn text(profile: &pprof::Profile, i: i64) -> &str {
    usize::try_from(i)
        .ok()
        .and_then(|i| profile.string_table.get(i))
        .map_or("", String::as_str)
}

/// A nonzero 16-byte id from a profile's content: 128-bit FNV-1a of `parts`.
fn profile_id(resource: &[u8], profile: &[u8]) -> [u8; 16] {
    const OFFSET: u128 = 0x6c62272e07bb014262b821756295c58d;
    const PRIME: u128 = 0x0000000001000000000000000000013b;
    let hash = resource
        .iter()
        .chain(profile)
        .fold(OFFSET, |h, &b| (h ^ u128::from(b)).wrapping_mul(PRIME));
    // All zeroes is an invalid id; a hash that lands there (never, in practice) moves.
    hash.max(1).to_be_bytes()
}

/// The UCUM spelling of a pprof unit, where it has one (attribute units SHOULD be UCUM).
fn ucum(unit: &str) -> &str {
    match unit {
        "bytes" => "By",
        "nanoseconds" => "ns",
        "microseconds" => "us",
        "milliseconds" => "ms",
        "seconds" => "s",
        other => other,
    }
}

/// The pprof profile's tables as dictionary indices (pprof id → OTLP index).
struct Converter<'a> {
    profile: &'a pprof::Profile,
    dict: Dictionary,
    locations: HashMap<u64, i32>,
}

impl<'a> Converter<'a> {
    /// Interns the profile's functions, mappings and locations.
    fn new(profile: &'a pprof::Profile) -> Self {
        let mut dict = Dictionary::new();
        let text = |i| text(profile, i);
        let functions: HashMap<u64, i32> = profile
            .function
            .iter()
            .map(|f| {
                let function = Function {
                    name_strindex: dict.string(text(f.name)),
                    system_name_strindex: dict.string(text(f.system_name)),
                    filename_strindex: dict.string(text(f.filename)),
                    start_line: f.start_line,
                };
                (f.id, dict.function(function))
            })
            .collect();
        let mappings: HashMap<u64, i32> = profile
            .mapping
            .iter()
            .map(|m| {
                let mut attribute_indices = Vec::new();
                let build_id = text(m.build_id);
                if !build_id.is_empty() {
                    attribute_indices.push(dict.attribute(
                        "process.executable.build_id.gnu",
                        Value::Str(build_id.to_string()),
                        "",
                    ));
                }
                let flags = [
                    ("pprof.mapping.has_functions", m.has_functions),
                    ("pprof.mapping.has_filenames", m.has_filenames),
                    ("pprof.mapping.has_line_numbers", m.has_line_numbers),
                    ("pprof.mapping.has_inline_frames", m.has_inline_frames),
                ];
                for (key, _) in flags.iter().filter(|(_, set)| *set) {
                    attribute_indices.push(dict.attribute(key, Value::Bool(true), ""));
                }
                let mapping = Mapping {
                    memory_start: m.memory_start,
                    memory_limit: m.memory_limit,
                    file_offset: m.file_offset,
                    filename_strindex: dict.string(text(m.filename)),
                    attribute_indices,
                };
                (m.id, dict.mapping(mapping))
            })
            .collect();
        // An id pprof does not define (0 included) is "unset": index 0.
        let locations = profile
            .location
            .iter()
            .map(|l| {
                let location = Location {
                    mapping_index: mappings.get(&l.mapping_id).copied().unwrap_or(0),
                    address: l.address,
                    lines: l
                        .line
                        .iter()
                        .map(|line| Line {
                            function_index: functions.get(&line.function_id).copied().unwrap_or(0),
                            line: line.line,
                            column: line.column,
                        })
                        .collect(),
                    attribute_indices: if l.is_folded {
                        vec![dict.attribute("pprof.location.is_folded", Value::Bool(true), "")]
                    } else {
                        Vec::new()
                    },
                };
                (l.id, dict.location(location))
            })
            .collect();
        Self {
            profile,
            dict,
            locations,
        }
    }

    /// The stack index of `sample`'s locations (leaf first, as in pprof). A location
    /// id pprof does not define becomes the zero location: an unknown frame.
    fn stack(&mut self, sample: &pprof::Sample) -> i32 {
        let indices = sample
            .location_id
            .iter()
            .map(|id| self.locations.get(id).copied().unwrap_or(0))
            .collect();
        self.dict.stack(indices)
    }

    /// `sample`'s labels as attribute indices, but for string labels that are
    /// `resource` pairs. Keys stay unique, as attribute_indices must keep them: of
    /// two labels with one key, the first is kept.
    fn sample_attributes(
        &mut self,
        sample: &pprof::Sample,
        resource: &HashSet<(&str, &str)>,
    ) -> Vec<i32> {
        let mut keys = HashSet::new();
        let mut indices = Vec::new();
        for label in &sample.label {
            let key = text(self.profile, label.key);
            let value = match text(self.profile, label.str) {
                "" => Value::Int(label.num),
                s if resource.contains(&(key, s)) => continue,
                s => Value::Str(s.to_string()),
            };
            if key.is_empty() || !keys.insert(key) {
                continue;
            }
            let unit = ucum(text(self.profile, label.num_unit));
            indices.push(self.dict.attribute(key, value, unit));
        }
        indices
    }

    /// The attributes every profile carries: pprof's comments, drop and keep frames.
    fn profile_attributes(&mut self) -> Vec<i32> {
        let profile = self.profile;
        let comments: Vec<String> = profile
            .comment
            .iter()
            .map(|&i| text(profile, i).to_string())
            .collect();
        let mut indices = Vec::new();
        if !comments.is_empty() {
            indices.push(
                self.dict
                    .attribute("pprof.profile.comment", Value::Strs(comments), ""),
            );
        }
        for (key, i) in [
            ("pprof.profile.drop_frames", profile.drop_frames),
            ("pprof.profile.keep_frames", profile.keep_frames),
        ] {
            let regexp = text(profile, i);
            if !regexp.is_empty() {
                indices.push(self.dict.attribute(key, Value::Str(regexp.to_string()), ""));
            }
        }
        indices
    }
}
