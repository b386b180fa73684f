//! Code found for return addresses in forged memory: a page of generated code with
//! `InstructionStream`s and their `Code` objects as V8 lays them out, and what a
//! hostile process could write instead (decoy maps, forged sizes and starts, streams
//! that name themselves, a page of nothing but maps).

use allocbpf_runtime::toolkit::FakeMemory;

use super::*;
use crate::{
    forged::{self, layout, Forge, UNMAPPED},
    v8dbg::Layout,
};

/// A page of generated code, mapped by [`page`].
const PAGE_AT: u64 = 0x7000_0000;

/// The `InstructionStream` map and the `Code` map in the forged heap.
const STREAM_MAP: u64 = 0x1000;
/// See [`STREAM_MAP`].
const CODE_MAP: u64 = 0x1100;

/// Turbofan's code kind in node 20 (`CodeKindBaseline` + 2).
const TURBOFAN: u64 = 13;

/// A forged heap with the two maps, and a zeroed page of generated code at
/// [`PAGE_AT`] (`bytes` long).
fn page(bytes: usize) -> FakeMemory {
    let mut memory = forged::heap();
    memory.v8_map(STREAM_MAP, 252);
    memory.v8_map(CODE_MAP, 245);
    memory.map(PAGE_AT, vec![0u8; bytes]);
    memory
}

/// A `Code` at `at` (untagged): its instructions at `start`, `size` (the whole word,
/// as forged) bytes of them, of kind `flags`.
fn code(memory: &mut FakeMemory, at: u64, start: u64, size: u64, flags: u64) -> u64 {
    memory
        .write_u64(at, CODE_MAP + 1)
        .write_u64(at + 40, start)
        .write_u64(at + 48, flags)
        .write_u64(at + 56, size);
    at + 1
}

/// An `InstructionStream` at `at` (untagged) naming `code`.
fn stream(memory: &mut FakeMemory, at: u64, code: u64) {
    memory.write_u64(at, STREAM_MAP + 1).write_u64(at + 8, code);
}

/// `memory` read with `layout`.
fn heap_of<'a>(memory: &'a FakeMemory, layout: &'a Layout) -> Heap<'a, FakeMemory> {
    Heap { memory, layout }
}

#[test]
fn code_is_found_below_its_address_and_decoys_are_not_believed() {
    let layout = layout();
    let mut memory = forged::heap();
    let stream_map = memory.v8_map(0x1000, 252);
    let code_map = memory.v8_map(0x1100, 245);
    // A page of generated code: zeros, a decoy map word at 0x7000_1000 (followed
    // by no code), the real stream at 0x7000_2030 (instructions at 0x7000_2040).
    let page = 0x7000_0000u64;
    memory.map(page, vec![0u8; 0x4000]);
    memory
        .write_u64(page + 0x1000, stream_map)
        .write_u64(page + 0x1008, 0x4242)
        .write_u64(page + 0x2030, stream_map)
        .write_u64(page + 0x2038, 0x9001);
    // Its Code: instructions at 0x7000_2040, 0x100 bytes, Turbofan's kind.
    memory
        .write_u64(0x9000, code_map)
        .write_u64(0x9000 + 40, page + 0x2040)
        .write_u64(0x9000 + 48, 13)
        .write_u64(0x9000 + 56, 0x100);
    let heap = Heap {
        memory: &memory,
        layout: &layout,
    };
    let mut finder = CodeFinder::default();
    let found = finder.code_at(&heap, page + 0x2080, None).unwrap();
    assert_eq!(
        (found.code, found.start, found.size, found.kind),
        (0x9001, page + 0x2040, 0x100, 13)
    );
    // Past its end: the stream below does not hold it, and the decoy is no code.
    assert_eq!(finder.code_at(&heap, page + 0x2400, None), None);
    assert_eq!(finder.code_at(&heap, page + 0x1800, None), None);
    // A hint that does not hold the address is not believed either.
    assert_eq!(finder.code_at(&heap, page + 0x3000, Some(0x9001)), None);
}

#[test]
fn a_function_s_own_code_is_found_by_its_hint_with_no_page_to_search() {
    let layout = layout();
    let mut memory = page(0);
    // Its instructions are in no mapped page: only the hint can find them.
    let start = UNMAPPED + 0x40;
    let own = code(&mut memory, 0x9000, start, 0x80, TURBOFAN);
    let heap = heap_of(&memory, &layout);
    let mut finder = CodeFinder::default();
    assert_eq!(
        finder.code_at(&heap, start + 0x10, Some(own)),
        Some(CodeRange {
            code: own,
            start,
            size: 0x80,
            kind: TURBOFAN as u32,
        })
    );
    assert_eq!(finder.code_at(&heap, start + 0x81, Some(own)), None);
    assert_eq!(
        finder.code_at(&heap, start, Some(own)),
        None,
        "a return address is after its call: never at the code's first byte"
    );
}

#[test]
fn forged_sizes_and_starts_are_not_believed() {
    let layout = layout();
    let mut memory = page(0x4000);
    // A size word with its upper half forged: only its 32 bits count.
    stream(&mut memory, PAGE_AT + 0x1030, 0x9001);
    code(
        &mut memory,
        0x9000,
        PAGE_AT + 0x1040,
        0xffff_ffff_0000_0100,
        TURBOFAN,
    );
    // A stream whose Code says its instructions are elsewhere.
    stream(&mut memory, PAGE_AT + 0x2030, 0x9101);
    code(&mut memory, 0x9100, PAGE_AT + 0x3000, 0x1000, TURBOFAN);
    let heap = heap_of(&memory, &layout);
    let mut finder = CodeFinder::default();
    let masked = finder.code_at(&heap, PAGE_AT + 0x1080, None).unwrap();
    assert_eq!((masked.code, masked.size), (0x9001, 0x100));
    assert_eq!(finder.code_at(&heap, PAGE_AT + 0x1800, None), None);
    assert_eq!(
        finder.code_at(&heap, PAGE_AT + 0x2080, None),
        None,
        "the stream below holds it, but its Code's start is not the stream's"
    );
    assert_eq!(finder.code_at(&heap, PAGE_AT + 0x3010, None), None);
}

#[test]
fn a_stream_that_names_itself_is_passed_over_and_a_page_of_maps_ends_the_search() {
    let layout = layout();
    let mut memory = page(0x4000);
    // The real stream, and above it one whose Code is itself.
    stream(&mut memory, PAGE_AT + 0x0ff0, 0x9001);
    code(&mut memory, 0x9000, PAGE_AT + 0x1000, 0x1000, TURBOFAN);
    stream(&mut memory, PAGE_AT + 0x13f0, PAGE_AT + 0x13f1);
    let heap = heap_of(&memory, &layout);
    let found = CodeFinder::default().code_at(&heap, PAGE_AT + 0x1800, None);
    assert_eq!(found.map(|range| range.code), Some(0x9001));

    // A page of nothing but stream maps: every stream names the map as its Code.
    let mut maps = page(0);
    let words: Vec<u8> = (0..PAGE / 8)
        .flat_map(|_| (STREAM_MAP + 1).to_le_bytes())
        .collect();
    maps.map(PAGE_AT, words);
    let heap = Heap {
        memory: &maps,
        layout: &layout,
    };
    let mut finder = CodeFinder::default();
    assert_eq!(finder.code_at(&heap, PAGE_AT + PAGE - 8, None), None);
    assert_eq!(finder.stream_map, None, "no stream was believed");
}

#[test]
fn addresses_at_the_ends_of_memory_find_nothing() {
    let layout = layout();
    let memory = page(0x1000);
    let heap = heap_of(&memory, &layout);
    let mut finder = CodeFinder::default();
    for pc in [0, 1, PAGE_AT, u64::MAX, UNMAPPED + 0x10] {
        assert_eq!(finder.code_at(&heap, pc, Some(u64::MAX)), None, "{pc:#x}");
    }
}

#[test]
fn an_address_is_read_once_until_the_code_is_cleared() {
    let layout = layout();
    let mut memory = page(0x4000);
    stream(&mut memory, PAGE_AT + 0x1030, 0x9001);
    code(&mut memory, 0x9000, PAGE_AT + 0x1040, 0x100, TURBOFAN);
    let mut finder = CodeFinder::default();
    let found = finder.code_at(&heap_of(&memory, &layout), PAGE_AT + 0x1080, None);
    assert!(found.is_some());
    // The code is freed and its space reused: what was found is kept until cleared.
    memory.write_u64(0x9000 + 56, 0);
    let heap = heap_of(&memory, &layout);
    assert_eq!(finder.code_at(&heap, PAGE_AT + 0x1080, None), found);
    finder.clear();
    assert_eq!(finder.stream_map, None);
    assert_eq!(finder.code_at(&heap, PAGE_AT + 0x1080, None), None);
}

#[test]
fn as_many_addresses_are_kept_as_when_entries_were_counted_and_the_oldest_go() {
    let layout = layout();
    let memory = page(0);
    let heap = heap_of(&memory, &layout);
    let mut finder = CodeFinder::default();
    for n in 0..=MAX_CACHED as u64 {
        finder.code_at(&heap, UNMAPPED + 0x40 * n, None);
    }
    let figures = finder.by_address.figures();
    assert_eq!((figures.entries, figures.evictions), (MAX_CACHED, 1));
    assert!(
        !finder.by_address.contains_key(&UNMAPPED),
        "the oldest went"
    );
    assert!(finder.by_address.contains_key(&(UNMAPPED + 0x40)));
    assert_eq!(figures.bytes, MAX_CACHED_BYTES);
}

/// A forged header size the constants allow, and code in the last page of the address
/// space: the search's lower bound (`low + header`) wrapped to a small number, and a
/// release build searched downward ~2^58 steps. Every bound is checked now.
#[test]
fn a_search_at_the_top_of_the_address_space_ends() {
    let mut layout = layout();
    layout.fields.stream_header = 4096;
    let top_page = !(SMALL_PAGE - 1);
    let mut memory = page(0x1000);
    memory.map(top_page, vec![0u8; (SMALL_PAGE - 16) as usize]);
    let heap = heap_of(&memory, &layout);
    let mut finder = CodeFinder::default();
    let started = std::time::Instant::now();
    for pc in [top_page + 0x800, u64::MAX - 16] {
        assert_eq!(finder.code_at(&heap, pc, None), None, "{pc:#x}");
    }
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
}
