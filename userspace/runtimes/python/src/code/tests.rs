//! Code objects forged in memory as CPython 3.11 lays them out (the offsets are
//! the crate's own layout table's, so the reads tested are the ones a real process
//! gets), read back through [`FakeMemory`] as a hostile process's would be.

use std::path::PathBuf;

use allocbpf_common::python::PythonWalk;
use allocbpf_runtime::toolkit::FakeMemory;

use super::*;

const CODE_TYPE: u64 = 0x7f00_0010_0000;
const UNICODE_TYPE: u64 = 0x7f00_0020_0000;

/// Where the forged objects are.
const CODE: u64 = 0x10_0000;
const QUALNAME: u64 = 0x20_0000;
const FILENAME: u64 = 0x21_0000;
const NAME: u64 = 0x22_0000;
const LINETABLE: u64 = 0x23_0000;
const UNMAPPED: u64 = 0xdead_0000;

/// A 3.11 location-table entry's header: kind, length in code units.
fn entry(kind: u8, units: u8) -> u8 {
    0x80 | kind << 3 | (units - 1)
}

/// A function whose `def` is on line 10: [0,2) line 10 (one-line form, +0), [2,8)
/// line 11 (+1), [8,12) line 13 (no columns, svarint 4 = +2), [12,14) no line.
fn line_table() -> Vec<u8> {
    [
        &[entry(10, 1), 4, 8][..],
        &[entry(11, 3), 4, 20],
        &[entry(13, 2), 4],
        &[entry(15, 1)],
    ]
    .concat()
}

fn layout() -> &'static Layout {
    crate::layout::for_minor(11).expect("3.11's layout")
}

fn process() -> PythonProcess {
    PythonProcess {
        pid: 0,
        minor: 11,
        layout: layout(),
        walk: PythonWalk::default(),
        code_type: CODE_TYPE,
        unicode_type: Some(UNICODE_TYPE),
        eval_loop: None,
        image: PathBuf::from("/usr/bin/python3.11"),
    }
}

fn put(bytes: &mut [u8], at: u32, value: u64) {
    bytes[at as usize..at as usize + 8].copy_from_slice(&value.to_le_bytes());
}

/// A compact `str` of `kind` (1, 2 or 4 bytes a character) holding `text`.
fn str_object(text: &str, kind: u32) -> Vec<u8> {
    let layout = layout();
    let ascii = text.is_ascii() && kind == 1;
    let start = match ascii {
        true => layout.unicode_ascii_size,
        false => layout.unicode_compact_size,
    } as usize;
    let data: Vec<u8> = match kind {
        1 => text.chars().map(|c| u8::try_from(c).unwrap()).collect(),
        2 => text.encode_utf16().flat_map(u16::to_le_bytes).collect(),
        _ => text
            .chars()
            .flat_map(|c| (c as u32).to_le_bytes())
            .collect(),
    };
    let mut bytes = vec![0u8; start + data.len() + kind as usize];
    put(&mut bytes, 0, 1);
    put(&mut bytes, 8, UNICODE_TYPE);
    put(
        &mut bytes,
        layout.unicode_length,
        text.chars().count() as u64,
    );
    let state = (kind << 2) | (1 << 5) | (u32::from(ascii) << 6);
    let at = layout.unicode_state as usize;
    bytes[at..at + 4].copy_from_slice(&state.to_le_bytes());
    bytes[start..start + data.len()].copy_from_slice(&data);
    bytes
}

/// A `bytes` object holding `contents`.
fn bytes_object(contents: &[u8]) -> Vec<u8> {
    let layout = layout();
    let start = layout.bytes_data as usize;
    let mut bytes = vec![0u8; start + contents.len() + 1];
    put(&mut bytes, 0, 1);
    put(&mut bytes, layout.var_size, contents.len() as u64);
    bytes[start..start + contents.len()].copy_from_slice(contents);
    bytes
}

/// A code object whose fields point at the forged objects, with 16 bytes of
/// bytecode.
fn code_object() -> Vec<u8> {
    let layout = layout();
    let mut bytes = vec![0u8; layout.code_adaptive.unwrap() as usize + 16];
    bytes.resize(bytes.len().max(CODE_HEADER_BYTES), 0);
    put(&mut bytes, 0, 1);
    put(&mut bytes, 8, CODE_TYPE);
    put(&mut bytes, layout.var_size, 8);
    put(&mut bytes, layout.code_firstlineno, 10);
    put(&mut bytes, layout.code_qualname.unwrap(), QUALNAME);
    put(&mut bytes, layout.code_name, NAME);
    put(&mut bytes, layout.code_filename, FILENAME);
    put(&mut bytes, layout.code_linetable, LINETABLE);
    bytes
}

/// A process's memory holding one well-formed code object of `Handler.get`, in
/// `/srv/app/views.py`.
fn forged() -> FakeMemory {
    let mut memory = FakeMemory::new();
    memory
        .map(CODE, code_object())
        .map(QUALNAME, str_object("Handler.get", 1))
        .map(NAME, str_object("get", 1))
        .map(FILENAME, str_object("/srv/app/views.py", 1))
        .map(LINETABLE, bytes_object(&line_table()));
    memory
}

/// The record of a frame of the code object at `code` at byte `offset` of its
/// bytecode (3.11's `prev_instr`); `entry`: the first frame its eval loop pushed.
fn record(code: u64, offset: u64, entry: bool) -> PythonFrameRecord {
    PythonFrameRecord {
        code,
        instruction: code + layout().code_adaptive.unwrap() as u64 + offset,
        owner: u8::from(entry),
        ..PythonFrameRecord::default()
    }
}

fn frame(function: &str, file: &str, line: u32) -> ResolvedFrame {
    ResolvedFrame {
        function: function.to_string(),
        file: file.to_string(),
        line,
    }
}

/// The frames `memory` gives one record each of, in order (`None`: dropped).
fn resolve_each(memory: FakeMemory, records: &[PythonFrameRecord]) -> Vec<Option<ResolvedFrame>> {
    let mut resolver = CodeResolver::with_memory(memory, process());
    records
        .iter()
        .map(|record| resolver.resolve(record))
        .collect()
}

#[test]
fn a_forged_code_object_reads_as_its_names_and_lines() {
    let mut resolver = CodeResolver::with_memory(forged(), process());
    let views = |line| frame("Handler.get", "/srv/app/views.py", line);
    // Two frames of one eval loop call (the outer one its entry frame), then one
    // of another: two segments.
    let records = [
        record(CODE, 4, false),
        record(CODE, 10, true),
        record(CODE, 0, true),
    ];
    assert_eq!(
        resolver.segments(&records),
        vec![vec![views(11), views(13)], vec![views(10)]]
    );
    // No line for an instruction the table says has none, nor past its end, nor
    // before the bytecode.
    let lines: Vec<u32> = [
        record(CODE, 12, true),
        record(CODE, 14, true),
        PythonFrameRecord {
            instruction: CODE,
            ..record(CODE, 0, true)
        },
    ]
    .iter()
    .map(|record| resolver.resolve(record).unwrap().line)
    .collect();
    assert_eq!(lines, [0, 0, 0]);
}

#[test]
fn names_that_are_not_ascii_read_in_their_kind() {
    let mut memory = forged();
    memory
        .map(QUALNAME, str_object("Ωmega.λ", 2))
        .map(FILENAME, str_object("/srv/données.py", 1))
        .map(NAME, str_object("λ", 2));
    assert_eq!(
        resolve_each(memory.clone(), &[record(CODE, 4, true)]),
        [Some(frame("Ωmega.λ", "/srv/données.py", 11))]
    );
    memory.map(QUALNAME, str_object("𝔣.𝔤", 4));
    assert_eq!(
        resolve_each(memory, &[record(CODE, 4, true)]),
        [Some(frame("𝔣.𝔤", "/srv/données.py", 11))]
    );
}

#[test]
fn huge_length_fields_are_cut_or_refused() {
    let layout = layout();
    // A name that claims 2^40 characters: the first MAX_NAME_CHARS are read.
    let mut memory = forged();
    let mut long = str_object(&"a".repeat(2048), 1);
    put(&mut long, layout.unicode_length, 1 << 40);
    memory.map(QUALNAME, long);
    let cut = "a".repeat(MAX_NAME_CHARS as usize);
    assert_eq!(
        resolve_each(memory.clone(), &[record(CODE, 4, true)]),
        [Some(frame(&cut, "/srv/app/views.py", 11))]
    );
    // A length past any allocation: the name, and its frame, are refused.
    memory.write_u64(FILENAME + layout.unicode_length as u64, u64::MAX);
    assert_eq!(resolve_each(memory, &[record(CODE, 4, true)]), [None]);
    // A line table one byte larger than read, or of u64::MAX bytes: no lines.
    for size in [MAX_LINE_TABLE_BYTES + 1, u64::MAX] {
        let mut memory = forged();
        memory.write_u64(LINETABLE + layout.var_size as u64, size);
        assert_eq!(
            resolve_each(memory, &[record(CODE, 4, true)]),
            [Some(frame("Handler.get", "/srv/app/views.py", 0))]
        );
    }
}

#[test]
fn pointers_to_unmapped_memory_drop_the_frame_or_its_line() {
    let layout = layout();
    let field = |offset: u32| CODE + offset as u64;
    // The code object itself, a name, the file name: no frame.
    assert_eq!(resolve_each(forged(), &[record(UNMAPPED, 4, true)]), [None]);
    for (name, pointer) in [
        (layout.code_qualname.unwrap(), UNMAPPED),
        (layout.code_filename, UNMAPPED),
        (layout.code_qualname.unwrap(), u64::MAX - 8),
    ] {
        let mut memory = forged();
        memory.write_u64(field(name), pointer);
        assert_eq!(resolve_each(memory, &[record(CODE, 4, true)]), [None]);
    }
    // The line table, anywhere, at the top of the address space: no line.
    for pointer in [UNMAPPED, u64::MAX - 8, u64::MAX] {
        let mut memory = forged();
        memory.write_u64(field(layout.code_linetable), pointer);
        assert_eq!(
            resolve_each(memory, &[record(CODE, 4, true)]),
            [Some(frame("Handler.get", "/srv/app/views.py", 0))]
        );
    }
}

#[test]
fn self_referencing_pointers_are_read_once_and_not_believed() {
    let layout = layout();
    // Its name is the code object itself: not a `str`, whether `PyUnicode_Type`
    // is known or its state is all there is to check.
    let mut memory = forged();
    memory.write_u64(CODE + layout.code_qualname.unwrap() as u64, CODE);
    assert_eq!(
        resolve_each(memory.clone(), &[record(CODE, 4, true)]),
        [None]
    );
    let mut resolver = CodeResolver::with_memory(memory, process());
    resolver.process.unicode_type = None;
    assert_eq!(resolver.resolve(&record(CODE, 4, true)), None);
    // Its line table is the code object itself: its size field (8) and the bytes
    // after (zeros) are read, as a table that gives no line.
    let mut memory = forged();
    memory.write_u64(CODE + layout.code_linetable as u64, CODE);
    assert_eq!(
        resolve_each(memory, &[record(CODE, 4, true)]),
        [Some(frame("Handler.get", "/srv/app/views.py", 0))]
    );
    // A name that is a code object, a code object that is a name.
    let mut memory = forged();
    memory.write_u64(CODE + layout.code_filename as u64, CODE);
    assert_eq!(
        resolve_each(memory, &[record(CODE, 4, true), record(QUALNAME, 0, true)]),
        [None, None]
    );
}

#[test]
fn truncated_objects_are_not_read_past_their_end() {
    let layout = layout();
    // A code object that ends before its fields do.
    let mut memory = forged();
    memory.map(CODE, code_object()[..CODE_HEADER_BYTES - 8].to_vec());
    assert_eq!(resolve_each(memory, &[record(CODE, 4, true)]), [None]);
    // A name whose characters end before its length does, a header cut short.
    let name = str_object("Handler.get", 1);
    for cut in [name.len() - 4, layout.unicode_ascii_size as usize - 8] {
        let mut memory = forged();
        memory.map(QUALNAME, name[..cut].to_vec());
        assert_eq!(resolve_each(memory, &[record(CODE, 4, true)]), [None]);
    }
    // A line table whose bytes end before its size does: no line.
    let mut memory = forged();
    let table = bytes_object(&line_table());
    memory.map(LINETABLE, table[..table.len() - 4].to_vec());
    assert_eq!(
        resolve_each(memory, &[record(CODE, 4, true)]),
        [Some(frame("Handler.get", "/srv/app/views.py", 0))]
    );
}

#[test]
fn code_objects_are_cached_by_address_and_counted_by_their_bytes() {
    let mut resolver = CodeResolver::with_memory(forged(), process());
    let first = resolver.resolve(&record(CODE, 4, true));
    assert_eq!(first, Some(frame("Handler.get", "/srv/app/views.py", 11)));
    // What the address holds now is not read again: the code object is cached.
    resolver.memory.map(QUALNAME, str_object("Other.name", 1));
    assert_eq!(resolver.resolve(&record(CODE, 4, true)), first);
    // Nor is an address that held no code object.
    assert_eq!(resolver.resolve(&record(UNMAPPED, 0, true)), None);
    resolver.memory.map(UNMAPPED, code_object());
    assert_eq!(resolver.resolve(&record(UNMAPPED, 0, true)), None);
    let figures = resolver.cache_figures();
    let code = size_of::<Option<Code>>()
        + "Handler.get".len()
        + "/srv/app/views.py".len()
        + line_table().len();
    let none = size_of::<Option<Code>>();
    assert_eq!(
        (figures.entries, figures.bytes),
        (2, code + none + 2 * ENTRY_OVERHEAD)
    );
    assert_eq!(figures.max_bytes, MAX_CACHED_CODE_BYTES);
}

#[test]
fn code_objects_of_the_largest_names_and_tables_stay_within_the_bound() {
    let layout = layout();
    // Every code object names the longest names and table read.
    let mut memory = forged();
    let mut long = str_object(&"ÿ".repeat(MAX_NAME_CHARS as usize), 1);
    put(&mut long, layout.unicode_length, 1 << 40);
    let table = vec![entry(15, 1); MAX_LINE_TABLE_BYTES as usize];
    memory
        .map(QUALNAME, long.clone())
        .map(FILENAME, long)
        .map(LINETABLE, bytes_object(&table));
    let largest = size_of::<Option<Code>>()
        + 2 * 2 * MAX_NAME_CHARS as usize
        + MAX_LINE_TABLE_BYTES as usize
        + ENTRY_OVERHEAD;
    let fit = MAX_CACHED_CODE_BYTES / largest;
    let mut resolver = CodeResolver::with_memory(memory, process());
    for copy in 0..fit as u64 + 3 {
        let at = 0x1000_0000 + copy * 0x1000;
        resolver.memory.map(at, code_object());
        let frame = resolver.resolve(&record(at, 4, true)).unwrap();
        assert_eq!((frame.function.chars().count(), frame.line), (1024, 0));
    }
    let figures = resolver.cache_figures();
    assert_eq!((figures.entries, figures.evictions), (fit, 3));
    assert_eq!(figures.bytes, fit * largest);
}
