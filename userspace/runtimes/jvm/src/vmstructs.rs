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

use allocbpf_runtime::toolkit::RemoteMemory;

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
        memory: &dyn RemoteMemory,
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
    memory: &'a dyn RemoteMemory,
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
pub fn read_c_string(
    memory: &dyn RemoteMemory,
    address: u64,
    max: usize,
) -> Result<String, JvmError> {
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

#[cfg(test)]
mod tests {
    use allocbpf_runtime::toolkit::FakeMemory;

    use super::*;

    /// Where the forged `gHotSpotVM*` globals, tables and names are.
    const GLOBALS: u64 = 0x1000;
    const STRUCTS: u64 = 0x2000;
    const TYPES: u64 = 0x3000;
    const INTS: u64 = 0x4000;
    const NAMES: u64 = 0x5000;

    /// The globals' values, in [`SYMBOLS`]' order: each table's address, stride and
    /// field offsets.
    const VALUES: [u64; 15] = [
        STRUCTS, 48, 0, 8, 16, 24, 32, TYPES, 16, 0, 8, INTS, 16, 0, 8,
    ];

    /// The names, NUL-terminated, in a page of their own; each one's address.
    fn names(memory: &mut FakeMemory, names: &[&str]) -> Vec<u64> {
        let mut page = Vec::new();
        let mut at = Vec::new();
        for name in names {
            at.push(NAMES + page.len() as u64);
            page.extend_from_slice(name.as_bytes());
            page.push(0);
        }
        page.resize(4096, 0);
        memory.map(NAMES, page);
        at
    }

    /// Forged tables: `Klass::_name` at 16, static `CodeCache::_heaps` at `0xabc0`, a
    /// field of a type not asked for, `sizeof(Klass)` 200 and one constant, 4.
    fn forged_tables() -> (FakeMemory, TableSymbols) {
        let mut memory = FakeMemory::new();
        let symbols = TableSymbols {
            addresses: (SYMBOLS.iter().enumerate())
                .map(|(index, &name)| (name, GLOBALS + index as u64 * 8))
                .collect(),
        };
        memory.map(
            GLOBALS,
            VALUES
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>(),
        );
        let constant = "ConstMethod::_has_linenumber_table";
        let at = names(
            &mut memory,
            &[
                "Klass",
                "_name",
                "CodeCache",
                "_heaps",
                "Other",
                "_x",
                constant,
            ],
        );
        memory.map(STRUCTS, vec![0u8; 48 * 4]);
        for (index, (type_name, field, is_static, value)) in [
            (at[0], at[1], 0, 16),
            (at[2], at[3], 1, 0xabc0),
            (at[4], at[5], 0, 8),
        ]
        .into_iter()
        .enumerate()
        {
            let entry = STRUCTS + index as u64 * 48;
            memory
                .write_u64(entry, type_name)
                .write_u64(entry + 8, field)
                .write_u32(entry + 16, is_static);
            memory.write_u64(entry + if is_static == 1 { 32 } else { 24 }, value);
        }
        memory
            .map(TYPES, vec![0u8; 32])
            .write_u64(TYPES, at[0])
            .write_u64(TYPES + 8, 200);
        memory
            .map(INTS, vec![0u8; 32])
            .write_u64(INTS, at[6])
            .write_u32(INTS + 8, 4);
        (memory, symbols)
    }

    /// What [`VmStructs::read`] makes of `memory`'s tables, asked for `Klass`,
    /// `CodeCache` and the line-number constant.
    fn read(memory: &FakeMemory, symbols: &TableSymbols) -> Result<VmStructs, JvmError> {
        let constants = ["ConstMethod::_has_linenumber_table"];
        VmStructs::read(memory, symbols, &["Klass", "CodeCache"], &constants)
    }

    #[test]
    fn forged_tables_give_the_fields_sizes_and_constants_asked_for() {
        let (memory, symbols) = forged_tables();
        let vm = read(&memory, &symbols).expect("forged tables read");
        assert_eq!(vm.offset("Klass", "_name").ok(), Some(16));
        assert_eq!(vm.address("CodeCache", "_heaps").ok(), Some(0xabc0));
        assert_eq!(vm.field("Other", "_x"), None, "a type not asked for");
        assert_eq!(vm.size("Klass").ok(), Some(200));
        assert_eq!(vm.int("ConstMethod::_has_linenumber_table"), Some(4));
    }

    #[test]
    fn a_forged_stride_an_endless_table_or_an_endless_name_is_refused() {
        let (mut memory, symbols) = forged_tables();
        let stride = symbols.addresses["gHotSpotVMTypeEntryArrayStride"];
        for forged in [0, MAX_STRIDE + 1] {
            memory.write_u64(stride, forged);
            let error = read(&memory, &symbols).err();
            assert!(
                matches!(error, Some(JvmError::Forged("a table's stride"))),
                "{error:?}"
            );
        }
        // Every entry names a type: no terminator within MAX_ENTRIES.
        memory.write_u64(stride, 16);
        let endless = 0x10_0000;
        let entries = (0..MAX_ENTRIES).flat_map(|_| [NAMES.to_le_bytes(), 8u64.to_le_bytes()]);
        memory.map(endless, entries.flatten().collect::<Vec<u8>>());
        memory.write_u64(symbols.addresses["gHotSpotVMTypes"], endless);
        let error = read(&memory, &symbols).err();
        assert!(
            matches!(
                error,
                Some(JvmError::Forged("a table without its terminator"))
            ),
            "{error:?}"
        );
        let (mut memory, symbols) = forged_tables();
        memory.write(NAMES, &[b'K'; MAX_NAME + 1]);
        let error = read(&memory, &symbols).err();
        assert!(
            matches!(error, Some(JvmError::Forged("a name without its end"))),
            "{error:?}"
        );
    }
}
