//! Pyroscope's Connect API in JSON: the queries (`querier.v1.QuerierService/*`) and
//! the push (`push.v1.PusherService/Push`), and their answers parsed: merged profiles
//! ([`MergedProfile`]) and series ([`Series`]).

use std::collections::BTreeMap;

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};

use super::{base64, Pyroscope};
use crate::{
    protojson::{array, int, string, uint},
    stores::{top, Stack},
};

impl Pyroscope {
    /// A Connect unary call in JSON (`/SERVICE/METHOD`): the answer, or an error with
    /// the status and body unless 200.
    pub fn call(&self, method: &str, request: &Value, tenant: Option<&str>) -> Result<Value> {
        let (status, body) = self.post(
            method,
            "application/json",
            request.to_string().as_bytes(),
            tenant,
        )?;
        ensure!(
            status == 200,
            "{method}: HTTP {status}: {}",
            String::from_utf8_lossy(&body)
        );
        serde_json::from_slice(&body).with_context(|| format!("{method}: the answer is not JSON"))
    }

    /// The merged profile of `profile_type_id` (`memory:alloc_space:bytes:space:bytes`)
    /// over the series `label_selector` (`{service_name="x"}`) and the profiles
    /// whose timestamp is in `[start_ms, end_ms]`, as `SelectMergeProfile` returns it.
    pub fn select_merge_profile(
        &self,
        profile_type_id: &str,
        label_selector: &str,
        start_ms: u64,
        end_ms: u64,
        tenant: Option<&str>,
    ) -> Result<MergedProfile> {
        let answer = self.call(
            "/querier.v1.QuerierService/SelectMergeProfile",
            &json!({
                "profile_typeID": profile_type_id,
                "label_selector": label_selector,
                "start": start_ms,
                "end": end_ms,
                // Never truncated (our profiles hold far fewer nodes).
                "max_nodes": 65536,
            }),
            tenant,
        )?;
        parse_merged_profile(&answer)
    }

    /// `SelectSeries`: `profile_type_id`'s values over `label_selector` in
    /// `[start_ms, end_ms]`, summed per `step_s` seconds, one series per value of the
    /// `group_by` labels.
    pub fn select_series(
        &self,
        profile_type_id: &str,
        label_selector: &str,
        (start_ms, end_ms): (u64, u64),
        step_s: f64,
        group_by: &[&str],
        tenant: Option<&str>,
    ) -> Result<Vec<Series>> {
        let answer = self.call(
            "/querier.v1.QuerierService/SelectSeries",
            &json!({
                "profile_typeID": profile_type_id,
                "label_selector": label_selector,
                "start": start_ms,
                "end": end_ms,
                "step": step_s,
                "group_by": group_by,
            }),
            tenant,
        )?;
        Ok(array(&answer["series"])
            .map(|series| Series {
                labels: label_pairs(&series["labels"]),
                points: array(&series["points"])
                    .map(|p| (uint(&p["timestamp"]), p["value"].as_f64().unwrap_or(0.0)))
                    .collect(),
            })
            .collect())
    }

    /// The values of label `name` in the series matching `matchers` (all if empty).
    pub fn label_values(
        &self,
        name: &str,
        matchers: &[&str],
        start_ms: u64,
        end_ms: u64,
        tenant: Option<&str>,
    ) -> Result<Vec<String>> {
        let answer = self.call(
            "/querier.v1.QuerierService/LabelValues",
            &json!({"name": name, "matchers": matchers, "start": start_ms, "end": end_ms}),
            tenant,
        )?;
        Ok(array(&answer["names"]).map(string).collect())
    }

    /// The label names of the series matching `matchers`.
    pub fn label_names(
        &self,
        matchers: &[&str],
        start_ms: u64,
        end_ms: u64,
        tenant: Option<&str>,
    ) -> Result<Vec<String>> {
        let answer = self.call(
            "/querier.v1.QuerierService/LabelNames",
            &json!({"matchers": matchers, "start": start_ms, "end": end_ms}),
            tenant,
        )?;
        Ok(array(&answer["names"]).map(string).collect())
    }

    /// The label sets of the series matching `matchers` (one per profile type: the
    /// server's own labels, `__profile_type__`..., included).
    pub fn series(
        &self,
        matchers: &[&str],
        start_ms: u64,
        end_ms: u64,
        tenant: Option<&str>,
    ) -> Result<Vec<BTreeMap<String, String>>> {
        let answer = self.call(
            "/querier.v1.QuerierService/Series",
            &json!({"matchers": matchers, "start": start_ms, "end": end_ms}),
            tenant,
        )?;
        Ok(array(&answer["labelsSet"])
            .map(|set| label_pairs(&set["labels"]))
            .collect())
    }

    /// The IDs of the profile types stored in `[start_ms, end_ms]`, sorted.
    pub fn profile_types(
        &self,
        start_ms: u64,
        end_ms: u64,
        tenant: Option<&str>,
    ) -> Result<Vec<String>> {
        let answer = self.call(
            "/querier.v1.QuerierService/ProfileTypes",
            &json!({"start": start_ms, "end": end_ms}),
            tenant,
        )?;
        let mut ids: Vec<String> = array(&answer["profileTypes"])
            .map(|t| string(&t["ID"]))
            .collect();
        ids.sort();
        Ok(ids)
    }

    /// Pushes raw (gzipped or plain) pprofs in one request through the Connect push
    /// API (`push.v1.PusherService/Push`, JSON), each as a series with its labels:
    /// the status and body. The server answers once its ingester holds them.
    pub fn push(&self, series: &[PushSeries<'_>], tenant: Option<&str>) -> Result<(u16, String)> {
        let series: Vec<Value> = series
            .iter()
            .map(|(labels, raw_profile)| {
                let labels: Vec<Value> = labels
                    .iter()
                    .map(|(name, value)| json!({"name": name, "value": value}))
                    .collect();
                json!({
                    "labels": labels,
                    "samples": [{"rawProfile": base64(raw_profile)}],
                })
            })
            .collect();
        let request = json!({ "series": series });
        let (status, body) = self.post(
            "/push.v1.PusherService/Push",
            "application/json",
            request.to_string().as_bytes(),
            tenant,
        )?;
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    }
}

/// `{name}:{sample_type}:{unit}:space:bytes`: the profile type Pyroscope files a
/// sample type of ours under (`name` is `memory` for pprof pushes; OTLP profiles get
/// their period type, `space`). Units as the agent's pprof has them.
pub fn profile_type_id(name: &str, sample_type: &str) -> String {
    let unit = if sample_type.ends_with("_objects") {
        "count"
    } else {
        "bytes"
    };
    format!("{name}:{sample_type}:{unit}:space:bytes")
}

/// One series to push: its labels, and a raw pprof (gzipped or not).
pub type PushSeries<'a> = (&'a [(&'a str, &'a str)], &'a [u8]);

/// A series of `SelectSeries`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Series {
    /// The `group_by` labels' values.
    pub labels: BTreeMap<String, String>,
    /// (timestamp in Unix ms, value) per step.
    pub points: Vec<(u64, f64)>,
}

/// A merged profile as `SelectMergeProfile` returns it (one sample type).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MergedProfile {
    /// The sample type (`alloc_space`...).
    pub sample_type: String,
    /// Its unit.
    pub sample_unit: String,
    /// The sum of the values.
    pub total: i64,
    /// How many samples it holds.
    pub samples: usize,
    /// Each stack's value, by function names leaf first (inlined functions before
    /// their callers; a location without lines is its address, `0x...`); equal
    /// stacks summed, zero values left out.
    pub stacks: BTreeMap<Stack, i64>,
}

impl MergedProfile {
    /// The `n` heaviest stacks, heaviest first (ties by the stack).
    pub fn top(&self, n: usize) -> Vec<(Stack, i64)> {
        top(Some(&self.stacks), n)
    }

    /// The sum of the values of the stacks that hold `function`.
    pub fn with_function(&self, function: &str) -> i64 {
        self.stacks
            .iter()
            .filter(|(stack, _)| stack.iter().any(|f| f == function))
            .map(|(_, value)| value)
            .sum()
    }
}

/// A `google.v1.Profile` in protobuf JSON (int64s as strings, zero fields left out).
pub fn parse_merged_profile(profile: &Value) -> Result<MergedProfile> {
    let strings: Vec<String> = array(&profile["stringTable"]).map(string).collect();
    let text = |index: &Value| -> Result<String> {
        let i = int(index);
        match usize::try_from(i).ok().and_then(|i| strings.get(i)) {
            Some(s) => Ok(s.clone()),
            None if i == 0 => Ok(String::new()),
            None => bail!("string {i} out of the table ({} entries)", strings.len()),
        }
    };
    let mut functions = BTreeMap::new();
    for function in array(&profile["function"]) {
        functions.insert(uint(&function["id"]), text(&function["name"])?);
    }
    let mut locations: BTreeMap<u64, Vec<String>> = BTreeMap::new();
    for location in array(&profile["location"]) {
        let mut names = Vec::new();
        for line in array(&location["line"]) {
            let id = uint(&line["functionId"]);
            names.push(
                functions
                    .get(&id)
                    .cloned()
                    .with_context(|| format!("function {id} missing"))?,
            );
        }
        if names.is_empty() {
            names.push(format!("{:#x}", uint(&location["address"])));
        }
        locations.insert(uint(&location["id"]), names);
    }
    let types: Vec<&Value> = array(&profile["sampleType"]).collect();
    ensure!(
        types.len() <= 1,
        "a merged profile of {} sample types",
        types.len()
    );
    let (sample_type, sample_unit) = match types.first() {
        Some(t) => (text(&t["type"])?, text(&t["unit"])?),
        None => Default::default(),
    };
    let mut merged = MergedProfile {
        sample_type,
        sample_unit,
        ..MergedProfile::default()
    };
    for sample in array(&profile["sample"]) {
        let mut stack = Vec::new();
        for id in array(&sample["locationId"]) {
            let id = uint(id);
            stack.extend(
                locations
                    .get(&id)
                    .cloned()
                    .with_context(|| format!("location {id} missing"))?,
            );
        }
        let value: i64 = array(&sample["value"]).map(int).sum();
        merged.samples += 1;
        merged.total += value;
        if value != 0 {
            *merged.stacks.entry(stack).or_insert(0) += value;
        }
    }
    Ok(merged)
}

/// `[{"name": .., "value": ..}, ...]` as a map.
fn label_pairs(list: &Value) -> BTreeMap<String, String> {
    array(list)
        .map(|pair| (string(&pair["name"]), string(&pair["value"])))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape of a real answer (v1.21.1, a Go heap profile pushed through the push
    /// API, cut down): int64s as strings, zero fields left out, an inlined frame.
    #[test]
    fn merged_profiles_parse() {
        let answer: Value = serde_json::from_str(
            r#"{"sampleType":[{"type":"4","unit":"3"}],
                "sample":[{"locationId":["2","1"],"value":["6561272"]},
                          {"locationId":["3"],"value":["1024"]},
                          {"locationId":["1"]}],
                "mapping":[{"id":"1","hasFunctions":true}],
                "location":[{"id":"1","mappingId":"1","line":[{"functionId":"1","line":"45"}]},
                            {"id":"2","mappingId":"1","line":[{"functionId":"2","line":"17"},
                                                             {"functionId":"1","line":"9"}]},
                            {"id":"3","mappingId":"1","address":"4096"}],
                "function":[{"id":"1","name":"1","systemName":"1"},{"id":"2","name":"2"}],
                "stringTable":["","main.main","main.allocA","bytes","alloc_space"],
                "timeNanos":"1795601132628000000","periodType":{"type":"5"}}"#,
        )
        .unwrap();
        let merged = parse_merged_profile(&answer).unwrap();
        assert_eq!(merged.sample_type, "alloc_space");
        assert_eq!(merged.sample_unit, "bytes");
        assert_eq!(merged.total, 6_562_296);
        assert_eq!(merged.samples, 3);
        let key = |names: &[&str]| -> Stack { names.iter().map(|s| s.to_string()).collect() };
        assert_eq!(
            merged.stacks[&key(&["main.allocA", "main.main", "main.main"])],
            6_561_272
        );
        assert_eq!(merged.stacks[&key(&["0x1000"])], 1024);
        assert_eq!(merged.stacks.len(), 2, "the zero sample is left out");
        assert_eq!(merged.with_function("main.allocA"), 6_561_272);
        let bad: Value =
            serde_json::from_str(r#"{"sample":[{"locationId":["9"],"value":["1"]}]}"#).unwrap();
        assert!(parse_merged_profile(&bad).is_err());
        assert_eq!(
            profile_type_id("memory", "alloc_objects"),
            "memory:alloc_objects:count:space:bytes"
        );
        assert_eq!(
            profile_type_id("space", "inuse_space"),
            "space:inuse_space:bytes:space:bytes"
        );
    }
}
