//! What the collector received: its file exporter's OTLP JSON lines parsed into
//! profiles with every dictionary index resolved.

use std::collections::BTreeMap;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::protojson::{array, int, string, uint};

/// One profile as received, with every index resolved.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReceivedProfile {
    /// Which export request (line of the output, 0-based, over restarts) carried it.
    pub request: usize,
    /// The resource's attributes; values as strings (ints in decimal, bools
    /// `true`/`false`).
    pub resource: BTreeMap<String, String>,
    /// The instrumentation scope's name.
    pub scope_name: String,
    /// The instrumentation scope's version.
    pub scope_version: String,
    /// The sample type (`alloc_space`...).
    pub sample_type: String,
    /// Its unit (`bytes`...).
    pub sample_unit: String,
    /// The period type.
    pub period_type: String,
    /// The period's unit.
    pub period_unit: String,
    /// The period.
    pub period: i64,
    /// Start time, ns since the epoch.
    pub time_unix_nano: u64,
    /// Duration in ns.
    pub duration_nano: u64,
    /// The profile id as in the JSON (hex), empty if none.
    pub profile_id: String,
    /// The profile's attributes (through the attribute table).
    pub attributes: BTreeMap<String, String>,
    /// The samples.
    pub samples: Vec<ReceivedSample>,
}

impl ReceivedProfile {
    /// The sum of every value of every sample.
    pub fn total(&self) -> i64 {
        self.samples.iter().flat_map(|s| &s.values).sum()
    }
}

/// One sample.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReceivedSample {
    /// Function names, leaf first (inlined functions before their callers); a location
    /// without lines is its address, `0x...`.
    pub stack: Vec<String>,
    /// The same frames with file, line and address.
    pub frames: Vec<ReceivedFrame>,
    /// The values.
    pub values: Vec<i64>,
    /// The sample's attributes (through the attribute table).
    pub attributes: BTreeMap<String, String>,
    /// Its timestamps, if any.
    pub timestamps_unix_nano: Vec<u64>,
}

/// One frame of a sample's stack.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReceivedFrame {
    /// The function's name (or the address, `0x...`, for a location without lines).
    pub function: String,
    /// The function's file name.
    pub file: String,
    /// The line number.
    pub line: i64,
    /// The location's address.
    pub address: u64,
}

/// Parses the exporter's output: one OTLP JSON `ExportProfilesServiceRequest` per line
/// (a last line without its newline is left out).
pub fn parse_received(text: &str) -> Result<Vec<ReceivedProfile>> {
    let mut profiles = Vec::new();
    for (index, line) in complete_lines(text).enumerate() {
        let request: Value =
            serde_json::from_str(line).with_context(|| format!("request {index} is not JSON"))?;
        profiles.extend(parse_export_request(&request, index)?);
    }
    Ok(profiles)
}

/// The profiles of one OTLP JSON `ExportProfilesServiceRequest` (request number
/// `request`). Missing fields are 0 or empty, as OTLP JSON omits them; an index out of
/// its table is an error.
pub fn parse_export_request(request: &Value, index: usize) -> Result<Vec<ReceivedProfile>> {
    let dictionary = Dictionary::new(&request["dictionary"]);
    let mut profiles = Vec::new();
    for resource_profiles in array(&request["resourceProfiles"]) {
        let resource = dictionary.key_values(&resource_profiles["resource"]["attributes"])?;
        for scope_profiles in array(&resource_profiles["scopeProfiles"]) {
            let scope = &scope_profiles["scope"];
            for profile in array(&scope_profiles["profiles"]) {
                let mut samples = Vec::new();
                for sample in array(&profile["samples"]) {
                    let frames = dictionary.stack(int(&sample["stackIndex"]))?;
                    samples.push(ReceivedSample {
                        stack: frames.iter().map(|f| f.function.clone()).collect(),
                        frames,
                        values: array(&sample["values"]).map(int).collect(),
                        attributes: dictionary.attributes(&sample["attributeIndices"])?,
                        timestamps_unix_nano: array(&sample["timestampsUnixNano"])
                            .map(uint)
                            .collect(),
                    });
                }
                profiles.push(ReceivedProfile {
                    request: index,
                    resource: resource.clone(),
                    scope_name: string(&scope["name"]),
                    scope_version: string(&scope["version"]),
                    sample_type: dictionary.string(int(&profile["sampleType"]["typeStrindex"]))?,
                    sample_unit: dictionary.string(int(&profile["sampleType"]["unitStrindex"]))?,
                    period_type: dictionary.string(int(&profile["periodType"]["typeStrindex"]))?,
                    period_unit: dictionary.string(int(&profile["periodType"]["unitStrindex"]))?,
                    period: int(&profile["period"]),
                    time_unix_nano: uint(&profile["timeUnixNano"]),
                    duration_nano: uint(&profile["durationNano"]),
                    profile_id: string(&profile["profileId"]),
                    attributes: dictionary.attributes(&profile["attributeIndices"])?,
                    samples,
                });
            }
        }
    }
    Ok(profiles)
}

/// A request's `dictionary`: the tables every index points into.
struct Dictionary<'a> {
    strings: Vec<&'a str>,
    stacks: Vec<&'a Value>,
    locations: Vec<&'a Value>,
    functions: Vec<&'a Value>,
    attributes: Vec<&'a Value>,
}

impl<'a> Dictionary<'a> {
    fn new(dictionary: &'a Value) -> Self {
        Self {
            strings: array(&dictionary["stringTable"])
                .map(|s| s.as_str().unwrap_or_default())
                .collect(),
            stacks: array(&dictionary["stackTable"]).collect(),
            locations: array(&dictionary["locationTable"]).collect(),
            functions: array(&dictionary["functionTable"]).collect(),
            attributes: array(&dictionary["attributeTable"]).collect(),
        }
    }

    /// `table[index]`; index 0 of an empty table is the zero value (null).
    fn entry(table: &[&'a Value], index: i64, what: &str) -> Result<&'a Value> {
        static NULL: Value = Value::Null;
        match usize::try_from(index).ok().and_then(|i| table.get(i)) {
            Some(value) => Ok(value),
            None if index == 0 => Ok(&NULL),
            None => bail!(
                "{what} index {index} out of its table ({} entries)",
                table.len()
            ),
        }
    }

    fn string(&self, index: i64) -> Result<String> {
        match usize::try_from(index)
            .ok()
            .and_then(|i| self.strings.get(i))
        {
            Some(s) => Ok((*s).to_string()),
            None if index == 0 => Ok(String::new()),
            None => bail!(
                "string index {index} out of the string table ({} entries)",
                self.strings.len()
            ),
        }
    }

    /// The frames of stack `index`, leaf first.
    fn stack(&self, index: i64) -> Result<Vec<ReceivedFrame>> {
        let stack = Self::entry(&self.stacks, index, "stack")?;
        let mut frames = Vec::new();
        for location_index in array(&stack["locationIndices"]) {
            let location = Self::entry(&self.locations, int(location_index), "location")?;
            let address = uint(&location["address"]);
            let mut lines = array(&location["lines"]).peekable();
            if lines.peek().is_none() {
                frames.push(ReceivedFrame {
                    function: format!("{address:#x}"),
                    address,
                    ..ReceivedFrame::default()
                });
            }
            // Inlined functions first, their caller last: leaf first as the locations.
            for line in lines {
                let function =
                    Self::entry(&self.functions, int(&line["functionIndex"]), "function")?;
                frames.push(ReceivedFrame {
                    function: self.string(int(&function["nameStrindex"]))?,
                    file: self.string(int(&function["filenameStrindex"]))?,
                    line: int(&line["line"]),
                    address,
                });
            }
        }
        Ok(frames)
    }

    /// Attributes through `indices` into the attribute table.
    fn attributes(&self, indices: &Value) -> Result<BTreeMap<String, String>> {
        let mut map = BTreeMap::new();
        for index in array(indices) {
            let attribute = Self::entry(&self.attributes, int(index), "attribute")?;
            map.insert(self.key(attribute)?, self.any_value(&attribute["value"])?);
        }
        Ok(map)
    }

    /// A list of `KeyValue`s (resource attributes), whose keys and string values the
    /// collector writes as string-table indices (`keyStrindex`, `stringValueStrindex`).
    fn key_values(&self, list: &Value) -> Result<BTreeMap<String, String>> {
        array(list)
            .map(|kv| Ok((self.key(kv)?, self.any_value(&kv["value"])?)))
            .collect()
    }

    fn key(&self, kv: &Value) -> Result<String> {
        match kv["key"].as_str() {
            Some(key) => Ok(key.to_string()),
            None => self.string(int(&kv["keyStrindex"])),
        }
    }

    /// An `AnyValue` as a string: ints in decimal, bools `true`/`false`, arrays
    /// `[a, b]`, key-value lists `{k: v}`, bytes as their base64; empty if unset.
    fn any_value(&self, value: &Value) -> Result<String> {
        Ok(if let Some(s) = value.get("stringValue") {
            string(s)
        } else if let Some(i) = value.get("stringValueStrindex") {
            self.string(int(i))?
        } else if let Some(i) = value.get("intValue") {
            int(i).to_string()
        } else if let Some(b) = value.get("boolValue") {
            b.as_bool().unwrap_or(false).to_string()
        } else if let Some(d) = value.get("doubleValue") {
            match d {
                Value::String(s) => s.clone(),
                other => other.as_f64().unwrap_or(0.0).to_string(),
            }
        } else if let Some(b) = value.get("bytesValue") {
            string(b)
        } else if let Some(a) = value.get("arrayValue") {
            let items: Result<Vec<String>> =
                array(&a["values"]).map(|v| self.any_value(v)).collect();
            format!("[{}]", items?.join(", "))
        } else if let Some(kvs) = value.get("kvlistValue") {
            let items: Result<Vec<String>> = array(&kvs["values"])
                .map(|kv| {
                    Ok(format!(
                        "{}: {}",
                        self.key(kv)?,
                        self.any_value(&kv["value"])?
                    ))
                })
                .collect();
            format!("{{{}}}", items?.join(", "))
        } else {
            String::new()
        })
    }
}

/// The lines of `text` that end in a newline (the exporter's buffer may have flushed
/// part of the last one).
pub(super) fn complete_lines(text: &str) -> impl Iterator<Item = &str> {
    let complete = text.rfind('\n').map_or("", |end| &text[..end]);
    complete.lines().filter(|line| !line.trim().is_empty())
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Real output of the collector's file exporter (otelcol-allocbpf v0.161.0), for one
    /// request sent by a throwaway Go program through pdata/pprofile v0.161.0: two
    /// profiles of one resource, each with a two-frame sample and an empty-stack sample.
    /// The collector moved the resource's attribute keys and string values into the
    /// string table (`keyStrindex`, `stringValueStrindex`).
    pub(crate) const REAL_LINE: &str = include_str!("../../servers/otelcol/sample-output.jsonl");

    #[test]
    fn real_collector_output_parses() {
        let profiles = parse_received(REAL_LINE).unwrap();
        assert_eq!(profiles.len(), 2);
        let space = &profiles[0];
        assert_eq!(space.request, 0);
        assert_eq!(space.resource["service.name"], "sites");
        assert_eq!(space.resource["host.name"], "testhost");
        assert_eq!(space.resource["process.pid"], "4242");
        assert_eq!(space.resource["allocbpf.test"], "true");
        assert_eq!(space.scope_name, "allocbpf");
        assert_eq!(space.scope_version, "0.1.0");
        assert_eq!(
            (&*space.sample_type, &*space.sample_unit),
            ("alloc_space", "bytes")
        );
        assert_eq!(
            (&*space.period_type, &*space.period_unit),
            ("space", "bytes")
        );
        assert_eq!(space.period, 524_288);
        assert_eq!(space.time_unix_nano, 1_700_000_000_123_456_789);
        assert_eq!(space.duration_nano, 10_000_000_000);
        assert_eq!(space.samples.len(), 2);
        let sample = &space.samples[0];
        assert_eq!(sample.stack, ["alloc_site_b", "main"]);
        assert_eq!(sample.values, [1_048_576]);
        assert_eq!(sample.attributes["thread.name"], "worker-1");
        assert_eq!(
            sample.frames[0],
            ReceivedFrame {
                function: "alloc_site_b".into(),
                file: "sites.c".into(),
                line: 42,
                address: 0x401136,
            }
        );
        // stackIndex, attributeIndices omitted: the empty stack 0, no attributes.
        assert!(space.samples[1].stack.is_empty());
        assert!(space.samples[1].attributes.is_empty());
        assert_eq!(space.samples[1].values, [7]);
        assert_eq!(space.total(), 1_048_583);
        let objects = &profiles[1];
        assert_eq!(
            (&*objects.sample_type, &*objects.sample_unit),
            ("alloc_objects", "count")
        );
        assert_eq!(objects.samples[0].values, [3]);
        assert_eq!(objects.samples[0].stack, ["alloc_site_b", "main"]);
        assert_eq!(objects.resource, space.resource);
    }

    #[test]
    fn partial_lines_and_requests_are_counted() {
        let twice = format!("{REAL_LINE}{REAL_LINE}{{\"resourceProf");
        let profiles = parse_received(&twice).unwrap();
        assert_eq!(profiles.len(), 4);
        assert_eq!(profiles[3].request, 1);
    }

    #[test]
    fn missing_fields_are_zero_and_bad_indices_fail() {
        let request: Value = serde_json::from_str(
            r#"{"resourceProfiles":[{"resource":{"attributes":[{"key":"k","value":{"intValue":5}}]},
                "scopeProfiles":[{"profiles":[{"samples":[{"values":["1"]}]}]}]}]}"#,
        )
        .unwrap();
        let profiles = parse_export_request(&request, 0).unwrap();
        assert_eq!(profiles[0].resource["k"], "5");
        assert_eq!(profiles[0].sample_type, "");
        assert_eq!(profiles[0].samples[0].values, [1]);
        assert!(profiles[0].samples[0].stack.is_empty());
        let bad: Value = serde_json::from_str(
            r#"{"resourceProfiles":[{"scopeProfiles":[{"profiles":[{"samples":[{"stackIndex":3}]}]}]}]}"#,
        )
        .unwrap();
        assert!(parse_export_request(&bad, 0).is_err());
    }
}
