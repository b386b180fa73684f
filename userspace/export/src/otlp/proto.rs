//! The OpenTelemetry profiles signal's messages (opentelemetry-proto,
//! `opentelemetry.proto.profiles.v1development` and the collector service around it),
//! with the `common.v1` and `resource.v1` messages they use, written out with prost's
//! derive so the build needs no `protoc`. Only comments were shortened.
//!
//! Field numbers and wire types as pdata v1.67.0 (OpenTelemetry Collector v0.161.0)
//! decodes: each field was checked against pdata's generated code
//! (`pdata/internal/generated_proto_*.go`): the tag byte its `MarshalProto` writes, the
//! `case N:` of its `UnmarshalProto` and the wire type that case accepts. The field
//! layout also matches `go.opentelemetry.io/proto/slim/otlp/profiles/v1development`
//! v0.4.0, the generated Go protos that pdata version depends on. The wire types that
//! are easy to get wrong:
//!
//! - fixed64 (wire type 1, `binary.LittleEndian.PutUint64`): `Profile.time_unix_nano`,
//!   `Sample.timestamps_unix_nano` (packed) and `AnyValue.double_value`;
//! - varint: `Profile.duration_nano` (uint64), `Profile.period` (int64), every
//!   `*_index`/`*_strindex` (int32; negative ones would be sign-extended to ten bytes,
//!   as protobuf's int32 is), `Location.address` and the `Mapping` addresses (uint64),
//!   `Line.line`/`column` and `Function.start_line` (int64), `Sample.values` (int64,
//!   packed), `AnyValue.int_value` (int64);
//! - length-delimited: `Profile.profile_id` and the `Link` ids (bytes: pdata rejects any
//!   length other than 0 or 16 for profile and trace ids, 0 or 8 for span ids).
//!
//! Repeated numbers are written packed (prost's proto3 default); pdata accepts them
//! packed or not. pdata's `KeyValue.key_strindex` (3) and `AnyValue.string_value_strindex`
//! (8) are here too: pdata writes them in place of the strings of resource and scope
//! attributes when it marshals profiles, so a request a Collector re-exports decodes.
//!
//! Every dictionary table's element 0 MUST be that element's zero value and present
//! (the proto's `ProfilesDictionary` comment), so that index 0 means "unset"; pdata's
//! dictionary code skips indices `<= 0` accordingly. [`super`] builds the tables so.

/// The body of an OTLP profiles export (`ProfilesService/Export`, or an OTLP/HTTP POST).
#[derive(Clone, PartialEq, prost::Message)]
pub struct ExportProfilesServiceRequest {
    /// Profiles grouped by the resource (process, host) they describe.
    #[prost(message, repeated, tag = "1")]
    pub resource_profiles: Vec<ResourceProfiles>,
    /// The tables every profile of the request indexes into.
    #[prost(message, optional, tag = "2")]
    pub dictionary: Option<ProfilesDictionary>,
}

/// The receiver's answer to an export.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ExportProfilesServiceResponse {
    /// Set when some profiles were rejected; absent when all were accepted.
    #[prost(message, optional, tag = "1")]
    pub partial_success: Option<ExportProfilesPartialSuccess>,
}

/// How much of an export was rejected, and why.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ExportProfilesPartialSuccess {
    /// Profiles rejected.
    #[prost(int64, tag = "1")]
    pub rejected_profiles: i64,
    /// A human-readable reason.
    #[prost(string, tag = "2")]
    pub error_message: String,
}

/// The tables shared by all profiles of a request. Element 0 of each is its zero value.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProfilesDictionary {
    /// Mapped binaries, referenced by `Location.mapping_index`.
    #[prost(message, repeated, tag = "1")]
    pub mapping_table: Vec<Mapping>,
    /// Frames, referenced by `Stack.location_indices`.
    #[prost(message, repeated, tag = "2")]
    pub location_table: Vec<Location>,
    /// Functions, referenced by `Line.function_index`.
    #[prost(message, repeated, tag = "3")]
    pub function_table: Vec<Function>,
    /// Trace links, referenced by `Sample.link_index`.
    #[prost(message, repeated, tag = "4")]
    pub link_table: Vec<Link>,
    /// All strings; element 0 is "".
    #[prost(string, repeated, tag = "5")]
    pub string_table: Vec<String>,
    /// Attributes, referenced by the `attribute_indices` of profiles, samples, mappings
    /// and locations.
    #[prost(message, repeated, tag = "6")]
    pub attribute_table: Vec<KeyValueAndUnit>,
    /// Stacks, referenced by `Sample.stack_index`.
    #[prost(message, repeated, tag = "7")]
    pub stack_table: Vec<Stack>,
}

/// The profiles of one resource.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ResourceProfiles {
    /// What produced the profiles (host, process, container).
    #[prost(message, optional, tag = "1")]
    pub resource: Option<Resource>,
    /// Profiles by instrumentation scope.
    #[prost(message, repeated, tag = "2")]
    pub scope_profiles: Vec<ScopeProfiles>,
    /// The semantic-conventions schema of the resource's attributes, or "".
    #[prost(string, tag = "3")]
    pub schema_url: String,
}

/// The profiles one instrumentation scope (profiler) produced.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ScopeProfiles {
    /// The profiler.
    #[prost(message, optional, tag = "1")]
    pub scope: Option<InstrumentationScope>,
    /// Its profiles.
    #[prost(message, repeated, tag = "2")]
    pub profiles: Vec<Profile>,
    /// The semantic-conventions schema of the profiles' attributes, or "".
    #[prost(string, tag = "3")]
    pub schema_url: String,
}

/// One profile: samples of a single value type.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Profile {
    /// Type and unit of every `Sample.values` entry (one type per profile).
    #[prost(message, optional, tag = "1")]
    pub sample_type: Option<ValueType>,
    /// The samples.
    #[prost(message, repeated, tag = "2")]
    pub samples: Vec<Sample>,
    /// Collection start, ns since the epoch (fixed64).
    #[prost(fixed64, tag = "3")]
    pub time_unix_nano: u64,
    /// Collection duration in ns.
    #[prost(uint64, tag = "4")]
    pub duration_nano: u64,
    /// The kind of events between sampled occurrences.
    #[prost(message, optional, tag = "5")]
    pub period_type: Option<ValueType>,
    /// Events between sampled occurrences.
    #[prost(int64, tag = "6")]
    pub period: i64,
    /// 16 bytes, not all zero; or empty (unset).
    #[prost(bytes = "vec", tag = "7")]
    pub profile_id: Vec<u8>,
    /// Attributes dropped for limits.
    #[prost(uint32, tag = "8")]
    pub dropped_attributes_count: u32,
    /// Format of `original_payload` ("pprof", "jfr", ...), or "".
    #[prost(string, tag = "9")]
    pub original_payload_format: String,
    /// The source profile, when kept.
    #[prost(bytes = "vec", tag = "10")]
    pub original_payload: Vec<u8>,
    /// Indices into the attribute table.
    #[prost(int32, repeated, tag = "11")]
    pub attribute_indices: Vec<i32>,
}

/// A stack with its values (or timestamps).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Sample {
    /// Index into the stack table.
    #[prost(int32, tag = "1")]
    pub stack_index: i32,
    /// Indices into the attribute table.
    #[prost(int32, repeated, tag = "2")]
    pub attribute_indices: Vec<i32>,
    /// Index into the link table; 0: no link.
    #[prost(int32, tag = "3")]
    pub link_index: i32,
    /// Values of the profile's sample type.
    #[prost(int64, repeated, tag = "4")]
    pub values: Vec<i64>,
    /// Event times, ns since the epoch (packed fixed64); one per value if both are set.
    #[prost(fixed64, repeated, tag = "5")]
    pub timestamps_unix_nano: Vec<u64>,
}

/// A call stack.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Stack {
    /// Indices into the location table, leaf first.
    #[prost(int32, repeated, tag = "1")]
    pub location_indices: Vec<i32>,
}

/// A frame: an address and the functions at it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Location {
    /// Index into the mapping table; 0: unknown.
    #[prost(int32, tag = "1")]
    pub mapping_index: i32,
    /// Instruction address, within the mapping's range.
    #[prost(uint64, tag = "2")]
    pub address: u64,
    /// Functions, innermost (inlined) first, the containing function last.
    #[prost(message, repeated, tag = "3")]
    pub lines: Vec<Line>,
    /// Indices into the attribute table.
    #[prost(int32, repeated, tag = "4")]
    pub attribute_indices: Vec<i32>,
}

/// A function and a source position in it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Line {
    /// Index into the function table.
    #[prost(int32, tag = "1")]
    pub function_index: i32,
    /// Source line, 1-based; 0: unset.
    #[prost(int64, tag = "2")]
    pub line: i64,
    /// Source column, 1-based; 0: unset.
    #[prost(int64, tag = "3")]
    pub column: i64,
}

/// A function (string-table indices).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Function {
    /// Human-readable name.
    #[prost(int32, tag = "1")]
    pub name_strindex: i32,
    /// Name as the system knows it (e.g. mangled).
    #[prost(int32, tag = "2")]
    pub system_name_strindex: i32,
    /// Source file.
    #[prost(int32, tag = "3")]
    pub filename_strindex: i32,
    /// First line, 1-based; 0: unset.
    #[prost(int64, tag = "4")]
    pub start_line: i64,
}

/// A binary mapped into memory.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Mapping {
    /// Start of the address range.
    #[prost(uint64, tag = "1")]
    pub memory_start: u64,
    /// End of the address range.
    #[prost(uint64, tag = "2")]
    pub memory_limit: u64,
    /// File offset at `memory_start`.
    #[prost(uint64, tag = "3")]
    pub file_offset: u64,
    /// File name (string index).
    #[prost(int32, tag = "4")]
    pub filename_strindex: i32,
    /// Indices into the attribute table (e.g. the build id).
    #[prost(int32, repeated, tag = "5")]
    pub attribute_indices: Vec<i32>,
}

/// A value's type and unit (string indices).
#[derive(Clone, PartialEq, prost::Message)]
pub struct ValueType {
    /// e.g. "alloc_space".
    #[prost(int32, tag = "1")]
    pub type_strindex: i32,
    /// e.g. "bytes".
    #[prost(int32, tag = "2")]
    pub unit_strindex: i32,
}

/// An attribute of the dictionary: a string-table key, a value, an optional unit.
#[derive(Clone, PartialEq, prost::Message)]
pub struct KeyValueAndUnit {
    /// Key (string index).
    #[prost(int32, tag = "1")]
    pub key_strindex: i32,
    /// The value.
    #[prost(message, optional, tag = "2")]
    pub value: Option<AnyValue>,
    /// Unit (string index, UCUM); 0: implicit or none.
    #[prost(int32, tag = "3")]
    pub unit_strindex: i32,
}

/// A sample's trace span.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Link {
    /// Trace id, 16 bytes.
    #[prost(bytes = "vec", tag = "1")]
    pub trace_id: Vec<u8>,
    /// Span id, 8 bytes.
    #[prost(bytes = "vec", tag = "2")]
    pub span_id: Vec<u8>,
}

/// `opentelemetry.proto.resource.v1.Resource`: the entity that produced telemetry.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Resource {
    /// Attributes, keys unique (semantic-convention keys such as `host.name`).
    #[prost(message, repeated, tag = "1")]
    pub attributes: Vec<KeyValue>,
    /// Attributes dropped for limits.
    #[prost(uint32, tag = "2")]
    pub dropped_attributes_count: u32,
}

/// `opentelemetry.proto.common.v1.InstrumentationScope`: the library that produced
/// telemetry.
#[derive(Clone, PartialEq, prost::Message)]
pub struct InstrumentationScope {
    /// Its name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// Its version.
    #[prost(string, tag = "2")]
    pub version: String,
    /// Its attributes.
    #[prost(message, repeated, tag = "3")]
    pub attributes: Vec<KeyValue>,
    /// Attributes dropped for limits.
    #[prost(uint32, tag = "4")]
    pub dropped_attributes_count: u32,
}

/// `opentelemetry.proto.common.v1.KeyValue`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct KeyValue {
    /// The key.
    #[prost(string, tag = "1")]
    pub key: String,
    /// The value.
    #[prost(message, optional, tag = "2")]
    pub value: Option<AnyValue>,
    /// The key as a string-table index, in place of `key` (pdata writes it in profiles).
    #[prost(int32, tag = "3")]
    pub key_strindex: i32,
}

/// `opentelemetry.proto.common.v1.AnyValue`: one value of any attribute type.
#[derive(Clone, PartialEq, prost::Message)]
pub struct AnyValue {
    /// The value; none for an empty value.
    #[prost(oneof = "any_value::Value", tags = "1, 2, 3, 4, 5, 6, 7, 8")]
    pub value: Option<any_value::Value>,
}

/// [`AnyValue`]'s oneof.
pub mod any_value {
    /// The alternatives of an [`AnyValue`](super::AnyValue).
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Value {
        /// A string.
        #[prost(string, tag = "1")]
        StringValue(String),
        /// A boolean.
        #[prost(bool, tag = "2")]
        BoolValue(bool),
        /// A signed integer (varint).
        #[prost(int64, tag = "3")]
        IntValue(i64),
        /// A double (fixed64).
        #[prost(double, tag = "4")]
        DoubleValue(f64),
        /// An array of values.
        #[prost(message, tag = "5")]
        ArrayValue(super::ArrayValue),
        /// A list of key-value pairs.
        #[prost(message, tag = "6")]
        KvlistValue(super::KeyValueList),
        /// Bytes.
        #[prost(bytes = "vec", tag = "7")]
        BytesValue(Vec<u8>),
        /// A string as a string-table index (pdata writes it in profiles' resource and
        /// scope attributes).
        #[prost(int32, tag = "8")]
        StringValueStrindex(i32),
    }
}

/// `opentelemetry.proto.common.v1.ArrayValue`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ArrayValue {
    /// The elements.
    #[prost(message, repeated, tag = "1")]
    pub values: Vec<AnyValue>,
}

/// `opentelemetry.proto.common.v1.KeyValueList`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct KeyValueList {
    /// The pairs; keys unique.
    #[prost(message, repeated, tag = "1")]
    pub values: Vec<KeyValue>,
}
