//! From the eBPF program's frame records to Python locations: each record's code
//! object is read from the target's memory, checked (its type must be `PyCode_Type`,
//! its names `str` of bounded length, its line table bounded), cached by address, and
//! its instruction turned into a line with the version's line table.

use allocbpf_common::python::PythonFrameRecord;
use allocbpf_runtime::toolkit::{cache::ENTRY_OVERHEAD, ByteCache, CacheFigures, RemoteMemory};

use crate::{
    discover::PythonProcess,
    layout::Layout,
    linetable::{line_of, LineTableFormat},
    memory::ProcessMemory,
};

/// Longest name or file name read, in characters; longer ones are cut.
const MAX_NAME_CHARS: u64 = 1024;

/// Largest line table read, in bytes; a code object with a larger one gets no lines.
const MAX_LINE_TABLE_BYTES: u64 = 256 * 1024;

/// What a realistic code object costs in the cache: what is kept of it, a qualified
/// name of a few dozen characters, a file path of about a hundred, a line table of a
/// few hundred bytes (3.11's location table takes a byte or two per instruction of a
/// function of ordinary length), and the cache's own bookkeeping.
const TYPICAL_CODE_BYTES: usize = size_of::<Option<Code>>() + 32 + 96 + 320 + ENTRY_OVERHEAD;

/// Bytes of code objects cached per process: as many realistic ones as the 16,384 code
/// objects the cache was bounded by when it counted entries (more functions than most
/// programs run). Counted in bytes, a process that keeps creating code, or forges
/// addresses, long names or large line tables, gets fewer entries and costs reads,
/// never more memory: bounded by entries, 16,384 forged ones of the largest names and
/// tables read would have held gigabytes.
const MAX_CACHED_CODE_BYTES: usize = 16_384 * TYPICAL_CODE_BYTES;

/// Bytes of a code object's fixed part read at once (every field used lies in it).
const CODE_HEADER_BYTES: usize = 256;

/// Bytes of a `str` object's header read at once (every field used lies in it, in
/// every version).
const STR_HEADER_BYTES: usize = 48;

/// One Python frame, resolved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedFrame {
    /// `co_qualname` (3.11+) or `co_name`.
    pub function: String,
    /// `co_filename`.
    pub file: String,
    /// The line being run; 0 when unknown.
    pub line: u32,
}

/// What is kept of one code object.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Code {
    function: String,
    file: String,
    first_line: i32,
    line_table: Vec<u8>,
    /// Where the bytecode starts in the process (3.11+), for instruction pointers.
    bytecode: u64,
}

/// The bytes a cache entry holds: the entry itself and what its strings and table
/// hold (a code object that did not check is the entry alone).
fn cached_bytes(code: &Option<Code>) -> usize {
    size_of::<Option<Code>>()
        + code.as_ref().map_or(0, |code| {
            code.function.len() + code.file.len() + code.line_table.len()
        })
}

/// Resolves one process's frame records, caching its code objects; `M`: how that
/// process's memory is read (its own, or forged in tests).
pub struct CodeResolver<M: RemoteMemory = ProcessMemory> {
    process: PythonProcess,
    memory: M,
    format: Option<LineTableFormat>,
    /// Code objects by address: `None` for an address whose object did not check.
    cache: ByteCache<u64, Option<Code>>,
}

impl CodeResolver {
    /// A resolver for `process`, reading its memory.
    pub fn new(process: PythonProcess) -> Self {
        CodeResolver::with_memory(ProcessMemory::new(process.pid), process)
    }
}

impl<M: RemoteMemory> CodeResolver<M> {
    /// A resolver for `process` whose memory `memory` reads.
    pub fn with_memory(memory: M, process: PythonProcess) -> Self {
        Self {
            memory,
            format: LineTableFormat::for_minor(process.minor),
            process,
            cache: ByteCache::new(MAX_CACHED_CODE_BYTES),
        }
    }

    /// The process resolved.
    pub fn process(&self) -> &PythonProcess {
        &self.process
    }

    /// What the cache of code objects holds and has evicted.
    pub fn cache_figures(&self) -> CacheFigures {
        self.cache.figures()
    }

    /// The records' frames in segments, innermost first: each segment is what one
    /// native call of the eval loop runs (3.11+ runs several Python calls in one),
    /// innermost frame first. Records that are not Python code (3.12+'s C-stack shims)
    /// end a segment and are dropped; so is a record whose code object does not check.
    pub fn segments(&mut self, records: &[PythonFrameRecord]) -> Vec<Vec<ResolvedFrame>> {
        let layout = self.process.layout;
        let mut segments = vec![Vec::new()];
        for record in records {
            let shim = layout.owner_cstack.is_some_and(|c| record.owner == c);
            if shim {
                if !segments.last().is_some_and(Vec::is_empty) {
                    segments.push(Vec::new());
                }
                continue;
            }
            if let Some(frame) = self.resolve(record) {
                segments.last_mut().expect("never empty").push(frame);
            }
            let entry = match layout.minor {
                // Each eval loop call runs one frame.
                ..=10 => true,
                // `is_entry`: the first frame its eval loop call pushed.
                11 => record.owner != 0,
                _ => false,
            };
            if entry {
                segments.push(Vec::new());
            }
        }
        segments.retain(|segment| !segment.is_empty());
        segments
    }

    /// One record's frame, if its code object checks.
    fn resolve(&mut self, record: &PythonFrameRecord) -> Option<ResolvedFrame> {
        let (minor, format) = (self.process.minor, self.format);
        let frame = |code: &Code| frame_of(code, minor, format, record.instruction);
        if let Some(known) = self.cache.get(&record.code) {
            return known.as_ref().map(frame);
        }
        let code = read_code(&self.memory, &self.process, record.code);
        let resolved = code.as_ref().map(frame);
        let bytes = cached_bytes(&code);
        // An entry larger than the whole cache is refused: it is read again next time.
        self.cache.insert(record.code, code, bytes);
        resolved
    }
}

/// The frame of `code` at `instruction` (the record's) in 3.`minor`.
fn frame_of(
    code: &Code,
    minor: u8,
    format: Option<LineTableFormat>,
    instruction: u64,
) -> ResolvedFrame {
    let line = instruction_offset(minor, code, instruction)
        .zip(format)
        .and_then(|(offset, format)| line_of(format, &code.line_table, code.first_line, offset))
        .unwrap_or(0);
    ResolvedFrame {
        function: code.function.clone(),
        file: code.file.clone(),
        line,
    }
}

/// The byte offset of the frame's instruction in its bytecode.
fn instruction_offset(minor: u8, code: &Code, instruction: u64) -> Option<u32> {
    match minor {
        // `f_lasti`, an int: bytes in 3.9, code units in 3.10.
        ..=9 => u32::try_from(instruction as u32 as i32).ok(),
        10 => u32::try_from(instruction as u32 as i32)
            .ok()?
            .checked_mul(2),
        _ => u32::try_from(instruction.checked_sub(code.bytecode)?).ok(),
    }
}

/// Reads and checks the code object at `address` of `process`, whose memory `memory`
/// reads.
fn read_code(memory: &dyn RemoteMemory, process: &PythonProcess, address: u64) -> Option<Code> {
    let layout = process.layout;
    let mut header = [0u8; CODE_HEADER_BYTES];
    memory.read(address, &mut header).ok()?;
    let word = |offset: u32| -> Option<u64> {
        let at = offset as usize;
        Some(u64::from_le_bytes(header.get(at..at + 8)?.try_into().ok()?))
    };
    if word(8)? != process.code_type {
        return None;
    }
    let first_line = word(layout.code_firstlineno)? as u32 as i32;
    let name_field = layout.code_qualname.unwrap_or(layout.code_name);
    let function = read_str(memory, process, word(name_field)?)?;
    let file = read_str(memory, process, word(layout.code_filename)?)?;
    let line_table = read_bytes(memory, layout, word(layout.code_linetable)?).unwrap_or_default();
    // The header was read whole, so its end (and the bytecode's start in it) is an
    // address: no overflow.
    let bytecode = layout
        .code_adaptive
        .map_or(0, |offset| address + offset as u64);
    Some(Code {
        function,
        file,
        first_line,
        line_table,
        bytecode,
    })
}

/// A `str` object's text (compact strings: every name and file name of a code object
/// is one), cut to [`MAX_NAME_CHARS`].
fn read_str(memory: &dyn RemoteMemory, process: &PythonProcess, address: u64) -> Option<String> {
    let layout = process.layout;
    let mut header = [0u8; STR_HEADER_BYTES];
    memory.read(address, &mut header).ok()?;
    let word = |at: usize| u64::from_le_bytes(header[at..at + 8].try_into().unwrap());
    if let Some(unicode_type) = process.unicode_type {
        if word(8) != unicode_type {
            return None;
        }
    }
    let length = word(layout.unicode_length as usize);
    let state = u32::from_le_bytes(
        header[layout.unicode_state as usize..layout.unicode_state as usize + 4]
            .try_into()
            .ok()?,
    );
    let (kind, compact, ascii) = ((state >> 2) & 7, (state >> 5) & 1, (state >> 6) & 1);
    if compact == 0 || !matches!(kind, 1 | 2 | 4) || length > isize::MAX as u64 {
        return None;
    }
    let chars = length.min(MAX_NAME_CHARS);
    let data = if ascii == 1 {
        address.checked_add(layout.unicode_ascii_size as u64)?
    } else {
        address.checked_add(layout.unicode_compact_size as u64)?
    };
    let mut bytes = vec![0u8; (chars * kind as u64) as usize];
    memory.read(data, &mut bytes).ok()?;
    let mut text: String = match kind {
        1 => bytes.iter().map(|&b| b as char).collect(),
        2 => char::decode_utf16(
            bytes
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]])),
        )
        .map(|c| c.unwrap_or(char::REPLACEMENT_CHARACTER))
        .collect(),
        _ => bytes
            .chunks_exact(4)
            .map(|c| {
                char::from_u32(u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .unwrap_or(char::REPLACEMENT_CHARACTER)
            })
            .collect(),
    };
    // Kept in the cache, counted by its length: it holds no more than that.
    text.shrink_to_fit();
    Some(text)
}

/// A `bytes` object's contents, up to [`MAX_LINE_TABLE_BYTES`].
fn read_bytes(memory: &dyn RemoteMemory, layout: &Layout, address: u64) -> Option<Vec<u8>> {
    let size = memory
        .u64(address.checked_add(layout.var_size as u64)?)
        .ok()?;
    if size > MAX_LINE_TABLE_BYTES {
        return None;
    }
    let mut bytes = vec![0u8; size as usize];
    memory
        .read(address.checked_add(layout.bytes_data as u64)?, &mut bytes)
        .ok()?;
    Some(bytes)
}

#[cfg(test)]
mod tests;
