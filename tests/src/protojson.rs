//! Reading protobuf messages in their JSON mapping (OTLP JSON from the Collector's file
//! exporter, Pyroscope's Connect JSON answers): fields left out when zero, 64-bit
//! integers as decimal strings.

use serde_json::Value;

/// The elements of a JSON array; none if missing.
pub fn array(value: &Value) -> impl Iterator<Item = &Value> {
    value
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
}

/// A JSON int64: a number, or a decimal string; 0 if missing.
pub fn int(value: &Value) -> i64 {
    match value {
        Value::Number(n) => n.as_i64().unwrap_or(0),
        Value::String(s) => s.parse().unwrap_or(0),
        _ => 0,
    }
}

/// [`int`] for uint64 fields.
pub fn uint(value: &Value) -> u64 {
    match value {
        Value::Number(n) => n.as_u64().unwrap_or(0),
        Value::String(s) => s.parse().unwrap_or(0),
        _ => 0,
    }
}

/// A JSON string; empty if missing.
pub fn string(value: &Value) -> String {
    value.as_str().unwrap_or_default().to_string()
}
