//! V8's debug constants: the `v8dbg_` symbols every node binary exports (offsets of
//! object fields, instance types, frame slots), each a 32-bit value in the binary's
//! data, read from the file the process maps and checked against what any V8 build
//! can have. This reading is for 64-bit V8 11 and 12 without pointer compression (how
//! Node.js builds it); anything else is refused with its reason.

use std::collections::HashMap;

use object::{Object, ObjectSection, ObjectSymbol};

use crate::NodeError;

/// Most `v8dbg_` symbols kept from one file (V8 11 has about 530).
const MAX_CONSTANTS: usize = 4096;

/// Longest symbol name kept.
const MAX_NAME: usize = 160;

/// Largest field offset believed: V8's objects read here are a few words long.
const MAX_FIELD_OFFSET: i64 = 4096;

/// JavaScript function instance types from V8 9.6 on: `JS_FUNCTION_TYPE` and the
/// constructor kinds V8 gave types of their own, numbered after it.
const JS_FUNCTION_TYPES: u16 = 15;

/// The `v8dbg_` constants of one file, by name without the prefix.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Constants(HashMap<String, i64>);

impl Constants {
    /// Reads the `v8dbg_` symbols `elf` exports (values in its data; zero in its
    /// `.bss`). Empty for a file that exports none.
    pub fn read(elf: &object::File<'_>) -> Self {
        let mut values = HashMap::new();
        for symbol in elf.dynamic_symbols() {
            if values.len() >= MAX_CONSTANTS {
                break;
            }
            let Ok(name) = symbol.name() else { continue };
            let Some(short) = name.strip_prefix("v8dbg_") else {
                continue;
            };
            if short.len() > MAX_NAME || symbol.size() != 4 || !symbol.is_definition() {
                continue;
            }
            if let Some(value) = value_at(elf, symbol.address()) {
                values.insert(short.to_string(), value);
            }
        }
        Self(values)
    }

    /// From pairs (tests).
    pub fn from_pairs(pairs: &[(&str, i64)]) -> Self {
        Self(pairs.iter().map(|&(n, v)| (n.to_string(), v)).collect())
    }

    /// True when the file exports none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The constant `name`.
    fn get(&self, name: &'static str) -> Result<i64, NodeError> {
        self.0
            .get(name)
            .copied()
            .ok_or(NodeError::MissingConstant(name))
    }

    /// The first of `names` the file defines.
    fn any(&self, names: &[&'static str]) -> Result<i64, NodeError> {
        (names.iter())
            .find_map(|name| self.0.get(*name).copied())
            .ok_or(NodeError::MissingConstant(names[0]))
    }

    /// A field offset: `0 ..= MAX_FIELD_OFFSET`.
    fn field(&self, names: &[&'static str]) -> Result<u32, NodeError> {
        let value = self.any(names)?;
        match (0..=MAX_FIELD_OFFSET).contains(&value) {
            true => Ok(value as u32),
            false => Err(NodeError::Forged(names[0], value)),
        }
    }

    /// An instance type: a 16-bit value.
    fn instance_type(&self, name: &'static str) -> Result<u16, NodeError> {
        let value = self.get(name)?;
        u16::try_from(value).map_err(|_| NodeError::Forged(name, value))
    }

    /// A frame slot: a whole negative number of words from the frame pointer.
    fn slot(&self, name: &'static str) -> Result<i64, NodeError> {
        let value = self.get(name)?;
        match (-256..0).contains(&value) && value % 8 == 0 {
            true => Ok(value),
            false => Err(NodeError::Forged(name, value)),
        }
    }

    /// A value that must be exactly `expected` for this reading.
    fn exactly(&self, name: &'static str, expected: i64) -> Result<(), NodeError> {
        match self.get(name)? {
            value if value == expected => Ok(()),
            value => Err(NodeError::Forged(name, value)),
        }
    }
}

/// An instance type a build may not have.
fn optional_type(c: &Constants, name: &'static str) -> Result<Option<u16>, NodeError> {
    match c.instance_type(name) {
        Ok(value) => Ok(Some(value)),
        Err(NodeError::MissingConstant(_)) => Ok(None),
        Err(error) => Err(error),
    }
}

/// The 32-bit signed value at `address` in `elf`'s sections (0 in a section without
/// file data, the `.bss`).
fn value_at(elf: &object::File<'_>, address: u64) -> Option<i64> {
    let (data, at) = section_at(elf, address, 4)?;
    if data.is_empty() {
        return Some(0);
    }
    let bytes: [u8; 4] = data.get(at..at + 4)?.try_into().ok()?;
    Some(i32::from_le_bytes(bytes) as i64)
}

/// The file data of the section of `elf` that holds the `length` bytes at `address`,
/// and where they start in it (empty for a section without file data, the `.bss`).
/// Forged headers whose sums overflow hold nothing.
pub(crate) fn section_at<'d>(
    elf: &object::File<'d>,
    address: u64,
    length: u64,
) -> Option<(&'d [u8], usize)> {
    let section = elf.sections().find(|section| {
        let end = section.address().checked_add(section.size());
        address >= section.address()
            && (address.checked_add(length).zip(end)).is_some_and(|(last, limit)| last <= limit)
    })?;
    let at = usize::try_from(address - section.address()).ok()?;
    Some((section.data().ok()?, at))
}

/// Instance types this reading tells apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Types {
    /// `JS_FUNCTION_TYPE`, the first of the function types.
    pub js_function: u16,
    /// `SHARED_FUNCTION_INFO_TYPE`.
    pub shared_function_info: u16,
    /// `SCRIPT_TYPE`.
    pub script: u16,
    /// `SCOPE_INFO_TYPE`.
    pub scope_info: u16,
    /// `BYTECODE_ARRAY_TYPE`.
    pub bytecode_array: u16,
    /// `BYTE_ARRAY_TYPE`.
    pub byte_array: u16,
    /// `TRUSTED_BYTE_ARRAY_TYPE` (V8 12's position tables), else `byte_array`.
    pub trusted_byte_array: u16,
    /// `FIXED_ARRAY_TYPE`.
    pub fixed_array: u16,
    /// `PROTECTED_FIXED_ARRAY_TYPE` (V8 12's deoptimization data), else `fixed_array`.
    pub protected_fixed_array: u16,
    /// `CODE_TYPE`.
    pub code: u16,
    /// `WEAK_FIXED_ARRAY_TYPE` (an optimized code's literals).
    pub weak_fixed_array: u16,
    /// `INSTRUCTION_STREAM_TYPE`: the heap object generated machine code is in.
    pub instruction_stream: u16,
    /// Types below it are strings.
    pub first_nonstring: u16,
}

impl Types {
    /// True for a JavaScript function's type.
    pub fn is_function(&self, instance_type: u16) -> bool {
        instance_type
            .checked_sub(self.js_function)
            .is_some_and(|n| n < JS_FUNCTION_TYPES)
    }
}

/// How strings are told apart by their instance type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StringTags {
    /// Bits of the representation.
    pub representation_mask: u16,
    /// Bit of the encoding.
    pub encoding_mask: u16,
    /// The encoding bit's value for one-byte strings.
    pub one_byte: u16,
    /// Representation: characters in the object.
    pub sequential: u16,
    /// Representation: two strings joined.
    pub cons: u16,
    /// Representation: characters outside the heap.
    pub external: u16,
    /// Representation: a part of another string.
    pub sliced: u16,
    /// Representation: a forward to the string's internalized copy.
    pub thin: u16,
}

/// Byte offsets of the fields read, in tagged objects (add to the untagged address).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fields {
    /// `HeapObject::map`.
    pub map: u32,
    /// `Map::instance_type` (16 bits).
    pub instance_type: u32,
    /// `JSFunction::shared`.
    pub function_shared: u32,
    /// `JSFunction::code` (known from the version: not published).
    pub function_code: u32,
    /// `SharedFunctionInfo::name_or_scope_info`.
    pub shared_name: u32,
    /// `SharedFunctionInfo::script_or_debug_info`.
    pub shared_script: u32,
    /// `Script::name`.
    pub script_name: u32,
    /// `Script::source`.
    pub script_source: u32,
    /// `Script::line_ends`.
    pub script_line_ends: u32,
    /// `String::length` (32 bits).
    pub string_length: u32,
    /// `SeqOneByteString::chars`, `SeqTwoByteString::chars`.
    pub sequential_chars: u32,
    /// `ConsString::first`.
    pub cons_first: u32,
    /// `ConsString::second`.
    pub cons_second: u32,
    /// `ThinString::actual`.
    pub thin_actual: u32,
    /// `SlicedString::parent`.
    pub sliced_parent: u32,
    /// `SlicedString::offset` (a Smi).
    pub sliced_offset: u32,
    /// `ExternalString::resource`; the cached data pointer is the next word.
    pub external_resource: u32,
    /// `FixedArrayBase::length` (a Smi).
    pub array_length: u32,
    /// `FixedArray::data`, `ByteArray`'s too.
    pub array_data: u32,
    /// `BytecodeArray`'s bytecodes (a frame's bytecode offset counts from the array's
    /// tagged pointer plus this, less the tag).
    pub bytecode_data: u32,
    /// `BytecodeArray::source_position_table` (not published since V8 9.4: it follows
    /// the length and two other fields).
    pub bytecode_positions: u32,
    /// `Code::source_position_table`.
    pub code_positions: u32,
    /// `Code::instruction_start` (a raw address; V8 11 does not publish it: two words
    /// after the table).
    pub code_start: u32,
    /// `Code::flags` (32 bits; V8 11: three words after the table).
    pub code_flags: u32,
    /// `Code::instruction_size` (32 bits; V8 11: four words after the table).
    pub code_size: u32,
    /// `InstructionStream`'s header: its machine code starts this far from its
    /// untagged address, and its `Code` is the word before.
    pub stream_header: u32,
    /// `Code::deoptimization_data` (a fixed array).
    pub code_deoptimization: u32,
    /// The deoptimization data's element holding the inlined functions' literals.
    pub deoptimization_literals: u32,
    /// The deoptimization data's element holding the inlining positions.
    pub deoptimization_inlining: u32,
    /// The mask of a code's kind in its flags (the 32 bits after its instructions'
    /// start, not published) and the kinds of optimized code (the two after
    /// `BASELINE`: Maglev's and Turbofan's).
    pub code_kind_mask: u32,
    /// `CodeKind::BASELINE`.
    pub code_kind_baseline: u32,
    /// `ScopeInfo`'s slot holding its count of context locals, in words after the map.
    pub scope_context_locals: u32,
    /// `ScopeInfo`'s first variable slot, in words after the map.
    pub scope_first_vars: u32,
}

/// A JavaScript frame's slots, in bytes from its frame pointer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameSlots {
    /// The context, or a typed frame's Smi marker.
    pub context_or_type: i64,
    /// The `JSFunction`.
    pub function: i64,
    /// An interpreted frame's `BytecodeArray`.
    pub bytecode_array: i64,
    /// An interpreted frame's bytecode offset (a Smi).
    pub bytecode_offset: i64,
}

/// What JavaScript frames are read with, in one V8 build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// V8's major and minor version.
    pub version: (u32, u32),
    /// Instance types.
    pub types: Types,
    /// String tags.
    pub strings: StringTags,
    /// Field offsets.
    pub fields: Fields,
    /// Frame slots.
    pub slots: FrameSlots,
}

impl Layout {
    /// Reads and checks the constants of a V8 `version` build.
    pub fn new(constants: &Constants, version: (u32, u32)) -> Result<Self, NodeError> {
        if version.0 < 11 {
            return Err(NodeError::TooOld(version.0, version.1));
        }
        let c = constants;
        // Full 64-bit tagged words, 32-bit Smis in the upper half.
        c.exactly("TaggedSize", 8)?;
        c.exactly("SystemPointerSize", 8)?;
        c.exactly("HeapObjectTag", 1)?;
        c.exactly("HeapObjectTagMask", 3)?;
        c.exactly("SmiTagMask", 1)?;
        c.exactly("SmiShiftSize", 31)?;
        let types = Types {
            js_function: c.instance_type("type_JSFunction__JS_FUNCTION_TYPE")?,
            shared_function_info: c
                .instance_type("type_SharedFunctionInfo__SHARED_FUNCTION_INFO_TYPE")?,
            script: c.instance_type("type_Script__SCRIPT_TYPE")?,
            scope_info: c.instance_type("type_ScopeInfo__SCOPE_INFO_TYPE")?,
            bytecode_array: c.instance_type("type_BytecodeArray__BYTECODE_ARRAY_TYPE")?,
            byte_array: c.instance_type("type_ByteArray__BYTE_ARRAY_TYPE")?,
            trusted_byte_array: optional_type(c, "type_TrustedByteArray__TRUSTED_BYTE_ARRAY_TYPE")?
                .unwrap_or(c.instance_type("type_ByteArray__BYTE_ARRAY_TYPE")?),
            fixed_array: c.instance_type("type_FixedArray__FIXED_ARRAY_TYPE")?,
            protected_fixed_array: optional_type(
                c,
                "type_ProtectedFixedArray__PROTECTED_FIXED_ARRAY_TYPE",
            )?
            .unwrap_or(c.instance_type("type_FixedArray__FIXED_ARRAY_TYPE")?),
            code: c.instance_type("type_Code__CODE_TYPE")?,
            weak_fixed_array: c.instance_type("type_WeakFixedArray__WEAK_FIXED_ARRAY_TYPE")?,
            instruction_stream: c
                .instance_type("type_InstructionStream__INSTRUCTION_STREAM_TYPE")?,
            first_nonstring: c.instance_type("FirstNonstringType")?,
        };
        let mask = |name| c.instance_type(name);
        let strings = StringTags {
            representation_mask: mask("StringRepresentationMask")?,
            encoding_mask: mask("StringEncodingMask")?,
            one_byte: mask("OneByteStringTag")?,
            sequential: mask("SeqStringTag")?,
            cons: mask("ConsStringTag")?,
            external: mask("ExternalStringTag")?,
            sliced: mask("SlicedStringTag")?,
            thin: mask("ThinStringTag")?,
        };
        let array_length = c.field(&["class_FixedArrayBase__length__SMI"])?;
        let function_shared = c.field(&[
            "class_JSFunction__shared__SharedFunctionInfo",
            "class_JSFunction__shared__Tagged_SharedFunctionInfo_",
        ])?;
        let published = |names: &[&'static str], derived: u32| match c.field(names) {
            Err(NodeError::MissingConstant(_)) => Ok(derived),
            other => other,
        };
        // V8 12 publishes where a code's instructions start but not its table, three
        // words before; V8 11 the table only.
        let code_positions = match c.field(&["class_Code__instruction_start__Address"]) {
            Ok(start) if start >= 24 => start - 24,
            _ => c.field(&[
                "class_Code__source_position_table__ByteArray",
                "class_Code__source_position_table__Tagged_ByteArray_",
            ])?,
        };
        let fields = Fields {
            map: c.field(&[
                "class_HeapObject__map__Map",
                "class_HeapObject__map__Tagged_Map_",
            ])?,
            instance_type: c.field(&["class_Map__instance_type__uint16_t"])?,
            function_shared,
            // V8 11.7 put the code before the shared info; before, three words after.
            function_code: published(
                &[
                    "class_JSFunction__code__Tagged_Code_",
                    "class_JSFunction__code__Code",
                ],
                match version >= (11, 7) {
                    true => function_shared.checked_sub(8).ok_or(NodeError::Forged(
                        "class_JSFunction__shared__SharedFunctionInfo",
                        function_shared as i64,
                    ))?,
                    false => function_shared + 24,
                },
            )?,
            shared_name: c.field(&[
                "class_SharedFunctionInfo__name_or_scope_info__Object",
                "class_SharedFunctionInfo__name_or_scope_info__Tagged_Object_",
                "class_SharedFunctionInfo__name_or_scope_info__Tagged_NameOrScopeInfoT_",
            ])?,
            shared_script: c.field(&[
                "class_SharedFunctionInfo__script_or_debug_info__HeapObject",
                "class_SharedFunctionInfo__script_or_debug_info__Tagged_HeapObject_",
                "class_SharedFunctionInfo__script__Tagged_HeapObject_",
            ])?,
            script_name: c.field(&[
                "class_Script__name__Object",
                "class_Script__name__Tagged_Object_",
            ])?,
            script_source: c.field(&[
                "class_Script__source__Object",
                "class_Script__source__Tagged_Object_",
            ])?,
            script_line_ends: c.field(&[
                "class_Script__line_ends__Object",
                "class_Script__line_ends__Tagged_Object_",
            ])?,
            string_length: c.field(&["class_String__length__int32_t"])?,
            sequential_chars: c.field(&["class_SeqOneByteString__chars__char"])?,
            cons_first: c.field(&[
                "class_ConsString__first__String",
                "class_ConsString__first__Tagged_String_",
            ])?,
            cons_second: c.field(&[
                "class_ConsString__second__String",
                "class_ConsString__second__Tagged_String_",
            ])?,
            thin_actual: c.field(&[
                "class_ThinString__actual__String",
                "class_ThinString__actual__Tagged_String_",
            ])?,
            sliced_parent: c.field(&[
                "class_SlicedString__parent__String",
                "class_SlicedString__parent__Tagged_String_",
            ])?,
            sliced_offset: c.field(&["class_SlicedString__offset__SMI"])?,
            external_resource: c.field(&["class_ExternalString__resource__Object"])?,
            array_length,
            array_data: c.field(&["class_FixedArray__data__uintptr_t"])?,
            bytecode_data: c.field(&["class_BytecodeArray__data__uintptr_t"])?,
            // Not published since V8 9.4: after the length and two fields (V8 11), after
            // the wrapper V8 12 added.
            bytecode_positions: published(
                &["class_BytecodeArray__wrapper__Tagged_BytecodeWrapper_"],
                array_length + 16,
            )? + 8,
            code_positions,
            code_start: published(
                &["class_Code__instruction_start__Address"],
                code_positions + 16,
            )?,
            code_flags: published(&["class_Code__flags__uint32_t"], code_positions + 24)?,
            code_size: published(&["class_Code__instruction_size__int"], code_positions + 32)?,
            stream_header: c.field(&["class_InstructionStream__instruction_start__uintptr_t"])?,
            code_deoptimization: published(
                &[
                    "class_Code__deoptimization_data__FixedArray",
                    "class_Code__deoptimization_data__Tagged_FixedArray_",
                ],
                code_positions.saturating_sub(8),
            )?,
            deoptimization_literals: c.field(&["DeoptimizationDataLiteralArrayIndex"])?,
            deoptimization_inlining: c.field(&["DeoptimizationDataInliningPositionsIndex"])?,
            code_kind_mask: c.field(&["CodeKindFieldMask"])?,
            code_kind_baseline: c.field(&["CodeKindBaseline"])?,
            scope_context_locals: c.field(&["scopeinfo_idx_ncontextlocals"])?,
            scope_first_vars: c.field(&["scopeinfo_idx_first_vars"])?,
        };
        // A stream's code is the word after its map: its instructions start after both.
        if fields.stream_header < 16 {
            return Err(NodeError::Forged(
                "class_InstructionStream__instruction_start__uintptr_t",
                fields.stream_header as i64,
            ));
        }
        if fields.sequential_chars != c.field(&["class_SeqTwoByteString__chars__char"])? {
            return Err(NodeError::Forged(
                "class_SeqTwoByteString__chars__char",
                fields.sequential_chars as i64,
            ));
        }
        let slots = FrameSlots {
            context_or_type: c.slot("off_fp_context_or_frame_type")?,
            function: c.slot("off_fp_function")?,
            bytecode_array: c.slot("off_fp_bytecode_array")?,
            bytecode_offset: c.slot("off_fp_bytecode_offset")?,
        };
        Ok(Layout {
            version,
            types,
            strings,
            fields,
            slots,
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The constants of Debian's Node.js 20 (V8 11.3) that this reading uses.
    pub(crate) fn node20() -> Constants {
        Constants::from_pairs(&[
            ("TaggedSize", 8),
            ("SystemPointerSize", 8),
            ("HeapObjectTag", 1),
            ("HeapObjectTagMask", 3),
            ("SmiTagMask", 1),
            ("SmiShiftSize", 31),
            ("type_JSFunction__JS_FUNCTION_TYPE", 2066),
            ("type_SharedFunctionInfo__SHARED_FUNCTION_INFO_TYPE", 262),
            ("type_Script__SCRIPT_TYPE", 167),
            ("type_ScopeInfo__SCOPE_INFO_TYPE", 261),
            ("type_BytecodeArray__BYTECODE_ARRAY_TYPE", 191),
            ("type_ByteArray__BYTE_ARRAY_TYPE", 190),
            ("type_FixedArray__FIXED_ARRAY_TYPE", 175),
            ("type_Code__CODE_TYPE", 245),
            ("type_WeakFixedArray__WEAK_FIXED_ARRAY_TYPE", 240),
            ("type_InstructionStream__INSTRUCTION_STREAM_TYPE", 252),
            ("class_InstructionStream__instruction_start__uintptr_t", 16),
            ("class_Code__deoptimization_data__FixedArray", 16),
            ("DeoptimizationDataLiteralArrayIndex", 2),
            ("DeoptimizationDataInliningPositionsIndex", 7),
            ("CodeKindFieldMask", 15),
            ("CodeKindBaseline", 11),
            ("FirstNonstringType", 128),
            ("StringRepresentationMask", 7),
            ("StringEncodingMask", 8),
            ("OneByteStringTag", 8),
            ("SeqStringTag", 0),
            ("ConsStringTag", 1),
            ("ExternalStringTag", 2),
            ("SlicedStringTag", 3),
            ("ThinStringTag", 5),
            ("class_FixedArrayBase__length__SMI", 8),
            ("class_JSFunction__shared__SharedFunctionInfo", 24),
            ("class_HeapObject__map__Map", 0),
            ("class_Map__instance_type__uint16_t", 12),
            ("class_SharedFunctionInfo__name_or_scope_info__Object", 16),
            (
                "class_SharedFunctionInfo__script_or_debug_info__HeapObject",
                32,
            ),
            ("class_Script__name__Object", 16),
            ("class_Script__source__Object", 8),
            ("class_Script__line_ends__Object", 56),
            ("class_String__length__int32_t", 12),
            ("class_SeqOneByteString__chars__char", 16),
            ("class_SeqTwoByteString__chars__char", 16),
            ("class_ConsString__first__String", 16),
            ("class_ConsString__second__String", 24),
            ("class_ThinString__actual__String", 16),
            ("class_SlicedString__parent__String", 16),
            ("class_SlicedString__offset__SMI", 24),
            ("class_ExternalString__resource__Object", 16),
            ("class_FixedArray__data__uintptr_t", 16),
            ("class_BytecodeArray__data__uintptr_t", 54),
            ("class_Code__source_position_table__ByteArray", 24),
            ("scopeinfo_idx_ncontextlocals", 2),
            ("scopeinfo_idx_first_vars", 3),
            ("off_fp_context_or_frame_type", -8),
            ("off_fp_function", -16),
            ("off_fp_bytecode_array", -32),
            ("off_fp_bytecode_offset", -40),
        ])
    }

    #[test]
    fn node20_constants_make_a_layout() {
        let layout = Layout::new(&node20(), (11, 3)).unwrap();
        assert_eq!(layout.fields.function_code, 48);
        assert_eq!(layout.fields.bytecode_positions, 32);
        assert!(layout.types.is_function(2066) && layout.types.is_function(2080));
        assert!(!layout.types.is_function(2081));
    }

    #[test]
    fn forged_constants_are_refused_with_their_name() {
        let with = |name: &str, value: i64| {
            let mut constants = node20();
            constants.0.insert(name.to_string(), value);
            Layout::new(&constants, (11, 3)).unwrap_err()
        };
        assert_eq!(
            with("off_fp_function", 4096),
            NodeError::Forged("off_fp_function", 4096)
        );
        assert_eq!(
            with("class_JSFunction__shared__SharedFunctionInfo", 1 << 30),
            NodeError::Forged("class_JSFunction__shared__SharedFunctionInfo", 1 << 30)
        );
        assert_eq!(with("TaggedSize", 4), NodeError::Forged("TaggedSize", 4));
        assert_eq!(
            with("type_Script__SCRIPT_TYPE", -1),
            NodeError::Forged("type_Script__SCRIPT_TYPE", -1)
        );
        let mut missing = node20();
        missing.0.remove("class_Script__line_ends__Object");
        assert_eq!(
            Layout::new(&missing, (11, 3)).unwrap_err(),
            NodeError::MissingConstant("class_Script__line_ends__Object")
        );
        assert_eq!(
            Layout::new(&node20(), (10, 2)).unwrap_err(),
            NodeError::TooOld(10, 2)
        );
    }
}
