//! The layout JavaScript frames are read with in one V8 build: its instance types,
//! string tags, field offsets and frame slots, read from its debug constants and
//! checked. The constants' own reading stays in the parent module, which every file
//! read goes through; this is what those constants mean.

use super::{optional_type, Constants};
use crate::NodeError;

/// JavaScript function instance types from V8 9.6 on: `JS_FUNCTION_TYPE` and the
/// constructor kinds V8 gave types of their own, numbered after it.
const JS_FUNCTION_TYPES: u16 = 15;

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
        check_word_layout(constants)?;
        Ok(Layout {
            version,
            types: Types::read(constants)?,
            strings: StringTags::read(constants)?,
            fields: Fields::read(constants, version)?,
            slots: FrameSlots::read(constants)?,
        })
    }
}

/// Refuses a build whose words are not what this reading assumes: full 64-bit tagged
/// words, 32-bit Smis in the upper half (no pointer compression).
fn check_word_layout(c: &Constants) -> Result<(), NodeError> {
    c.exactly("TaggedSize", 8)?;
    c.exactly("SystemPointerSize", 8)?;
    c.exactly("HeapObjectTag", 1)?;
    c.exactly("HeapObjectTagMask", 3)?;
    c.exactly("SmiTagMask", 1)?;
    c.exactly("SmiShiftSize", 31)?;
    Ok(())
}

impl Types {
    /// Reads the instance types; those a build may lack fall back on the type V8 used
    /// for the same objects before it split them off.
    fn read(c: &Constants) -> Result<Self, NodeError> {
        Ok(Types {
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
        })
    }
}

impl StringTags {
    /// Reads the bits strings are told apart by.
    fn read(c: &Constants) -> Result<Self, NodeError> {
        let mask = |name| c.instance_type(name);
        Ok(StringTags {
            representation_mask: mask("StringRepresentationMask")?,
            encoding_mask: mask("StringEncodingMask")?,
            one_byte: mask("OneByteStringTag")?,
            sequential: mask("SeqStringTag")?,
            cons: mask("ConsStringTag")?,
            external: mask("ExternalStringTag")?,
            sliced: mask("SlicedStringTag")?,
            thin: mask("ThinStringTag")?,
        })
    }
}

impl Fields {
    /// Reads the field offsets of a V8 `version` build, those it does not publish
    /// derived from those it does, and checks the two it can check against others.
    fn read(c: &Constants, version: (u32, u32)) -> Result<Self, NodeError> {
        let array_length = c.field(&["class_FixedArrayBase__length__SMI"])?;
        let function_shared = c.field(&[
            "class_JSFunction__shared__SharedFunctionInfo",
            "class_JSFunction__shared__Tagged_SharedFunctionInfo_",
        ])?;
        let code_positions = code_positions(c)?;
        let fields = Fields {
            map: c.field(&[
                "class_HeapObject__map__Map",
                "class_HeapObject__map__Tagged_Map_",
            ])?,
            instance_type: c.field(&["class_Map__instance_type__uint16_t"])?,
            function_shared,
            function_code: function_code(c, version, function_shared)?,
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
            bytecode_positions: bytecode_positions(c, array_length)?,
            code_positions,
            code_start: c.field_or_derived(
                &["class_Code__instruction_start__Address"],
                code_positions + 16,
            )?,
            code_flags: c
                .field_or_derived(&["class_Code__flags__uint32_t"], code_positions + 24)?,
            code_size: c
                .field_or_derived(&["class_Code__instruction_size__int"], code_positions + 32)?,
            stream_header: c.field(&["class_InstructionStream__instruction_start__uintptr_t"])?,
            code_deoptimization: c.field_or_derived(
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
        fields.check(c)?;
        Ok(fields)
    }

    /// Refuses offsets that contradict what else is known of the objects: each is
    /// within bounds on its own, so only these relations can tell a forged one.
    fn check(&self, c: &Constants) -> Result<(), NodeError> {
        // A stream's code is the word after its map: its instructions start after both.
        if self.stream_header < 16 {
            return Err(NodeError::Forged(
                "class_InstructionStream__instruction_start__uintptr_t",
                self.stream_header as i64,
            ));
        }
        if self.sequential_chars != c.field(&["class_SeqTwoByteString__chars__char"])? {
            return Err(NodeError::Forged(
                "class_SeqTwoByteString__chars__char",
                self.sequential_chars as i64,
            ));
        }
        Ok(())
    }
}

/// `Code::source_position_table`: V8 12 publishes where a code's instructions start
/// but not its table, three words before; V8 11 the table only.
fn code_positions(c: &Constants) -> Result<u32, NodeError> {
    Ok(match c.field(&["class_Code__instruction_start__Address"]) {
        Ok(start) if start >= 24 => start - 24,
        _ => c.field(&[
            "class_Code__source_position_table__ByteArray",
            "class_Code__source_position_table__Tagged_ByteArray_",
        ])?,
    })
}

/// `JSFunction::code`, where a build does not publish it: V8 11.7 put the code before
/// the shared info; before, three words after.
fn function_code(
    c: &Constants,
    version: (u32, u32),
    function_shared: u32,
) -> Result<u32, NodeError> {
    c.field_or_derived(
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
    )
}

/// `BytecodeArray::source_position_table`, not published since V8 9.4: after the
/// length and two fields (V8 11), after the wrapper V8 12 added.
fn bytecode_positions(c: &Constants, array_length: u32) -> Result<u32, NodeError> {
    Ok(c.field_or_derived(
        &["class_BytecodeArray__wrapper__Tagged_BytecodeWrapper_"],
        array_length + 16,
    )? + 8)
}

impl FrameSlots {
    /// Reads a JavaScript frame's slots.
    fn read(c: &Constants) -> Result<Self, NodeError> {
        Ok(FrameSlots {
            context_or_type: c.slot("off_fp_context_or_frame_type")?,
            function: c.slot("off_fp_function")?,
            bytecode_array: c.slot("off_fp_bytecode_array")?,
            bytecode_offset: c.slot("off_fp_bytecode_offset")?,
        })
    }
}
