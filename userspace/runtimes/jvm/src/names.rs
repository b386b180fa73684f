//! Names from a JVM's metadata: a class's name (`Klass::_name`), a method's class,
//! name and source file (through its constant pool) and the line of a bytecode index
//! (its compressed line number table), read from the target's memory as hostile input:
//! symbols of at most [`MAX_SYMBOL`] bytes, tables of at most [`MAX_LINE_ENTRIES`]
//! entries, every index checked against what it indexes. What is read is remembered in
//! caches bounded in bytes, which evict the names used least recently when full.

use std::mem::size_of;

use allocbpf_runtime::toolkit::{ByteCache, RemoteMemory};

use crate::{layout::Layout, stream::CompressedReader};

/// Longest symbol read; longer names are cut.
pub const MAX_SYMBOL: usize = 512;

/// Most line number entries read from one method.
const MAX_LINE_ENTRIES: usize = 8192;

/// Bytes of line number table read at most.
const MAX_LINE_TABLE_BYTES: usize = 32 << 10;

/// The methods or classes a process's cache was sized for when it counted entries:
/// the caches below are bounded in bytes from it.
const MAX_NAMES: usize = 65_536;

/// Bytes the methods named hold: a method is its qualified name (around a hundred
/// bytes), its file's name, some dozen line entries (8 bytes each) and its fields,
/// about 256 bytes with its entry, so this keeps about [`MAX_NAMES`] methods. It is
/// also under what the entry counts allowed at worst ([`MAX_NAMES`] methods of names
/// up to [`MAX_SYMBOL`] bytes, and 1 Mi line entries besides).
const MAX_METHOD_BYTES: usize = MAX_NAMES * 256;

/// Bytes the classes named hold: a class is its qualified name (some tens of bytes)
/// and a string's fields, about 128 bytes with its entry, so this keeps about
/// [`MAX_NAMES`] classes.
const MAX_CLASS_BYTES: usize = MAX_NAMES * 128;

/// A method, named.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MethodName {
    /// `package.Class.method`.
    pub function: String,
    /// `File.java`, or empty.
    pub file: String,
    /// Where its bytecodes start (right after its `ConstMethod`).
    code_base: u64,
    /// How many bytes of bytecodes it has.
    code_size: u64,
    /// `(bci, line)` pairs of its line number table, in table order.
    lines: Vec<(u32, u32)>,
}

impl MethodName {
    /// The bytecode index an interpreted frame's bytecode pointer `bcp` stands for; -1
    /// when it is not in this method's bytecodes.
    pub fn bci_of(&self, bcp: u64) -> i32 {
        (bcp.checked_sub(self.code_base))
            .filter(|&bci| bci < self.code_size)
            .and_then(|bci| i32::try_from(bci).ok())
            .unwrap_or(-1)
    }

    /// The line of bytecode index `bci` (0 when not known): the entry with the largest
    /// bytecode index not above it, as `Method::line_number_from_bci` picks.
    pub fn line(&self, bci: i32) -> u32 {
        let Ok(bci) = u32::try_from(bci) else {
            return self.lines.first().map_or(0, |&(_, line)| line);
        };
        let mut best: Option<(u32, u32)> = None;
        for &(at, line) in &self.lines {
            if at == bci {
                return line;
            }
            if at < bci && best.is_none_or(|(best_at, _)| at >= best_at) {
                best = Some((at, line));
            }
        }
        best.map_or(0, |(_, line)| line)
    }
}

/// Names read from one process, remembered by address.
pub struct Names {
    methods: ByteCache<u64, Option<MethodName>>,
    classes: ByteCache<u64, Option<String>>,
}

impl Default for Names {
    fn default() -> Self {
        Self {
            methods: ByteCache::new(MAX_METHOD_BYTES),
            classes: ByteCache::new(MAX_CLASS_BYTES),
        }
    }
}

impl Names {
    /// The method at `method`, or `None` when it does not read back as one.
    pub fn method(
        &mut self,
        memory: &dyn RemoteMemory,
        layout: &Layout,
        method: u64,
    ) -> Option<&MethodName> {
        if !self.methods.contains_key(&method) {
            let name = read_method(memory, layout, method);
            let bytes = size_of::<Option<MethodName>>()
                + name.as_ref().map_or(0, |name| {
                    name.function.len()
                        + name.file.len()
                        + name.lines.len() * size_of::<(u32, u32)>()
                });
            self.methods.insert(method, name, bytes);
        }
        self.methods.get(&method)?.as_ref()
    }

    /// The Java name of the class at `klass` (`byte[]`, `java.lang.String`).
    pub fn class(
        &mut self,
        memory: &dyn RemoteMemory,
        layout: &Layout,
        klass: u64,
    ) -> Option<&str> {
        if !self.classes.contains_key(&klass) {
            let name = (memory.u64(klass.wrapping_add(layout.klass_name)).ok())
                .and_then(|symbol| read_symbol(memory, layout, symbol))
                .map(|internal| java_class_name(&internal));
            let bytes = size_of::<Option<String>>() + name.as_ref().map_or(0, String::len);
            self.classes.insert(klass, name, bytes);
        }
        self.classes.get(&klass)?.as_deref()
    }

    /// Forgets every name (metadata may have been unloaded and its space reused).
    pub fn clear(&mut self) {
        self.methods.clear();
        self.classes.clear();
    }
}

/// Reads the symbol (`Symbol*`) at `symbol`.
fn read_symbol(memory: &dyn RemoteMemory, layout: &Layout, symbol: u64) -> Option<String> {
    if symbol == 0 {
        return None;
    }
    let mut length = [0u8; 2];
    memory
        .read(symbol.wrapping_add(layout.symbol_length), &mut length)
        .ok()?;
    let length = usize::from(u16::from_le_bytes(length)).min(MAX_SYMBOL);
    let mut body = vec![0u8; length];
    memory
        .read(symbol.wrapping_add(layout.symbol_body), &mut body)
        .ok()?;
    // Java's modified UTF-8: what is not plain UTF-8 is shown replaced.
    let text = String::from_utf8_lossy(&body).into_owned();
    (!text.is_empty() && !text.contains(|c: char| c.is_control())).then_some(text)
}

/// The `u16` at `address`.
fn read_u16(memory: &dyn RemoteMemory, address: u64) -> Option<u16> {
    let mut bytes = [0u8; 2];
    memory.read(address, &mut bytes).ok()?;
    Some(u16::from_le_bytes(bytes))
}

/// The symbol in slot `index` of the constant pool at `pool`.
fn pool_symbol(
    memory: &dyn RemoteMemory,
    layout: &Layout,
    pool: u64,
    index: u16,
) -> Option<String> {
    if index == 0 {
        return None;
    }
    let mut length = [0u8; 4];
    memory
        .read(pool.wrapping_add(layout.pool_length), &mut length)
        .ok()?;
    if i32::from(index) >= i32::from_le_bytes(length) {
        return None;
    }
    let slot = (pool.wrapping_add(layout.pool_size)).wrapping_add(u64::from(index) * 8);
    read_symbol(memory, layout, memory.u64(slot).ok()?)
}

/// Reads a method's names and line table.
fn read_method(memory: &dyn RemoteMemory, layout: &Layout, method: u64) -> Option<MethodName> {
    let constant = memory.u64(method.wrapping_add(layout.method_const)).ok()?;
    let pool = memory
        .u64(constant.wrapping_add(layout.const_constants))
        .ok()?;
    let name = pool_symbol(
        memory,
        layout,
        pool,
        read_u16(memory, constant.wrapping_add(layout.const_name_index))?,
    )?;
    let holder = memory.u64(pool.wrapping_add(layout.pool_holder)).ok()?;
    let class = read_symbol(
        memory,
        layout,
        memory.u64(holder.wrapping_add(layout.klass_name)).ok()?,
    )?;
    let source = read_u16(memory, pool.wrapping_add(layout.pool_source_file))
        .and_then(|index| pool_symbol(memory, layout, pool, index))
        .unwrap_or_default();
    let code_size = read_u16(memory, constant.wrapping_add(layout.const_code_size))?;
    Some(MethodName {
        function: format!("{}.{name}", java_class_name(&class)),
        file: source,
        code_base: constant.wrapping_add(layout.const_method_size),
        code_size: u64::from(code_size),
        lines: read_lines(memory, layout, constant, code_size).unwrap_or_default(),
    })
}

/// A method's compressed line number table (its bytecodes are `code_size` bytes): it
/// follows the bytecodes, which follow
/// the `ConstMethod`. Each entry is a byte with 5 bits of bytecode-index delta and 3
/// of line delta, or `0xff` then both deltas as signed compressed integers; 0 ends it.
fn read_lines(
    memory: &dyn RemoteMemory,
    layout: &Layout,
    constant: u64,
    code_size: u16,
) -> Option<Vec<(u32, u32)>> {
    let (flags_at, width) = layout.const_flags;
    let mut flags = [0u8; 4];
    memory
        .read(constant.wrapping_add(flags_at), &mut flags[..width])
        .ok()?;
    if u32::from_le_bytes(flags) & layout.has_line_numbers == 0 {
        return Some(Vec::new());
    }
    let table =
        (constant.wrapping_add(layout.const_method_size)).wrapping_add(u64::from(code_size));
    let mut bytes = vec![0u8; MAX_LINE_TABLE_BYTES];
    let readable = read_prefix(memory, table, &mut bytes);
    let mut reader = CompressedReader::new(&bytes[..readable], 0, layout.unsigned5_excludes_zero);
    let (mut bci, mut line) = (0i64, 0i64);
    let mut out = Vec::new();
    while out.len() < MAX_LINE_ENTRIES {
        match reader.byte()? {
            0 => return Some(out),
            0xff => {
                bci += i64::from(reader.int()?);
                line += i64::from(reader.int()?);
            }
            next => {
                bci += i64::from(next >> 3);
                line += i64::from(next & 7);
            }
        }
        out.push((u32::try_from(bci).ok()?, u32::try_from(line).ok()?));
    }
    Some(out)
}

/// Reads as much of `buffer` from `address` as is mapped, page by page; the bytes read.
fn read_prefix(memory: &dyn RemoteMemory, address: u64, buffer: &mut [u8]) -> usize {
    const PAGE: u64 = 4096;
    let mut done = 0;
    while done < buffer.len() {
        let at = address.wrapping_add(done as u64);
        let piece = ((PAGE - at % PAGE) as usize).min(buffer.len() - done);
        if memory.read(at, &mut buffer[done..done + piece]).is_err() {
            break;
        }
        done += piece;
    }
    done
}

/// A class's internal name as Java writes it: `java/lang/String` is
/// `java.lang.String`, `[B` is `byte[]`, `[[Ljava/lang/Object;` is
/// `java.lang.Object[][]`.
pub fn java_class_name(internal: &str) -> String {
    let dimensions = internal.bytes().take_while(|&b| b == b'[').count();
    let element = &internal[dimensions..];
    let base = if dimensions == 0 {
        element.replace('/', ".")
    } else {
        match element {
            "B" => "byte".to_string(),
            "C" => "char".to_string(),
            "D" => "double".to_string(),
            "F" => "float".to_string(),
            "I" => "int".to_string(),
            "J" => "long".to_string(),
            "S" => "short".to_string(),
            "Z" => "boolean".to_string(),
            other => (other.strip_prefix('L'))
                .and_then(|name| name.strip_suffix(';'))
                .unwrap_or(other)
                .replace('/', "."),
        }
    };
    format!("{base}{}", "[]".repeat(dimensions))
}

#[cfg(test)]
mod tests;
