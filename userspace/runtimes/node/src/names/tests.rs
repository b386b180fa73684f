//! Frames named from a forged V8 heap: a `JSFunction`, its `SharedFunctionInfo`, its
//! `Script` with its name and line ends, and its `BytecodeArray`'s source position
//! table, as node 20 lays them out; and what a hostile process could write instead
//! (a string that is its own part, names past the bound, line ends of forged length,
//! pointers to nothing).

use allocbpf_runtime::toolkit::FakeMemory;

use super::*;
use crate::{
    forged::{self, layout, smi, Forge, HEAP, HEAP_BYTES, UNMAPPED},
    heap::MAX_NAME_CHARS,
    positions::tests::encode,
    v8dbg::Layout,
};

/// Maps of the forged objects, by instance type.
const STRING_MAP: u64 = 0x1000;
/// See [`STRING_MAP`].
const CONS_MAP: u64 = 0x1100;
/// See [`STRING_MAP`].
const FUNCTION_MAP: u64 = 0x1200;
/// See [`STRING_MAP`].
const SHARED_MAP: u64 = 0x1300;
/// See [`STRING_MAP`].
const SCRIPT_MAP: u64 = 0x1400;
/// See [`STRING_MAP`].
const FIXED_ARRAY_MAP: u64 = 0x1500;
/// See [`STRING_MAP`].
const BYTECODE_MAP: u64 = 0x1600;
/// See [`STRING_MAP`].
const BYTE_ARRAY_MAP: u64 = 0x1700;
/// See [`STRING_MAP`].
const SCOPE_MAP: u64 = 0x1800;

/// The forged objects (untagged).
const FUNCTION: u64 = 0x2000;
/// See [`FUNCTION`].
const SHARED: u64 = 0x2100;
/// See [`FUNCTION`].
const SCRIPT: u64 = 0x2200;
/// See [`FUNCTION`].
const FUNCTION_NAME: u64 = 0x2300;
/// See [`FUNCTION`].
const SCRIPT_NAME: u64 = 0x2400;
/// See [`FUNCTION`].
const LINE_ENDS: u64 = 0x2500;
/// See [`FUNCTION`].
const BYTECODE: u64 = 0x2600;
/// See [`FUNCTION`].
const TABLE: u64 = 0x2700;
/// See [`FUNCTION`].
const SOURCE: u64 = 0x2800;
/// Where a test writes a hostile object of its own.
const HOSTILE: u64 = 0x3000;

/// Node 20's field offsets of the forged objects.
const FUNCTION_SHARED: u64 = 24;
/// See [`FUNCTION_SHARED`].
const SHARED_NAME: u64 = 16;
/// See [`FUNCTION_SHARED`].
const SHARED_SCRIPT: u64 = 32;
/// See [`FUNCTION_SHARED`].
const SCRIPT_SOURCE: u64 = 8;
/// See [`FUNCTION_SHARED`].
const SCRIPT_NAME_FIELD: u64 = 16;
/// See [`FUNCTION_SHARED`].
const SCRIPT_LINE_ENDS: u64 = 56;
/// See [`FUNCTION_SHARED`].
const BYTECODE_POSITIONS: u64 = 32;

/// The script's line breaks: lines 1 to 4 are offsets 0..=10, 11..=25, 26..=40, 41 on.
const ENDS: [i64; 3] = [10, 25, 40];

/// The function `compute` of `/app/main.js`, its bytecodes' table saying offsets 0 to
/// 5 are at script offset 5 (line 1) and offsets 6 on at script offset 30 (line 3).
fn forge() -> FakeMemory {
    let mut memory = forged::heap();
    let string = memory.v8_map(STRING_MAP, 40);
    memory.v8_map(CONS_MAP, 41);
    let function = memory.v8_map(FUNCTION_MAP, 2066);
    let shared = memory.v8_map(SHARED_MAP, 262);
    let script = memory.v8_map(SCRIPT_MAP, 167);
    let fixed_array = memory.v8_map(FIXED_ARRAY_MAP, 175);
    let bytecode = memory.v8_map(BYTECODE_MAP, 191);
    let byte_array = memory.v8_map(BYTE_ARRAY_MAP, 190);
    memory.v8_map(SCOPE_MAP, 261);
    memory.object(FUNCTION, function);
    memory.write_u64(FUNCTION + FUNCTION_SHARED, SHARED + 1);
    memory.object(SHARED, shared);
    memory.write_u64(SHARED + SHARED_NAME, FUNCTION_NAME + 1);
    memory.write_u64(SHARED + SHARED_SCRIPT, SCRIPT + 1);
    memory.string(FUNCTION_NAME, string, "compute");
    memory.object(SCRIPT, script);
    memory.write_u64(SCRIPT + SCRIPT_NAME_FIELD, SCRIPT_NAME + 1);
    memory.write_u64(SCRIPT + SCRIPT_LINE_ENDS, LINE_ENDS + 1);
    memory.string(SCRIPT_NAME, string, "/app/main.js");
    let ends: Vec<u64> = ENDS.iter().map(|&end| smi(end)).collect();
    memory.fixed_array(LINE_ENDS, fixed_array, smi(ENDS.len() as i64), &ends);
    memory.object(BYTECODE, bytecode);
    memory.write_u64(BYTECODE + BYTECODE_POSITIONS, TABLE + 1);
    memory.byte_array(TABLE, byte_array, &encode(&[(0, 5, true), (6, 30, true)]));
    memory
}

/// The frames `memory`'s function is named as at bytecode `offset`, by new names.
fn at_bytecode(memory: &FakeMemory, layout: &Layout, offset: i64) -> Vec<Named> {
    let heap = Heap { memory, layout };
    let at = CodeOffset::Bytecode {
        array: BYTECODE + 1,
        offset,
    };
    Names::default().frames(&heap, FUNCTION + 1, at)
}

/// A frame as expected.
fn named(function: &str, file: &str, line: u32) -> Vec<Named> {
    vec![Named {
        function: function.to_string(),
        file: file.to_string(),
        line,
    }]
}

#[test]
fn a_function_is_named_with_its_script_and_the_line_of_its_bytecode() {
    let layout = layout();
    let memory = forge();
    assert_eq!(
        at_bytecode(&memory, &layout, 7),
        named("compute", "/app/main.js", 3)
    );
    assert_eq!(
        at_bytecode(&memory, &layout, 2),
        named("compute", "/app/main.js", 1)
    );
    // Compiled code nothing finds: the function, at its start (not known here).
    let heap = Heap {
        memory: &memory,
        layout: &layout,
    };
    let compiled = Names::default().frames(&heap, FUNCTION + 1, CodeOffset::Machine(UNMAPPED));
    assert_eq!(compiled, named("compute", "/app/main.js", 0));
}

#[test]
fn a_script_without_line_ends_has_them_found_in_its_source() {
    let layout = layout();
    let mut memory = forge();
    memory.write_u64(SCRIPT + SCRIPT_LINE_ENDS, 0);
    memory.write_u64(SCRIPT + SCRIPT_SOURCE, SOURCE + 1);
    // Line breaks at 1, 4 and 8: offset 5 is on line 3, offset 30 past the last.
    memory.string(SOURCE, STRING_MAP + 1, "a\nbb\nccc\nd");
    assert_eq!(
        at_bytecode(&memory, &layout, 2),
        named("compute", "/app/main.js", 3)
    );
    assert_eq!(
        at_bytecode(&memory, &layout, 7),
        named("compute", "/app/main.js", 4)
    );
}

#[test]
fn a_function_named_in_its_scope_info_starts_on_its_line() {
    let layout = layout();
    let mut memory = forge();
    // No context locals; then the name and the start and end positions.
    let scope = memory.object(HOSTILE, SCOPE_MAP + 1);
    memory
        .write_u64(HOSTILE + 8 + 16, smi(0))
        .write_u64(HOSTILE + 8 + 24, FUNCTION_NAME + 1)
        .write_u64(HOSTILE + 8 + 32, smi(12))
        .write_u64(HOSTILE + 8 + 40, smi(50));
    memory.write_u64(SHARED + SHARED_NAME, scope);
    let heap = Heap {
        memory: &memory,
        layout: &layout,
    };
    let frames = Names::default().frames(&heap, FUNCTION + 1, CodeOffset::Machine(UNMAPPED));
    assert_eq!(frames, named("compute", "/app/main.js", 2));
}

#[test]
fn names_that_are_their_own_parts_or_too_long_read_as_anonymous() {
    let layout = layout();
    let longest = "x".repeat(MAX_NAME_CHARS);
    let too_long = "x".repeat(MAX_NAME_CHARS + 1);
    for (forged, expected) in [
        (None, ANONYMOUS),
        (Some(too_long.as_str()), ANONYMOUS),
        (Some(longest.as_str()), longest.as_str()),
    ] {
        let mut memory = forge();
        let name = match forged {
            // A cons string whose parts are itself.
            None => memory.cons(HOSTILE, CONS_MAP + 1, 11, HOSTILE + 1, HOSTILE + 1),
            Some(text) => memory.string(HOSTILE, STRING_MAP + 1, text),
        };
        memory.write_u64(SHARED + SHARED_NAME, name);
        assert_eq!(
            at_bytecode(&memory, &layout, 7),
            named(expected, "/app/main.js", 3)
        );
    }
    // The script's name the same: no file, still its lines.
    let mut memory = forge();
    let name = memory.cons(HOSTILE, CONS_MAP + 1, 11, HOSTILE + 1, HOSTILE + 1);
    memory.write_u64(SCRIPT + SCRIPT_NAME_FIELD, name);
    assert_eq!(at_bytecode(&memory, &layout, 7), named("compute", "", 3));
}

#[test]
fn line_ends_of_forged_length_or_elements_give_no_line() {
    let layout = layout();
    let past_the_bound = smi(MAX_ARRAY_ELEMENTS as i64 + 1);
    let cases = [
        smi(i32::MAX as i64),
        past_the_bound,
        smi(-1),
        FIXED_ARRAY_MAP + 1,
    ];
    for length in cases {
        let mut memory = forge();
        memory.write_u64(LINE_ENDS + 8, length);
        assert_eq!(
            at_bytecode(&memory, &layout, 7),
            named("compute", "/app/main.js", 0),
            "length {length:#x}"
        );
    }
    // An element that is no Smi.
    let mut memory = forge();
    memory.write_u64(LINE_ENDS + 16 + 8, HOSTILE + 1);
    assert_eq!(
        at_bytecode(&memory, &layout, 7),
        named("compute", "/app/main.js", 0)
    );
    // Elements past the mapped memory: the array at the very end of the heap.
    let mut memory = forge();
    let last = HEAP + HEAP_BYTES as u64 - 16;
    let at_end = memory.fixed_array(last, FIXED_ARRAY_MAP + 1, smi(3), &[]);
    memory.write_u64(SCRIPT + SCRIPT_LINE_ENDS, at_end);
    assert_eq!(
        at_bytecode(&memory, &layout, 7),
        named("compute", "/app/main.js", 0)
    );
}

#[test]
fn pointers_to_nothing_give_plainer_frames() {
    let layout = layout();
    let nowhere = UNMAPPED + 1;
    let cases = [
        (FUNCTION + FUNCTION_SHARED, named(UNREADABLE, "", 0)),
        (SHARED + SHARED_NAME, named(ANONYMOUS, "/app/main.js", 3)),
        (SHARED + SHARED_SCRIPT, named("compute", "", 0)),
        (SCRIPT + SCRIPT_NAME_FIELD, named("compute", "", 3)),
        (
            BYTECODE + BYTECODE_POSITIONS,
            named("compute", "/app/main.js", 0),
        ),
    ];
    for (field, expected) in cases {
        let mut memory = forge();
        memory.write_u64(field, nowhere);
        assert_eq!(at_bytecode(&memory, &layout, 7), expected, "{field:#x}");
    }
    let memory = forge();
    let heap = Heap {
        memory: &memory,
        layout: &layout,
    };
    let mut names = Names::default();
    let at = CodeOffset::Bytecode {
        array: nowhere,
        offset: 7,
    };
    assert_eq!(
        names.frames(&heap, FUNCTION + 1, at),
        named("compute", "/app/main.js", 0)
    );
    assert_eq!(names.frames(&heap, nowhere, at), named(UNREADABLE, "", 0));
}

#[test]
fn what_is_read_is_counted_in_bytes_and_kept_until_cleared() {
    let layout = layout();
    let mut memory = forge();
    let mut names = Names::default();
    let at = CodeOffset::Bytecode {
        array: BYTECODE + 1,
        offset: 7,
    };
    let heap = Heap {
        memory: &memory,
        layout: &layout,
    };
    assert_eq!(
        names.frames(&heap, FUNCTION + 1, at),
        named("compute", "/app/main.js", 3)
    );
    let arc = ARC_COUNTS;
    assert_eq!(
        names.shared.figures().bytes,
        ENTRY_OVERHEAD + size_of::<Option<Shared>>() + "compute".len()
    );
    assert_eq!(
        names.scripts.figures().bytes,
        ENTRY_OVERHEAD
            + size_of::<Script>()
            + "/app/main.js".len()
            + arc
            + size_of::<Vec<u32>>()
            + ENDS.len() * size_of::<u32>()
    );
    assert_eq!(
        names.tables.figures().bytes,
        ENTRY_OVERHEAD
            + size_of::<Option<Arc<Vec<Position>>>>()
            + arc
            + size_of::<Vec<Position>>()
            + 2 * size_of::<Position>()
    );
    // The process renames its function: what was read stays until the names are
    // cleared (as the collector's moves make the caller do).
    memory.string(FUNCTION_NAME, STRING_MAP + 1, "renamed");
    let heap = Heap {
        memory: &memory,
        layout: &layout,
    };
    assert_eq!(
        names.frames(&heap, FUNCTION + 1, at),
        named("compute", "/app/main.js", 3)
    );
    names.clear();
    assert_eq!(names.shared.figures().bytes, 0);
    assert_eq!(
        names.frames(&heap, FUNCTION + 1, at),
        named("renamed", "/app/main.js", 3)
    );
}
