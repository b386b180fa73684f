//! V8's debug constants: the `v8dbg_` symbols every node binary exports (offsets of
//! object fields, instance types, frame slots), each a 32-bit value in the binary's
//! data, read from the file the process maps and checked against what any V8 build
//! can have. This reading is for 64-bit V8 11 and 12 without pointer compression (how
//! Node.js builds it); anything else is refused with its reason.

use std::collections::HashMap;

use object::{Object, ObjectSection, ObjectSymbol};

use crate::NodeError;

mod layout;

pub use self::layout::{Fields, FrameSlots, Layout, StringTags, Types};

/// Most `v8dbg_` symbols kept from one file (V8 11 has about 530).
const MAX_CONSTANTS: usize = 4096;

/// Longest symbol name kept.
const MAX_NAME: usize = 160;

/// Largest field offset believed: V8's objects read here are a few words long.
const MAX_FIELD_OFFSET: i64 = 4096;

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

    /// A field offset as [`Constants::field`] reads it, or `derived` when the build
    /// does not publish it: V8 stopped publishing some whose place follows from others.
    fn field_or_derived(&self, names: &[&'static str], derived: u32) -> Result<u32, NodeError> {
        match self.field(names) {
            Err(NodeError::MissingConstant(_)) => Ok(derived),
            other => other,
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
