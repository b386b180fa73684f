//! JavaScript frames named from the V8 heap: a function's name and its script's name
//! come from its `SharedFunctionInfo`; the line is the statement the frame is at when
//! its code has a source position table (an interpreted frame's bytecode offset, an
//! optimized frame's return address), else the line the function starts on. V8 builds
//! bytecode position tables lazily (when a stack trace first needs them), so a frame
//! often gets its function's first line.
//!
//! What is read is cached by address (instance types, shared infos, scripts, tables),
//! bounded in bytes (the least recently used go first), and forgotten now and then by
//! the caller: the collector moves objects.

use std::{mem::size_of, sync::Arc};

use allocbpf_runtime::toolkit::{cache::ENTRY_OVERHEAD, ByteCache, RemoteMemory};

use crate::{
    code::CodeFinder,
    heap::{is_object, smi, Heap, MAX_ARRAY_ELEMENTS, MAX_SOURCE_CHARS},
    positions::{self, Position},
};

/// The objects each cache was sized for when it counted entries: the caches are
/// bounded in bytes from it.
const MAX_CACHED: usize = 1 << 16;

/// Bytes the instance types read hold: every entry is the same size (an object's
/// address and its type, if read), so this keeps [`MAX_CACHED`] of them, as when
/// entries were counted.
const MAX_TYPE_BYTES: usize = MAX_CACHED * (ENTRY_OVERHEAD + size_of::<Option<u16>>());

/// Bytes the shared infos read hold: a shared info is its function's name (some tens
/// of bytes) and its fields, about 128 bytes with its entry, so this keeps about
/// [`MAX_CACHED`] of them. It is also under what the entry count allowed at worst
/// ([`MAX_CACHED`] names of [`MAX_NAME_CHARS`](crate::heap::MAX_NAME_CHARS)
/// characters).
const MAX_SHARED_BYTES: usize = MAX_CACHED * 128;

/// Line ends all cached scripts kept at most together when entries were counted.
const MAX_CACHED_LINE_ENDS: usize = 4 << 20;

/// Bytes the scripts read hold, mostly their line ends (4 bytes each): as many line
/// ends as [`MAX_CACHED_LINE_ENDS`] allowed, and 4 MiB besides for the scripts' names
/// and fields. A script's name is a path of about a hundred bytes, about 256 bytes
/// with its fields and entry, so that share holds some sixteen thousand scripts, more
/// than a process loads; the entry count it replaces ([`MAX_CACHED`] scripts) bounded
/// nothing a process reaches.
const MAX_SCRIPT_BYTES: usize = MAX_CACHED_LINE_ENDS * size_of::<u32>() + (4 << 20);

/// Line ends one script keeps at most: a longer script's frames get no line (its line
/// ends would be read again and again).
const MAX_SCRIPT_LINE_ENDS: usize = 1 << 20;

/// Largest source position table read.
const MAX_TABLE_BYTES: usize = 256 << 10;

/// Decoded positions all cached tables kept at most together when entries were
/// counted.
const MAX_CACHED_POSITIONS: usize = 1 << 20;

/// Bytes the tables read hold, mostly their decoded positions: as many positions as
/// [`MAX_CACHED_POSITIONS`] allowed. A function's table has some tens of positions,
/// so its fields and entry are a small share of it, and the entry count the positions'
/// bound replaced ([`MAX_CACHED`] tables, some tens of positions each) allowed more
/// than the positions' bound did.
const MAX_CACHED_TABLE_BYTES: usize = MAX_CACHED_POSITIONS * size_of::<Position>();

/// What an `Arc` holds besides its value: its strong and weak counts.
const ARC_COUNTS: usize = 2 * size_of::<usize>();

/// Functions inlined into one another followed at most at one position.
const MAX_INLINED: usize = 64;

/// `ScopeInfo` words read after its map when looking for the function's name and
/// positions.
const SCOPE_WORDS: usize = 16;

/// How a function without a name reads.
pub const ANONYMOUS: &str = "(anonymous)";

/// How a frame whose function could not be read reads.
pub const UNREADABLE: &str = "[JavaScript frame unreadable]";

/// What is known of one `SharedFunctionInfo`.
#[derive(Clone, Debug)]
struct Shared {
    name: String,
    /// Its `Script` (tagged), 0 when it has none.
    script: u64,
    /// Where it starts in its script's source, if known.
    start: Option<u32>,
}

/// What is known of one `Script`.
#[derive(Clone, Debug)]
struct Script {
    name: String,
    line_ends: Option<Arc<Vec<u32>>>,
}

/// A JavaScript frame as read: function, file and line (0 when unknown).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Named {
    /// The function.
    pub function: String,
    /// Its script's name (a path or URL), empty when unknown.
    pub file: String,
    /// The line, 0 when unknown.
    pub line: u32,
}

/// Where a frame is in its function's code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CodeOffset {
    /// An interpreted frame: its `BytecodeArray` (tagged) and the offset in it.
    Bytecode {
        /// The array.
        array: u64,
        /// The offset of the current bytecode.
        offset: i64,
    },
    /// A compiled frame: its return address.
    Machine(u64),
}

/// The names read from one process, by address.
pub struct Names {
    /// Instance types read, by object.
    types: ByteCache<u64, Option<u16>>,
    /// Code found by return address.
    code: CodeFinder,
    /// What each `SharedFunctionInfo` says (nothing, for one unreadable).
    shared: ByteCache<u64, Option<Shared>>,
    /// What each `Script` says.
    scripts: ByteCache<u64, Script>,
    /// Decoded source position tables, by their owner (nothing, for none readable).
    tables: ByteCache<u64, Option<Arc<Vec<Position>>>>,
}

impl Default for Names {
    fn default() -> Self {
        Self {
            types: ByteCache::new(MAX_TYPE_BYTES),
            code: CodeFinder::default(),
            shared: ByteCache::new(MAX_SHARED_BYTES),
            scripts: ByteCache::new(MAX_SCRIPT_BYTES),
            tables: ByteCache::new(MAX_CACHED_TABLE_BYTES),
        }
    }
}

impl Names {
    /// Forgets everything read (the collector may have moved it).
    pub fn clear(&mut self) {
        self.types.clear();
        self.code.clear();
        self.shared.clear();
        self.scripts.clear();
        self.tables.clear();
    }

    /// The instance type of the object `word` points to (cached).
    pub fn instance_type<M: RemoteMemory + ?Sized>(
        &mut self,
        heap: &Heap<'_, M>,
        word: u64,
    ) -> Option<u16> {
        if let Some(known) = self.types.get(&word) {
            return *known;
        }
        let read = heap.instance_type(word);
        self.types.insert(word, read, size_of::<Option<u16>>());
        read
    }

    /// Names the frame of `function` (a tagged `JSFunction`) at `at`: the functions
    /// optimized code inlined at that point first (innermost first), then `function`.
    pub fn frames<M: RemoteMemory + ?Sized>(
        &mut self,
        heap: &Heap<'_, M>,
        function: u64,
        at: CodeOffset,
    ) -> Vec<Named> {
        let fields = &heap.layout.fields;
        let Some(sfi) = heap
            .field(function, fields.function_shared)
            .and_then(|sfi| heap.typed(sfi, heap.layout.types.shared_function_info))
        else {
            return vec![unreadable()];
        };
        match at {
            CodeOffset::Bytecode { array, offset } => {
                let types = &heap.layout.types;
                let position = self
                    .table(heap, array, fields.bytecode_positions, types.bytecode_array)
                    .and_then(|table| positions::at(&table, offset));
                vec![self.named(heap, sfi, position.and_then(|p| p.script_offset))]
            }
            CodeOffset::Machine(pc) => match self.optimized_position(heap, function, pc) {
                Some((code, position)) => self.inlined(heap, code, sfi, position),
                None => vec![self.named(heap, sfi, None)],
            },
        }
    }

    /// The frames of `position` in optimized `code` whose function is `outer`: each
    /// inlined function at its position, then its caller at the position of the call,
    /// out to `outer`.
    fn inlined<M: RemoteMemory + ?Sized>(
        &mut self,
        heap: &Heap<'_, M>,
        code: u64,
        outer: u64,
        mut position: Position,
    ) -> Vec<Named> {
        let fields = &heap.layout.fields;
        let deoptimization = heap
            .field(code, fields.code_deoptimization)
            .filter(|&data| {
                let types = &heap.layout.types;
                let kind = heap.instance_type(data);
                kind == Some(types.fixed_array) || kind == Some(types.protected_fixed_array)
            });
        let element = |data: u64, index: u32| heap.field(data, fields.array_data + 8 * index);
        let mut frames = Vec::new();
        for _ in 0..MAX_INLINED {
            let Some(index) = position.inlining_id.checked_sub(1) else {
                break;
            };
            let inlining = deoptimization.and_then(|data| {
                let positions = element(data, fields.deoptimization_inlining)?;
                let bytes = heap.byte_array(positions, MAX_TABLE_BYTES)?;
                let entry = bytes.get(16 * index as usize..16 * index as usize + 12)?;
                let caller = u64::from_le_bytes(entry[..8].try_into().ok()?);
                let function = u32::from_le_bytes(entry[8..12].try_into().ok()?);
                let literals = element(data, fields.deoptimization_literals)?;
                let literals = heap.typed(literals, heap.layout.types.weak_fixed_array)?;
                let length = heap.array_length(literals, MAX_ARRAY_ELEMENTS)?;
                if function as usize >= length {
                    return None;
                }
                // A weak reference has its second bit set as well as the tag.
                let sfi = element(literals, function)? & !2;
                let sfi = heap.typed(sfi, heap.layout.types.shared_function_info)?;
                Some((sfi, caller))
            });
            let Some((sfi, caller)) = inlining else {
                // The inlined function cannot be told: the outer one, at its start.
                position.script_offset = None;
                break;
            };
            frames.push(self.named(heap, sfi, position.script_offset));
            position = Position::from_raw(position.code_offset, caller);
        }
        let offset = (position.inlining_id == 0)
            .then_some(position.script_offset)
            .flatten();
        frames.push(self.named(heap, outer, offset));
        frames
    }

    /// The frame of the function `sfi` describes at `script_offset` (its first line
    /// when `None`).
    fn named<M: RemoteMemory + ?Sized>(
        &mut self,
        heap: &Heap<'_, M>,
        sfi: u64,
        script_offset: Option<u32>,
    ) -> Named {
        let Some(info) = self.shared(heap, sfi) else {
            return unreadable();
        };
        let script = match info.script {
            0 => None,
            script => Some(self.script(heap, script)),
        };
        let (file, line_ends) = match script {
            Some(script) => (script.name, script.line_ends),
            None => (String::new(), None),
        };
        let line = match (script_offset.or(info.start), line_ends) {
            (Some(offset), Some(ends)) => positions::line_of(&ends, offset),
            _ => 0,
        };
        Named {
            function: info.name,
            file,
            line,
        }
    }

    /// The optimized code that return address `pc` is in (`function`'s own code, or
    /// code found by the address) and the position there, if that code is optimized
    /// (Maglev's or Turbofan's: a baseline code's table maps to bytecodes, not to the
    /// source) and has a table.
    fn optimized_position<M: RemoteMemory + ?Sized>(
        &mut self,
        heap: &Heap<'_, M>,
        function: u64,
        pc: u64,
    ) -> Option<(u64, Position)> {
        let fields = &heap.layout.fields;
        let hint = heap.field(function, fields.function_code);
        let range = self.code.code_at(heap, pc, hint);

        let range = range?;
        if !(fields.code_kind_baseline + 1..=fields.code_kind_baseline + 2).contains(&range.kind) {
            return None;
        }
        let table = self.table(
            heap,
            range.code,
            fields.code_positions,
            heap.layout.types.code,
        );

        let table = table?;
        // A return address is after its call: the call is one byte earlier.
        let offset = (pc - range.start) as i64 - 1;
        Some((range.code, positions::at(&table, offset)?))
    }

    /// The decoded source position table at field `field` of `owner` (of type
    /// `owner_type`).
    fn table<M: RemoteMemory + ?Sized>(
        &mut self,
        heap: &Heap<'_, M>,
        owner: u64,
        field: u32,
        owner_type: u16,
    ) -> Option<Arc<Vec<Position>>> {
        if let Some(known) = self.tables.get(&owner) {
            return known.clone();
        }
        let read = heap
            .typed(owner, owner_type)
            .and_then(|_| heap.field(owner, field))
            .and_then(|table| heap.byte_array(table, MAX_TABLE_BYTES))
            .filter(|bytes| !bytes.is_empty())
            .map(|bytes| Arc::new(positions::decode(&bytes)));
        let bytes = size_of::<Option<Arc<Vec<Position>>>>()
            + read.as_ref().map_or(0, |table| {
                ARC_COUNTS + size_of::<Vec<Position>>() + table.len() * size_of::<Position>()
            });
        self.tables.insert(owner, read.clone(), bytes);
        read
    }

    /// What `sfi` says of its function.
    fn shared<M: RemoteMemory + ?Sized>(&mut self, heap: &Heap<'_, M>, sfi: u64) -> Option<Shared> {
        if let Some(known) = self.shared.get(&sfi) {
            return known.clone();
        }
        let read = read_shared(heap, sfi);
        let bytes = size_of::<Option<Shared>>() + read.as_ref().map_or(0, |s| s.name.len());
        self.shared.insert(sfi, read.clone(), bytes);
        read
    }

    /// What `script` says of itself (a script unreadable has no name and no lines).
    fn script<M: RemoteMemory + ?Sized>(&mut self, heap: &Heap<'_, M>, script: u64) -> Script {
        if let Some(known) = self.scripts.get(&script) {
            return known.clone();
        }
        let fields = &heap.layout.fields;
        let name = (heap.field(script, fields.script_name))
            .and_then(|name| heap.name(name))
            .unwrap_or_default();
        let line_ends = heap
            .field(script, fields.script_line_ends)
            .and_then(|ends| heap.smi_array(ends, MAX_ARRAY_ELEMENTS))
            .map(|ends| {
                ends.into_iter()
                    .map(|end| end.clamp(0, u32::MAX as i64) as u32)
                    .collect()
            })
            .or_else(|| {
                let source = heap.field(script, fields.script_source)?;
                let units = heap.string_units(source, MAX_SOURCE_CHARS)?;
                Some(positions::line_ends(&units))
            })
            .filter(|ends: &Vec<u32>| ends.len() <= MAX_SCRIPT_LINE_ENDS)
            .map(Arc::new);
        let script_info = Script { name, line_ends };
        self.scripts
            .insert(script, script_info.clone(), script_info.bytes());
        script_info
    }
}

impl Script {
    /// What it holds: its fields, its name and its line ends (in their `Arc`).
    fn bytes(&self) -> usize {
        size_of::<Script>()
            + self.name.len()
            + (self.line_ends.as_ref()).map_or(0, |ends| {
                ARC_COUNTS + size_of::<Vec<u32>>() + ends.len() * size_of::<u32>()
            })
    }
}

/// How an unreadable frame reads.
fn unreadable() -> Named {
    Named {
        function: UNREADABLE.to_string(),
        file: String::new(),
        line: 0,
    }
}

/// Reads a shared function info: its name (a string, or in its scope info), its
/// script and where it starts.
fn read_shared<M: RemoteMemory + ?Sized>(heap: &Heap<'_, M>, sfi: u64) -> Option<Shared> {
    let layout = heap.layout;
    let name_or_scope = heap.field(sfi, layout.fields.shared_name)?;
    let (name, start) = match heap.instance_type(name_or_scope) {
        Some(t) if t < layout.types.first_nonstring => (heap.name(name_or_scope), None),
        Some(t) if t == layout.types.scope_info => scope_name(heap, name_or_scope),
        _ => (None, None),
    };
    let name = name
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| ANONYMOUS.to_string());
    let script = heap
        .field(sfi, layout.fields.shared_script)
        .and_then(|script| heap.typed(script, layout.types.script))
        .unwrap_or(0);
    Some(Shared {
        name,
        script,
        start,
    })
}

/// A scope info's function name and start position. Its layout varies with its flags
/// and is not published: after the context locals' names and infos, the first string
/// is taken as the function's name, and the first two Smis after it that make a
/// rising pair as its start and end positions.
fn scope_name<M: RemoteMemory + ?Sized>(
    heap: &Heap<'_, M>,
    scope: u64,
) -> (Option<String>, Option<u32>) {
    let mut words = [0u64; SCOPE_WORDS];
    let base = scope
        .wrapping_sub(1)
        .wrapping_add(heap.layout.fields.map as u64 + 8);
    for (i, word) in words.iter_mut().enumerate() {
        match heap.word(base + 8 * i as u64) {
            Some(value) => *word = value,
            None => return (None, None),
        }
    }
    let locals = words
        .get(heap.layout.fields.scope_context_locals as usize)
        .and_then(|&w| smi(w))
        .filter(|&n| (0..SCOPE_WORDS as i64).contains(&n))
        .unwrap_or(SCOPE_WORDS as i64) as usize;
    let first = heap.layout.fields.scope_first_vars as usize + 2 * locals;
    let mut name = None;
    let mut previous: Option<i64> = None;
    for &word in words.iter().skip(first) {
        if name.is_none() && is_object(word) {
            name = heap.name(word);
        }
        let current = smi(word);
        if let (Some(start), Some(end)) = (previous, current) {
            if 0 <= start && start < end {
                return (name, u32::try_from(start).ok());
            }
        }
        previous = current;
    }
    (name, None)
}

#[cfg(test)]
mod tests;
