//! pprof's `profile.proto` messages (github.com/google/pprof, proto/profile.proto),
//! written out with prost's derive so the build needs no `protoc`. Field numbers are the
//! proto's; only comments were shortened.

/// A complete profile.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Profile {
    /// What each value in a sample means.
    #[prost(message, repeated, tag = "1")]
    pub sample_type: Vec<ValueType>,
    /// The samples.
    #[prost(message, repeated, tag = "2")]
    pub sample: Vec<Sample>,
    /// Mapped binaries.
    #[prost(message, repeated, tag = "3")]
    pub mapping: Vec<Mapping>,
    /// Locations referenced by samples.
    #[prost(message, repeated, tag = "4")]
    pub location: Vec<Location>,
    /// Functions referenced by locations.
    #[prost(message, repeated, tag = "5")]
    pub function: Vec<Function>,
    /// All strings; index 0 must be "".
    #[prost(string, repeated, tag = "6")]
    pub string_table: Vec<String>,
    /// Regexp of frames to drop (string index).
    #[prost(int64, tag = "7")]
    pub drop_frames: i64,
    /// Regexp of frames to keep (string index).
    #[prost(int64, tag = "8")]
    pub keep_frames: i64,
    /// Collection start, ns since the epoch.
    #[prost(int64, tag = "9")]
    pub time_nanos: i64,
    /// Collection duration in ns.
    #[prost(int64, tag = "10")]
    pub duration_nanos: i64,
    /// The kind of events between sampled occurrences.
    #[prost(message, optional, tag = "11")]
    pub period_type: Option<ValueType>,
    /// Events between sampled occurrences (the mean sampling interval).
    #[prost(int64, tag = "12")]
    pub period: i64,
    /// Free-form comments (string indices).
    #[prost(int64, repeated, tag = "13")]
    pub comment: Vec<i64>,
    /// Index into sample_type of the preferred type (string index of its type).
    #[prost(int64, tag = "14")]
    pub default_sample_type: i64,
}

/// A value's type and unit (string indices).
#[derive(Clone, PartialEq, prost::Message)]
pub struct ValueType {
    /// e.g. "alloc_space".
    #[prost(int64, tag = "1")]
    pub r#type: i64,
    /// e.g. "bytes".
    #[prost(int64, tag = "2")]
    pub unit: i64,
}

/// One stack with its values.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Sample {
    /// Location ids, leaf first.
    #[prost(uint64, repeated, tag = "1")]
    pub location_id: Vec<u64>,
    /// One value per sample_type.
    #[prost(int64, repeated, tag = "2")]
    pub value: Vec<i64>,
    /// Labels.
    #[prost(message, repeated, tag = "3")]
    pub label: Vec<Label>,
}

/// A sample label: a string or a number.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Label {
    /// Key (string index).
    #[prost(int64, tag = "1")]
    pub key: i64,
    /// String value (string index), or 0.
    #[prost(int64, tag = "2")]
    pub str: i64,
    /// Numeric value.
    #[prost(int64, tag = "3")]
    pub num: i64,
    /// Unit of num (string index).
    #[prost(int64, tag = "4")]
    pub num_unit: i64,
}

/// A mapped binary.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Mapping {
    /// Unique nonzero id.
    #[prost(uint64, tag = "1")]
    pub id: u64,
    /// Start of the address range.
    #[prost(uint64, tag = "2")]
    pub memory_start: u64,
    /// End of the address range.
    #[prost(uint64, tag = "3")]
    pub memory_limit: u64,
    /// File offset at memory_start.
    #[prost(uint64, tag = "4")]
    pub file_offset: u64,
    /// File name (string index).
    #[prost(int64, tag = "5")]
    pub filename: i64,
    /// Build id (string index).
    #[prost(int64, tag = "6")]
    pub build_id: i64,
    /// Locations carry function names.
    #[prost(bool, tag = "7")]
    pub has_functions: bool,
    /// Locations carry file names.
    #[prost(bool, tag = "8")]
    pub has_filenames: bool,
    /// Locations carry line numbers.
    #[prost(bool, tag = "9")]
    pub has_line_numbers: bool,
    /// Locations carry inlined frames.
    #[prost(bool, tag = "10")]
    pub has_inline_frames: bool,
}

/// An address and the functions at it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Location {
    /// Unique nonzero id.
    #[prost(uint64, tag = "1")]
    pub id: u64,
    /// Mapping id, or 0.
    #[prost(uint64, tag = "2")]
    pub mapping_id: u64,
    /// Address in the mapping's range.
    #[prost(uint64, tag = "3")]
    pub address: u64,
    /// Functions, innermost (inlined) first, the containing function last.
    #[prost(message, repeated, tag = "4")]
    pub line: Vec<Line>,
    /// Folded frames.
    #[prost(bool, tag = "5")]
    pub is_folded: bool,
}

/// A function and line.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Line {
    /// Function id.
    #[prost(uint64, tag = "1")]
    pub function_id: u64,
    /// Source line, or 0.
    #[prost(int64, tag = "2")]
    pub line: i64,
    /// Source column, or 0.
    #[prost(int64, tag = "3")]
    pub column: i64,
}

/// A function.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Function {
    /// Unique nonzero id.
    #[prost(uint64, tag = "1")]
    pub id: u64,
    /// Human-readable name (string index).
    #[prost(int64, tag = "2")]
    pub name: i64,
    /// Mangled/system name (string index).
    #[prost(int64, tag = "3")]
    pub system_name: i64,
    /// Source file (string index).
    #[prost(int64, tag = "4")]
    pub filename: i64,
    /// First line of the function, or 0.
    #[prost(int64, tag = "5")]
    pub start_line: i64,
}
