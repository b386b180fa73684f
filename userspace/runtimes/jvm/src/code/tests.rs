//! The code cache read from forged memory: blobs found by pc through a forged segment
//! map, compiled methods' scopes from forged pc descriptors and scope chains, and what
//! a hostile process could write instead.

use allocbpf_runtime::toolkit::FakeMemory;

use super::*;
use crate::forged::{
    self, CALL_INLINED, CALL_OUTER, CODE_OFFSET, HEAP_LOW, INNER_SCOPE, OUTER, OUTER_SCOPE,
};

/// A JDK 17 code cache holding the forged nmethod, read back.
fn forged_17() -> (FakeMemory, Layout, CodeCache, u64) {
    let layout = forged::layout_17();
    let mut memory = FakeMemory::new();
    let blob = forged::with_nmethod_17(&mut memory, &layout);
    let code = CodeCache::read(&memory, &layout).expect("a forged code cache reads");
    (memory, layout, code, blob)
}

#[test]
fn a_compiled_pc_is_found_through_the_segment_map_with_its_inlined_scopes() {
    let (memory, layout, mut code, blob) = forged_17();
    assert!(code.is_interpreted(forged::INTERPRETER + 0x80));
    assert!(!code.is_interpreted(forged::INTERPRETER + forged::INTERPRETER_BYTES));
    let code_begin = blob + CODE_OFFSET;
    let found = code
        .blob_at(&memory, code_begin + CALL_INLINED, &layout)
        .cloned();
    let found = found.expect("the pc's blob");
    assert_eq!(found.address, blob);
    assert_eq!(found.frame_bytes, forged::FRAME_WORDS as u64 * 8);
    assert_eq!(found.code_begin, code_begin);
    assert_eq!(found.method, Some(OUTER));
    assert_eq!(found.pc_descs, vec![(0x20, 1), (0x40, 4)]);
    let scopes =
        |code: &mut CodeCache, offset: u64| code.scopes_at(&memory, code_begin + offset, &layout);
    assert_eq!(
        scopes(&mut code, CALL_INLINED),
        vec![INNER_SCOPE, OUTER_SCOPE]
    );
    assert_eq!(scopes(&mut code, CALL_OUTER), vec![OUTER_SCOPE]);
    assert_eq!(
        scopes(&mut code, 0x30),
        vec![Scope {
            method: OUTER,
            bci: -1
        }],
        "no descriptor at exactly this pc: the method alone"
    );
    assert_eq!(
        code.blob_at(&memory, HEAP_LOW + 0x40, &layout),
        None,
        "a free segment"
    );
    assert_eq!(code.blob_at(&memory, 0x1234, &layout), None, "no heap's pc");
}

#[test]
fn the_caches_count_what_they_hold_and_a_refresh_empties_them() {
    let (memory, layout, mut code, blob) = forged_17();
    let pc = blob + CODE_OFFSET + CALL_INLINED;
    code.scopes_at(&memory, pc, &layout);
    let blob_bytes = size_of::<Option<Blob>>() + 2 * size_of::<(i32, i32)>() + ENTRY_OVERHEAD;
    assert_eq!(code.blobs.figures().bytes, blob_bytes);
    let start_bytes = size_of::<Option<u64>>() + ENTRY_OVERHEAD;
    assert_eq!(code.starts.figures().bytes, start_bytes);
    let scope_bytes = size_of::<Vec<Scope>>() + 2 * size_of::<Scope>() + ENTRY_OVERHEAD;
    assert_eq!(code.scopes.figures().bytes, scope_bytes);
    code.forget_blobs();
    let held = [
        &code.blobs.figures(),
        &code.starts.figures(),
        &code.scopes.figures(),
    ]
    .map(|f| f.bytes);
    assert_eq!(held, [0, 0, 0]);
}

#[test]
fn a_jdk_25_nmethod_keeps_its_scopes_apart_from_its_blob() {
    let layout = forged::layout_25();
    let mut memory = FakeMemory::new();
    forged::code_cache(&mut memory, &layout, 1024);
    let blob = forged::block(&mut memory, &layout, 4, 8, true);
    forged::nmethod_25(&mut memory, &layout, blob);
    let mut code = CodeCache::read(&memory, &layout).expect("a forged code cache reads");
    let pc = blob + CODE_OFFSET + CALL_INLINED;
    assert_eq!(
        code.blob_at(&memory, pc, &layout).map(|b| b.code_begin),
        Some(blob + CODE_OFFSET)
    );
    assert_eq!(
        code.scopes_at(&memory, pc, &layout),
        vec![INNER_SCOPE, OUTER_SCOPE]
    );
}

#[test]
fn a_blob_larger_than_its_heap_is_refused() {
    for size in [i32::MAX, -1, 0] {
        let (mut memory, layout, _, blob) = forged_17();
        memory.write_u32(blob + layout.blob_size, size as u32);
        let mut code = CodeCache::read(&memory, &layout).unwrap();
        let pc = blob + CODE_OFFSET + CALL_INLINED;
        assert_eq!(code.blob_at(&memory, pc, &layout), None, "size {size}");
        assert_eq!(code.scopes_at(&memory, pc, &layout), vec![], "size {size}");
    }
}

#[test]
fn a_blob_whose_code_starts_outside_it_is_refused() {
    let heap_end = HEAP_LOW + (1024 << forged::LOG2_SEGMENT);
    for code_begin in [heap_end + 0x100, HEAP_LOW, 0] {
        let (mut memory, layout, _, blob) = forged_17();
        let CodeStart::Pointer(field) = layout.code_start else {
            unreachable!("JDK 17's code start is a pointer");
        };
        memory.write_u64(blob + field, code_begin);
        let mut code = CodeCache::read(&memory, &layout).unwrap();
        let pc = blob + CODE_OFFSET + CALL_INLINED;
        assert_eq!(code.blob_at(&memory, pc, &layout), None, "{code_begin:#x}");
    }
}

#[test]
fn a_freed_block_holds_no_blob() {
    let (mut memory, layout, _, blob) = forged_17();
    let block = blob - layout.heap_block_size;
    memory.write(block + layout.heap_block_used, &[0]);
    let mut code = CodeCache::read(&memory, &layout).unwrap();
    assert_eq!(
        code.blob_at(&memory, blob + CODE_OFFSET + CALL_INLINED, &layout),
        None
    );
}

#[test]
fn a_segment_map_that_never_reaches_its_block_is_followed_a_bounded_number_of_steps() {
    let layout = forged::layout_17();
    let mut memory = FakeMemory::new();
    let segments = 2 * MAX_SEGMAP_STEPS as u64;
    forged::code_cache(&mut memory, &layout, segments);
    // Every segment says "one back": a chain as long as the heap, to segment 0.
    let mut marks = vec![1u8; segments as usize];
    marks[0] = 0;
    memory.write(forged::SEGMAP, &marks);
    memory.write(HEAP_LOW + layout.heap_block_used, &[1]);
    let code = CodeCache::read(&memory, &layout).unwrap();
    let pc_in = |segment: u64| HEAP_LOW + (segment << forged::LOG2_SEGMENT);
    let first_blob = HEAP_LOW + layout.heap_block_size;
    let near = MAX_SEGMAP_STEPS as u64 - 1;
    assert_eq!(
        code.blob_start(&memory, pc_in(near), &layout),
        Some(first_blob)
    );
    let far = MAX_SEGMAP_STEPS as u64 + 1;
    assert_eq!(code.blob_start(&memory, pc_in(far), &layout), None);
    // A step back past the heap's first segment.
    memory.write(forged::SEGMAP + 3, &[9]);
    assert_eq!(code.blob_start(&memory, pc_in(3), &layout), None);
}

/// The forged nmethod's scopes at its inlined call once `forge` rewrote it.
fn scopes_after(forge: impl FnOnce(&mut FakeMemory, &mut Layout, u64)) -> Vec<Scope> {
    let (mut memory, mut layout, _, blob) = forged_17();
    forge(&mut memory, &mut layout, blob);
    let mut code = CodeCache::read(&memory, &layout).unwrap();
    code.scopes_at(&memory, blob + CODE_OFFSET + CALL_INLINED, &layout)
}

/// What a compiled frame is named by when its debug data does not read back.
const METHOD_ALONE: Scope = Scope {
    method: OUTER,
    bci: -1,
};

#[test]
fn pc_descriptors_of_a_forged_size_are_not_read() {
    for size in [0, 4, MAX_PC_DESC_BYTES + 8, u64::MAX] {
        let scopes = scopes_after(|_, layout, _| layout.pc_desc.0 = size);
        assert_eq!(scopes, vec![METHOD_ALONE], "sizeof(PcDesc) {size}");
    }
    let DebugData::InBlob {
        scopes_pcs_offset,
        dependencies_offset,
        ..
    } = forged::layout_17().debug_data
    else {
        unreachable!("JDK 17's debug data is in the blob");
    };
    let huge_table = scopes_after(|memory, _, blob| {
        memory.write_u32(blob + dependencies_offset, i32::MAX as u32);
    });
    assert_eq!(
        huge_table,
        vec![METHOD_ALONE],
        "more descriptors than believed"
    );
    let inverted = scopes_after(|memory, _, blob| {
        memory.write_u32(blob + scopes_pcs_offset, forged::DEPENDENCIES as u32 + 8);
    });
    assert_eq!(
        inverted,
        vec![METHOD_ALONE],
        "a table that ends before it starts"
    );
}

#[test]
fn a_null_or_forged_scope_names_the_method_alone() {
    let pcs = |blob: u64| blob + forged::PCS;
    let null = scopes_after(|memory, layout, blob| {
        forged::pc_descs(memory, layout, pcs(blob), &[(CALL_INLINED as i32, 0)]);
    });
    assert_eq!(
        null,
        vec![METHOD_ALONE],
        "decode offset 0 is the null scope"
    );
    let past_data = scopes_after(|memory, layout, blob| {
        forged::pc_descs(memory, layout, pcs(blob), &[(CALL_INLINED as i32, 0x7fff)]);
    });
    assert_eq!(
        past_data,
        vec![METHOD_ALONE],
        "a decode offset past the scopes data"
    );
    // The compiled method's scope (decode offset 4) names metadata slot 0, 5 or 191
    // of 4, and the inlined scope's chain goes through it.
    for index in [0u8, 5, 0xbf] {
        let scopes = scopes_after(|memory, _, blob| {
            memory.write(blob + forged::SCOPES + 5, &[index]);
        });
        let outer_lost = vec![METHOD_ALONE];
        assert_eq!(scopes, outer_lost, "metadata index {index} of 4 slots");
    }
}

#[test]
fn a_scope_chain_that_loops_ends_at_the_inlining_bound() {
    // The inlined scope's caller is itself.
    let scopes = scopes_after(|memory, _, blob| {
        memory.write(blob + forged::SCOPES + 1, &[1, 2, 6]);
    });
    assert_eq!(scopes, vec![INNER_SCOPE; MAX_INLINE_DEPTH]);
}
