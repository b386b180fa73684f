//! Building a request's [`ProfilesDictionary`]: tables that intern their entries by
//! value, each starting with its element type's zero value so that index 0 means
//! "unset", as the profiles proto requires of every dictionary table.

use std::collections::HashMap;
use std::hash::Hash;

use super::proto::{
    any_value, AnyValue, ArrayValue, Function, KeyValueAndUnit, Link, Location, Mapping,
    ProfilesDictionary, Stack,
};

/// One dictionary table: entries in index order, and the index of each entry's key.
struct Table<K, V> {
    items: Vec<V>,
    index: HashMap<K, i32>,
}

impl<K: Hash + Eq, V> Table<K, V> {
    /// A table holding only `zero` at index 0, under `zero_key`: interning a value
    /// equal to the zero value yields 0 rather than a second, indistinguishable entry.
    fn new(zero_key: K, zero: V) -> Self {
        Self {
            items: vec![zero],
            index: HashMap::from([(zero_key, 0)]),
        }
    }

    /// The index of the entry under `key`, made by `value` at its first use.
    fn intern(&mut self, key: K, value: impl FnOnce() -> V) -> i32 {
        if let Some(&i) = self.index.get(&key) {
            return i;
        }
        // The wire type is int32; a table that long cannot have been built in memory.
        let i = i32::try_from(self.items.len()).expect("dictionary table over i32::MAX");
        self.items.push(value());
        self.index.insert(key, i);
        i
    }
}

/// An attribute value, in a form that can key a table (no floats).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) enum Value {
    /// No value: only the zero attribute has it.
    None,
    /// A string.
    Str(String),
    /// An integer.
    Int(i64),
    /// A boolean.
    Bool(bool),
    /// An array of strings.
    Strs(Vec<String>),
}

impl Value {
    /// The value as the proto's `AnyValue`.
    pub(super) fn to_any(&self) -> Option<AnyValue> {
        let value = match self {
            Value::None => return None,
            Value::Str(s) => any_value::Value::StringValue(s.clone()),
            Value::Int(i) => any_value::Value::IntValue(*i),
            Value::Bool(b) => any_value::Value::BoolValue(*b),
            Value::Strs(strings) => any_value::Value::ArrayValue(ArrayValue {
                values: strings
                    .iter()
                    .map(|s| AnyValue {
                        value: Some(any_value::Value::StringValue(s.clone())),
                    })
                    .collect(),
            }),
        };
        Some(AnyValue { value: Some(value) })
    }
}

/// A location's identity: mapping, address, lines `(function, line, column)`, attributes.
type LocationKey = (i32, u64, Vec<(i32, i64, i64)>, Vec<i32>);
/// A mapping's identity: start, limit, offset, filename, attributes.
type MappingKey = (u64, u64, u64, i32, Vec<i32>);

/// The dictionary under construction. Entries are deduplicated by value (the proto
/// says tables SHOULD NOT hold duplicates) and only what callers intern is added, so
/// no entry is orphaned.
pub(super) struct Dictionary {
    strings: Table<String, String>,
    attributes: Table<(i32, Value, i32), KeyValueAndUnit>,
    functions: Table<(i32, i32, i32, i64), Function>,
    mappings: Table<MappingKey, Mapping>,
    locations: Table<LocationKey, Location>,
    stacks: Table<Vec<i32>, Stack>,
}

impl Dictionary {
    /// Tables holding only their zero values.
    pub(super) fn new() -> Self {
        Self {
            strings: Table::new(String::new(), String::new()),
            attributes: Table::new((0, Value::None, 0), KeyValueAndUnit::default()),
            functions: Table::new((0, 0, 0, 0), Function::default()),
            mappings: Table::new((0, 0, 0, 0, Vec::new()), Mapping::default()),
            locations: Table::new((0, 0, Vec::new(), Vec::new()), Location::default()),
            stacks: Table::new(Vec::new(), Stack::default()),
        }
    }

    /// The string-table index of `s`.
    pub(super) fn string(&mut self, s: &str) -> i32 {
        // Looked up by reference first: most strings are already there.
        if let Some(&i) = self.strings.index.get(s) {
            return i;
        }
        self.strings.intern(s.to_string(), || s.to_string())
    }

    /// The attribute-table index of `key` = `value`, with `unit` ("" for none).
    pub(super) fn attribute(&mut self, key: &str, value: Value, unit: &str) -> i32 {
        let key_strindex = self.string(key);
        let unit_strindex = self.string(unit);
        let any = value.to_any();
        self.attributes
            .intern((key_strindex, value, unit_strindex), || KeyValueAndUnit {
                key_strindex,
                value: any,
                unit_strindex,
            })
    }

    /// The function-table index of `f`.
    pub(super) fn function(&mut self, f: Function) -> i32 {
        let key = (
            f.name_strindex,
            f.system_name_strindex,
            f.filename_strindex,
            f.start_line,
        );
        self.functions.intern(key, || f)
    }

    /// The mapping-table index of `m`.
    pub(super) fn mapping(&mut self, m: Mapping) -> i32 {
        let key = (
            m.memory_start,
            m.memory_limit,
            m.file_offset,
            m.filename_strindex,
            m.attribute_indices.clone(),
        );
        self.mappings.intern(key, || m)
    }

    /// The location-table index of `l`.
    pub(super) fn location(&mut self, l: Location) -> i32 {
        let lines = l
            .lines
            .iter()
            .map(|line| (line.function_index, line.line, line.column))
            .collect();
        let key = (
            l.mapping_index,
            l.address,
            lines,
            l.attribute_indices.clone(),
        );
        self.locations.intern(key, || l)
    }

    /// The stack-table index of the stack of `location_indices` (leaf first).
    pub(super) fn stack(&mut self, location_indices: Vec<i32>) -> i32 {
        self.stacks
            .intern(location_indices.clone(), || Stack { location_indices })
    }

    /// The finished tables.
    pub(super) fn finish(self) -> ProfilesDictionary {
        ProfilesDictionary {
            mapping_table: self.mappings.items,
            location_table: self.locations.items,
            function_table: self.functions.items,
            // We have no trace links: only the zero link, in the form the proto
            // prefers (all-zero ids of the full 16 and 8 bytes, for codecs that
            // expect those lengths).
            link_table: vec![Link {
                trace_id: vec![0; 16],
                span_id: vec![0; 8],
            }],
            string_table: self.strings.items,
            attribute_table: self.attributes.items,
            stack_table: self.stacks.items,
        }
    }
}
