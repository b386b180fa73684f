//! HotSpot's own description of itself: the `gHotSpotVMStructs`, `gHotSpotVMTypes` and
//! `gHotSpotVMIntConstants` tables that libjvm exports for its serviceability agent.
//! Each entry names a field of a VM type and gives its offset (or a static's address),
//! each type its size: what lets allocbpf read a JVM's structures without compiling
//! against its headers, whatever its version.
//!
//! The tables are the target's memory and read as hostile input: at most
//! [`MAX_ENTRIES`] entries a table, names of at most [`MAX_NAME`] bytes, strides and
//! field offsets checked against each other, and only the types allocbpf asks for kept.

use std::collections::HashMap;

use allocbpf_images::memory::ProcessMemory;

use crate::JvmError;

/// Most entries read from one table (HotSpot has a few thousand).
pub const MAX_ENTRIES: usize = 16_384;

/// Longest type or field name read.
pub const MAX_NAME: usize = 128;

/// Largest entry stride believed.
const MAX_STRIDE: u64 = 256;

/// The exported symbols the tables are found from, as addresses in the process.
#[derive(Clone, Debug, Default)]
pub struct TableSymbols {
    /// Every `gHotSpotVM*` symbol: its name and its address in the process.
    pub addresses: HashMap<&'static str, u64>,
}

/// The `gHotSpotVM*` symbols read.
pub const SYMBOLS: &[&str] = &[
    "gHotSpotVMStructs",
    "gHotSpotVMStructEntryArrayStride",
    "gHotSpotVMStructEntryTypeNameOffset",
    "gHotSpotVMStructEntryFieldNameOffset",
    "gHotSpotVMStructEntryIsStaticOffset",
    "gHotSpotVMStructEntryOffsetOffset",
    "gHotSpotVMStructEntryAddressOffset",
    "gHotSpotVMTypes",
    "gHotSpotVMTypeEntryArrayStride",
    "gHotSpotVMTypeEntryTypeNameOffset",
    "gHotSpotVMTypeEntrySizeOffset",
    "gHotSpotVMIntConstants",
    "gHotSpotVMIntConstantEntryArrayStride",
    "gHotSpotVMIntConstantEntryNameOffset",
    "gHotSpotVMIntConstantEntryValueOffset",
];

/// One field: its offset in its type, or a static's address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Field {
    /// A member at this byte offset.
    Member(u64),
    /// A static at this address in the process.
    Static(u64),
}

/// The parts of a JVM's tables allocbpf asked for.
#[derive(Clone, Debug, Default)]
pub struct VmStructs {
    fields: HashMap<(String, String), Field>,
    sizes: HashMap<String, u64>,
    ints: HashMap<String, i64>,
}

impl VmStructs {
    /// Reads the fields of `types`, the sizes of `types` and the integer constants
    /// named `constants` from process `memory`'s tables.
    pub fn read(
        memory: &ProcessMemory,
        symbols: &TableSymbols,
        types: &[&str],
        constants: &[&str],
    ) -> Result<VmStructs, JvmError> {
        let mut reader = TableReader {
            memory,
            symbols,
            names: HashMap::new(),
        };
        let mut out = VmStructs::default();
        reader.each("gHotSpotVMStruct", |reader, entry| {
            let Some(type_name) = reader.name_at(entry, "TypeName")? else {
                return Ok(false);
            };
            if !types.contains(&type_name.as_str()) {
                return Ok(true);
            }
            let field = reader.name_at(entry, "FieldName")?.unwrap_or_default();
            let is_static = reader.word_at(entry, "IsStatic", 4)? != 0;
            let value = if is_static {
                Field::Static(reader.word_at(entry, "Address", 8)?)
            } else {
                Field::Member(reader.word_at(entry, "Offset", 8)?)
            };
            out.fields.insert((type_name, field), value);
            Ok(true)
        })?;
        reader.each("gHotSpotVMType", |reader, entry| {
            let Some(type_name) = reader.name_at(entry, "TypeName")? else {
                return Ok(false);
            };
            if types.contains(&type_name.as_str()) {
                out.sizes
                    .insert(type_name, reader.word_at(entry, "Size", 8)?);
            }
            Ok(true)
        })?;
        reader.each("gHotSpotVMIntConstant", |reader, entry| {
            let Some(name) = reader.name_at(entry, "Name")? else {
                return Ok(false);
            };
            if constants.contains(&name.as_str()) {
                let value = reader.word_at(entry, "Value", 4)? as u32 as i32;
                out.ints.insert(name, i64::from(value));
            }
            Ok(true)
        })?;
        Ok(out)
    }

    /// `type_name::field`'s offset.
    pub fn offset(&self, type_name: &str, field: &str) -> Result<u64, JvmError> {
        match self.field(type_name, field) {
            Some(Field::Member(offset)) => Ok(offset),
            _ => Err(missing(type_name, field)),
        }
    }

    /// The address of static `type_name::field`.
    pub fn address(&self, type_name: &str, field: &str) -> Result<u64, JvmError> {
        match self.field(type_name, field) {
            Some(Field::Static(address)) => Ok(address),
            _ => Err(missing(type_name, field)),
        }
    }

    /// `type_name::field`, if the tables have it.
    pub fn field(&self, type_name: &str, field: &str) -> Option<Field> {
        let key = (type_name.to_string(), field.to_string());
        self.fields.get(&key).copied()
    }

    /// `sizeof(type_name)`.
    pub fn size(&self, type_name: &str) -> Result<u64, JvmError> {
        (self.sizes.get(type_name).copied()).ok_or_else(|| missing(type_name, "sizeof"))
    }

    /// Integer constant `name`, if the tables have it.
    pub fn int(&self, name: &str) -> Option<i64> {
        self.ints.get(name).copied()
    }

    /// Tables made by hand (tests).
    #[cfg(test)]
    pub fn from_parts(
        fields: &[(&str, &str, Field)],
        sizes: &[(&str, u64)],
        ints: &[(&str, i64)],
    ) -> VmStructs {
        VmStructs {
            fields: (fields.iter())
                .map(|(t, f, v)| ((t.to_string(), f.to_string()), *v))
                .collect(),
            sizes: sizes.iter().map(|(t, s)| (t.to_string(), *s)).collect(),
            ints: ints.iter().map(|(n, v)| (n.to_string(), *v)).collect(),
        }
    }
}

fn missing(type_name: &str, field: &str) -> JvmError {
    JvmError::MissingField(format!("{type_name}::{field}"))
}

/// Reads one table after another, remembering names by address (the same literal
/// names many entries).
struct TableReader<'a> {
    memory: &'a ProcessMemory,
    symbols: &'a TableSymbols,
    names: HashMap<u64, Option<String>>,
}

/// One table entry: its address and the table's prefix (`gHotSpotVMStruct`).
#[derive(Clone, Copy)]
struct Entry {
    address: u64,
    table: &'static str,
}

impl TableReader<'_> {
    /// The value of the global `symbol` (a word in libjvm's data).
    fn global(&self, symbol: String) -> Result<u64, JvmError> {
        let address = *(self.symbols.addresses.get(symbol.as_str()))
            .ok_or(JvmError::MissingSymbol(symbol))?;
        self.memory
            .u64(address)
            .map_err(|_| JvmError::Unreadable("a table global"))
    }

    /// Calls `visit` on each entry of table `table` until it answers `false` (the
    /// table's null terminator) or [`MAX_ENTRIES`].
    fn each(
        &mut self,
        table: &'static str,
        mut visit: impl FnMut(&mut Self, Entry) -> Result<bool, JvmError>,
    ) -> Result<(), JvmError> {
        let base = self.global(format!("{table}s"))?;
        let stride = self.global(format!("{table}EntryArrayStride"))?;
        if stride == 0 || stride > MAX_STRIDE {
            return Err(JvmError::Forged("a table's stride"));
        }
        for index in 0..MAX_ENTRIES as u64 {
            let entry = Entry {
                address: base.wrapping_add(index * stride),
                table,
            };
            if !visit(self, entry)? {
                return Ok(());
            }
        }
        Err(JvmError::Forged("a table without its terminator"))
    }

    /// The offset of `field` in `entry`'s table's entries.
    fn field_offset(&self, entry: Entry, field: &str) -> Result<u64, JvmError> {
        let offset = self.global(format!("{}Entry{field}Offset", entry.table))?;
        if offset >= MAX_STRIDE {
            return Err(JvmError::Forged("a table's field offset"));
        }
        Ok(offset)
    }

    /// The `width`-byte little-endian word `field` of `entry`.
    fn word_at(&self, entry: Entry, field: &str, width: usize) -> Result<u64, JvmError> {
        let address = entry.address.wrapping_add(self.field_offset(entry, field)?);
        let mut bytes = [0u8; 8];
        (self.memory.read(address, &mut bytes[..width]))
            .map_err(|_| JvmError::Unreadable("a table entry"))?;
        Ok(u64::from_le_bytes(bytes))
    }

    /// The string `field` of `entry` points at; `None` for a null pointer.
    fn name_at(&mut self, entry: Entry, field: &str) -> Result<Option<String>, JvmError> {
        let pointer = self.word_at(entry, field, 8)?;
        if pointer == 0 {
            return Ok(None);
        }
        if let Some(name) = self.names.get(&pointer) {
            return Ok(name.clone());
        }
        let name = read_c_string(self.memory, pointer, MAX_NAME)?;
        self.names.insert(pointer, Some(name.clone()));
        Ok(Some(name))
    }
}

/// The NUL-terminated string at `address`, of at most `max` bytes; read in pieces
/// that never cross a page, so a string at the end of a mapping is read whole.
pub fn read_c_string(memory: &ProcessMemory, address: u64, max: usize) -> Result<String, JvmError> {
    const PAGE: u64 = 4096;
    let mut out = Vec::new();
    let mut at = address;
    while out.len() < max {
        let piece = ((PAGE - at % PAGE) as usize).min(max - out.len()).min(64);
        let mut bytes = vec![0u8; piece];
        (memory.read(at, &mut bytes)).map_err(|_| JvmError::Unreadable("a name"))?;
        if let Some(end) = bytes.iter().position(|&b| b == 0) {
            out.extend_from_slice(&bytes[..end]);
            return String::from_utf8(out).map_err(|_| JvmError::Forged("a name"));
        }
        out.extend_from_slice(&bytes);
        at = at.wrapping_add(piece as u64);
    }
    Err(JvmError::Forged("a name without its end"))
}
