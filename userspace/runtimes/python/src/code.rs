//! From the eBPF program's frame records to Python locations: each record's code
//! object is read from the target's memory, checked (its type must be `PyCode_Type`,
//! its names `str` of bounded length, its line table bounded), cached by address, and
//! its instruction turned into a line with the version's line table.

use std::collections::HashMap;

use allocbpf_common::python::PythonFrameRecord;

use crate::{
    discover::PythonProcess,
    linetable::{line_of, LineTableFormat},
    memory::ProcessMemory,
};

/// Longest name or file name read, in characters; longer ones are cut.
const MAX_NAME_CHARS: u64 = 1024;

/// Largest line table read, in bytes; a code object with a larger one gets no lines.
const MAX_LINE_TABLE_BYTES: u64 = 256 * 1024;

/// Code objects cached per process; past it the cache starts again (a process that
/// keeps creating code, or forges addresses, costs reads, never memory).
const MAX_CACHED_CODE: usize = 16_384;

/// Bytes of a code object's fixed part read at once (every field used lies in it).
const CODE_HEADER_BYTES: usize = 256;

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
#[derive(Clone, Debug)]
struct Code {
    function: String,
    file: String,
    first_line: i32,
    line_table: Vec<u8>,
    /// Where the bytecode starts in the process (3.11+), for instruction pointers.
    bytecode: u64,
}

/// Resolves one process's frame records, caching its code objects.
pub struct CodeResolver {
    process: PythonProcess,
    memory: ProcessMemory,
    format: Option<LineTableFormat>,
    cache: HashMap<u64, Option<Code>>,
}

impl CodeResolver {
    /// A resolver for `process`.
    pub fn new(process: PythonProcess) -> Self {
        Self {
            memory: ProcessMemory::new(process.pid),
            format: LineTableFormat::for_minor(process.minor),
            process,
            cache: HashMap::new(),
        }
    }

    /// The process resolved.
    pub fn process(&self) -> &PythonProcess {
        &self.process
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
        if !self.cache.contains_key(&record.code) {
            if self.cache.len() >= MAX_CACHED_CODE {
                self.cache.clear();
            }
            let code = self.read_code(record.code);
            self.cache.insert(record.code, code);
        }
        let code = self.cache.get(&record.code)?.as_ref()?;
        let line = self
            .instruction_offset(code, record.instruction)
            .zip(self.format)
            .and_then(|(offset, format)| line_of(format, &code.line_table, code.first_line, offset))
            .unwrap_or(0);
        Some(ResolvedFrame {
            function: code.function.clone(),
            file: code.file.clone(),
            line,
        })
    }

    /// The byte offset of the frame's instruction in its bytecode.
    fn instruction_offset(&self, code: &Code, instruction: u64) -> Option<u32> {
        match self.process.minor {
            // `f_lasti`, an int: bytes in 3.9, code units in 3.10.
            ..=9 => u32::try_from(instruction as u32 as i32).ok(),
            10 => u32::try_from(instruction as u32 as i32)
                .ok()?
                .checked_mul(2),
            _ => u32::try_from(instruction.checked_sub(code.bytecode)?).ok(),
        }
    }

    /// Reads and checks the code object at `address`.
    fn read_code(&self, address: u64) -> Option<Code> {
        let layout = self.process.layout;
        let mut header = [0u8; CODE_HEADER_BYTES];
        self.memory.read(address, &mut header).ok()?;
        let word = |offset: u32| -> Option<u64> {
            let at = offset as usize;
            Some(u64::from_le_bytes(header.get(at..at + 8)?.try_into().ok()?))
        };
        if word(8)? != self.process.code_type {
            return None;
        }
        let first_line = word(layout.code_firstlineno)? as u32 as i32;
        let name_field = layout.code_qualname.unwrap_or(layout.code_name);
        let function = self.read_str(word(name_field)?)?;
        let file = self.read_str(word(layout.code_filename)?)?;
        let line_table = self
            .read_bytes(word(layout.code_linetable)?)
            .unwrap_or_default();
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

    /// A `str` object's text (compact strings: every name and file name of a code
    /// object is one), cut to [`MAX_NAME_CHARS`].
    fn read_str(&self, address: u64) -> Option<String> {
        let layout = self.process.layout;
        let mut header = [0u8; 48];
        self.memory.read(address, &mut header).ok()?;
        let word = |at: usize| u64::from_le_bytes(header[at..at + 8].try_into().unwrap());
        if let Some(unicode_type) = self.process.unicode_type {
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
            address + layout.unicode_ascii_size as u64
        } else {
            address + layout.unicode_compact_size as u64
        };
        let mut bytes = vec![0u8; (chars * kind as u64) as usize];
        self.memory.read(data, &mut bytes).ok()?;
        let text: String = match kind {
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
        Some(text)
    }

    /// A `bytes` object's contents, up to [`MAX_LINE_TABLE_BYTES`].
    fn read_bytes(&self, address: u64) -> Option<Vec<u8>> {
        let layout = self.process.layout;
        let size = self.memory.u64(address + layout.var_size as u64).ok()?;
        if size > MAX_LINE_TABLE_BYTES {
            return None;
        }
        let mut bytes = vec![0u8; size as usize];
        self.memory
            .read(address + layout.bytes_data as u64, &mut bytes)
            .ok()?;
        Some(bytes)
    }
}
