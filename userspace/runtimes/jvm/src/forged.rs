//! Forged JVMs for tests: layouts built from structure tables as a JVM's are read
//! (JDK 17's and JDK 25's shapes, at plausible offsets), and a code cache and compiled
//! method forged in [`FakeMemory`] at made-up addresses, so that every reader is
//! tested on what a hostile process could write in its memory.

use allocbpf_runtime::toolkit::FakeMemory;

use crate::{
    code::Scope,
    layout::Layout,
    vmstructs::{
        Field::{self, Member, Static},
        VmStructs,
    },
};

/// Where `AbstractInterpreter::_code` (a `StubQueue*`) is.
pub const INTERPRETER_CODE: u64 = 0x10_0000;
/// Where `CodeCache::_heaps` (a `GrowableArray<CodeHeap*>*`) is.
pub const CODE_HEAPS: u64 = 0x10_0008;
/// The interpreter's stub queue.
const STUB_QUEUE: u64 = 0x11_0000;
/// The code heaps' array.
const HEAP_ARRAY: u64 = 0x12_0000;
/// The one code heap's `CodeHeap`.
const CODE_HEAP: u64 = 0x13_0000;
/// Blobs' names (C strings).
const BLOB_NAMES: u64 = 0x14_0000;
/// Where the template interpreter's code starts, and its bytes.
pub const INTERPRETER: u64 = 0x40_0000;
/// See [`INTERPRETER`].
pub const INTERPRETER_BYTES: u64 = 0x1000;
/// The code heap's reserved range.
pub const HEAP_LOW: u64 = 0x50_0000;
/// Where its segment map is.
pub const SEGMAP: u64 = 0x60_0000;
/// Its segments' size, as `CodeHeap::_log2_segment_size`.
pub const LOG2_SEGMENT: u32 = 6;

/// Where the forged nmethod's code starts, from the blob.
pub const CODE_OFFSET: u64 = 0x100;
/// The forged nmethod's size (`CodeBlob::_size`).
pub const BLOB_SIZE: i32 = 0x1d0;
/// Its frame size in words.
pub const FRAME_WORDS: i32 = 4;
/// The method compiled, and the method inlined into it.
pub const OUTER: u64 = 0x70_0000;
/// See [`OUTER`].
pub const INNER: u64 = 0x70_1000;
/// The scope at [`CALL_INLINED`]: the inlined method at bci 5.
pub const INNER_SCOPE: Scope = Scope {
    method: INNER,
    bci: 5,
};
/// The scope [`INNER_SCOPE`] is inlined into, and the one at [`CALL_OUTER`]: the
/// compiled method at bci 10.
pub const OUTER_SCOPE: Scope = Scope {
    method: OUTER,
    bci: 10,
};
/// A call inside the inlined method: its pc's offset from the code's start.
pub const CALL_INLINED: u64 = 0x20;
/// A call in the compiled method itself.
pub const CALL_OUTER: u64 = 0x40;
/// In JDK 17's nmethod: its metadata, scopes data, pc descriptors and dependencies,
/// as offsets from the blob.
const METADATA: u64 = 0x160;
/// See [`METADATA`].
pub const SCOPES: u64 = 0x180;
/// See [`METADATA`].
pub const PCS: u64 = 0x1a0;
/// See [`METADATA`].
pub const DEPENDENCIES: u64 = 0x1c0;
/// JDK 25's nmethod's immutable and mutable data.
const IMMUTABLE: u64 = 0x90_0000;
const MUTABLE: u64 = 0x91_0000;

/// The forged scope chain, coded without zero exclusion (`X = 0`): at decode offset 1
/// the inlined method at bci 5 (caller at 4, metadata index 2), at 4 the compiled one
/// at bci 10 (no caller, metadata index 1). Each value is `bci + 1`, as HotSpot writes.
const SCOPE_CHAIN: [u8; 7] = [0, 4, 2, 6, 0, 1, 11];

/// The tables every version has, with `own`: fields and integers of one version's.
fn tables(own: &[(&str, &str, Field)], ints: &[(&str, i64)]) -> VmStructs {
    let mut fields = vec![
        ("JavaThread", "_anchor", Member(0x2a0)),
        ("JavaFrameAnchor", "_last_Java_sp", Member(0)),
        ("JavaFrameAnchor", "_last_Java_pc", Member(8)),
        ("JavaFrameAnchor", "_last_Java_fp", Member(16)),
        ("Thread", "_tlab", Member(0x60)),
        ("ThreadLocalAllocBuffer", "_start", Member(0)),
        ("ThreadLocalAllocBuffer", "_top", Member(8)),
        ("JavaThread", "_stack_base", Member(0x220)),
        ("Klass", "_name", Member(16)),
        ("Symbol", "_length", Member(4)),
        ("Symbol", "_body", Member(6)),
        ("Method", "_constMethod", Member(8)),
        ("ConstMethod", "_constants", Member(8)),
        ("ConstMethod", "_code_size", Member(32)),
        ("ConstMethod", "_name_index", Member(34)),
        ("ConstMethod", "_signature_index", Member(36)),
        ("ConstantPool", "_pool_holder", Member(24)),
        ("ConstantPool", "_source_file_name_index", Member(56)),
        ("ConstantPool", "_length", Member(64)),
        ("CodeCache", "_heaps", Static(CODE_HEAPS)),
        ("CodeHeap", "_memory", Member(8)),
        ("CodeHeap", "_segmap", Member(0x48)),
        ("CodeHeap", "_log2_segment_size", Member(0xa8)),
        ("HeapBlock", "_header", Member(0)),
        ("HeapBlock::Header", "_used", Member(8)),
        ("VirtualSpace", "_low_boundary", Member(0)),
        ("VirtualSpace", "_high_boundary", Member(8)),
        ("CodeBlob", "_name", Member(0x50)),
        ("CodeBlob", "_frame_size", Member(0x18)),
        ("CodeBlob", "_size", Member(0x0c)),
        ("PcDesc", "_pc_offset", Member(0)),
        ("PcDesc", "_scope_decode_offset", Member(4)),
        ("AbstractInterpreter", "_code", Static(INTERPRETER_CODE)),
        ("StubQueue", "_stub_buffer", Member(8)),
        ("StubQueue", "_buffer_limit", Member(0x14)),
    ];
    fields.extend_from_slice(own);
    let sizes = [
        ("ConstMethod", 48),
        ("ConstantPool", 72),
        ("HeapBlock", 16),
        ("PcDesc", 16),
    ];
    VmStructs::from_parts(&fields, &sizes, ints)
}

/// JDK 17's layout: a blob's code start a pointer, its debug data in the blob.
pub fn layout_17() -> Layout {
    let own = [
        ("ConstMethod", "_flags", Member(28)),
        ("CodeBlob", "_code_begin", Member(0x20)),
        ("CompiledMethod", "_method", Member(0x60)),
        ("CompiledMethod", "_scopes_data_begin", Member(0x68)),
        ("nmethod", "_scopes_pcs_offset", Member(0x70)),
        ("nmethod", "_dependencies_offset", Member(0x74)),
        ("nmethod", "_metadata_offset", Member(0x78)),
    ];
    let vm = tables(&own, &[("ConstMethod::_has_linenumber_table", 1)]);
    Layout::from_tables(&vm, 17).expect("every field a layout needs")
}

/// JDK 25's layout: a blob's code start an offset, its debug data apart from it.
pub fn layout_25() -> Layout {
    let own = [
        ("ConstMethod", "_flags._flags", Member(28)),
        ("CodeBlob", "_code_offset", Member(0x20)),
        ("CodeBlob", "_relocation_size", Member(0x28)),
        ("CodeBlob", "_mutable_data_size", Member(0x2c)),
        ("CodeBlob", "_mutable_data", Member(0x58)),
        ("nmethod", "_method", Member(0x60)),
        ("nmethod", "_immutable_data", Member(0x68)),
        ("nmethod", "_scopes_pcs_offset", Member(0x70)),
        ("nmethod", "_scopes_data_offset", Member(0x74)),
        ("nmethod", "_immutable_data_size", Member(0x78)),
    ];
    let ints = [("ConstMethodFlags::_misc_has_linenumber_table", 1)];
    Layout::from_tables(&tables(&own, &ints), 25).expect("every field a layout needs")
}

/// Maps a code cache of one heap of `segments` segments, all free, and the
/// interpreter's range.
pub fn code_cache(memory: &mut FakeMemory, layout: &Layout, segments: u64) {
    let high = HEAP_LOW + (segments << LOG2_SEGMENT);
    memory
        .map(INTERPRETER_CODE, vec![0u8; 16])
        .write_u64(INTERPRETER_CODE, STUB_QUEUE)
        .write_u64(CODE_HEAPS, HEAP_ARRAY);
    memory
        .map(STUB_QUEUE, vec![0u8; 64])
        .write_u64(STUB_QUEUE + layout.stub_buffer.0, INTERPRETER)
        .write_u32(STUB_QUEUE + layout.stub_buffer.1, INTERPRETER_BYTES as u32);
    memory
        .map(HEAP_ARRAY, vec![0u8; 0x108])
        .write_u32(HEAP_ARRAY + layout.array_len, 1)
        .write_u64(HEAP_ARRAY + layout.array_data, HEAP_ARRAY + 0x100)
        .write_u64(HEAP_ARRAY + 0x100, CODE_HEAP);
    let space = |space: u64, field: u64| CODE_HEAP + space + field;
    memory
        .map(CODE_HEAP, vec![0u8; 0x100])
        .write_u64(space(layout.heap_memory, layout.space_low), HEAP_LOW)
        .write_u64(space(layout.heap_memory, layout.space_high), high)
        .write_u64(space(layout.heap_segmap, layout.space_low), SEGMAP)
        .write_u32(CODE_HEAP + layout.heap_log2_segment, LOG2_SEGMENT);
    memory.map(HEAP_LOW, vec![0u8; (high - HEAP_LOW) as usize]);
    memory.map(SEGMAP, vec![0xffu8; segments as usize]);
    // A page, as a process maps them: a C string is read in pieces within a page.
    let mut names = b"nmethod\0StubRoutines\0".to_vec();
    names.resize(4096, 0);
    memory.map(BLOB_NAMES, names);
}

/// Marks `segments` segments from `first` a block in the segment map (each segment
/// its distance back to the first, as HotSpot marks them), used or free; the address
/// of the blob it holds.
pub fn block(
    memory: &mut FakeMemory,
    layout: &Layout,
    first: u64,
    segments: u8,
    used: bool,
) -> u64 {
    let marks: Vec<u8> = (0..segments).collect();
    let block = HEAP_LOW + (first << LOG2_SEGMENT);
    memory
        .write(SEGMAP + first, &marks)
        .write(block + layout.heap_block_used, &[u8::from(used)]);
    block + layout.heap_block_size
}

/// Writes a blob's common fields at `blob`: an nmethod of [`BLOB_SIZE`] bytes whose
/// code starts at [`CODE_OFFSET`], compiling [`OUTER`].
pub fn blob_fields(memory: &mut FakeMemory, layout: &Layout, blob: u64) {
    memory
        .write_u64(blob + layout.blob_name, BLOB_NAMES)
        .write_u32(blob + layout.blob_frame_size, FRAME_WORDS as u32)
        .write_u32(blob + layout.blob_size, BLOB_SIZE as u32)
        .write_u64(blob + layout.nmethod_method, OUTER);
    match layout.code_start {
        crate::layout::CodeStart::Pointer(field) => {
            memory.write_u64(blob + field, blob + CODE_OFFSET)
        }
        crate::layout::CodeStart::Offset(field) => {
            memory.write_u32(blob + field, CODE_OFFSET as u32)
        }
    };
}

/// Writes a pc descriptor table of `descs` (`(pc offset, decode offset)`) at `at`.
pub fn pc_descs(memory: &mut FakeMemory, layout: &Layout, at: u64, descs: &[(i32, i32)]) {
    let (size, pc, scope) = layout.pc_desc;
    for (index, &(pc_offset, decode_offset)) in descs.iter().enumerate() {
        let entry = at + index as u64 * size;
        memory
            .write_u32(entry + pc, pc_offset as u32)
            .write_u32(entry + scope, decode_offset as u32);
    }
}

/// Forges JDK 17's nmethod at `blob` (see [`layout_17`]): its metadata
/// `[OUTER, INNER]`, the scope chain [`SCOPE_CHAIN`] and descriptors at
/// [`CALL_INLINED`] (decode offset 1) and [`CALL_OUTER`] (4).
pub fn nmethod_17(memory: &mut FakeMemory, layout: &Layout, blob: u64) {
    let crate::layout::DebugData::InBlob {
        scopes_data_begin,
        scopes_pcs_offset,
        dependencies_offset,
        metadata_offset,
    } = layout.debug_data
    else {
        panic!("a JDK 17 layout");
    };
    blob_fields(memory, layout, blob);
    memory
        .write_u64(blob + scopes_data_begin, blob + SCOPES)
        .write_u32(blob + scopes_pcs_offset, PCS as u32)
        .write_u32(blob + dependencies_offset, DEPENDENCIES as u32)
        .write_u32(blob + metadata_offset, METADATA as u32)
        .write_u64(blob + METADATA, OUTER)
        .write_u64(blob + METADATA + 8, INNER)
        .write(blob + SCOPES, &SCOPE_CHAIN);
    let descs = [(CALL_INLINED as i32, 1), (CALL_OUTER as i32, 4)];
    pc_descs(memory, layout, blob + PCS, &descs);
}

/// Forges JDK 25's nmethod at `blob` (see [`layout_25`]): the same method, scopes
/// and descriptors as [`nmethod_17`]'s, in separate immutable and mutable data, with
/// its compressed integers coded excluding zero (`X = 1`).
pub fn nmethod_25(memory: &mut FakeMemory, layout: &Layout, blob: u64) {
    let crate::layout::DebugData::Separate {
        immutable_data,
        scopes_pcs_offset,
        scopes_data_offset,
        immutable_data_size,
        mutable_data,
        relocation_size,
        mutable_data_size,
    } = layout.debug_data
    else {
        panic!("a JDK 25 layout");
    };
    blob_fields(memory, layout, blob);
    memory
        .write_u64(blob + immutable_data, IMMUTABLE)
        .write_u32(blob + scopes_pcs_offset, 0x10)
        .write_u32(blob + scopes_data_offset, 0x30)
        .write_u32(blob + immutable_data_size, 0x50)
        .write_u64(blob + mutable_data, MUTABLE)
        .write_u32(blob + relocation_size, 0x20)
        .write_u32(blob + mutable_data_size, 0x40);
    let chain: Vec<u8> = SCOPE_CHAIN.iter().map(|&b| b + 1).collect();
    memory
        .map(IMMUTABLE, vec![0u8; 0x50])
        .write(IMMUTABLE + 0x30, &chain);
    let descs = [(CALL_INLINED as i32, 1), (CALL_OUTER as i32, 4)];
    pc_descs(memory, layout, IMMUTABLE + 0x10, &descs);
    memory
        .map(MUTABLE, vec![0u8; 0x40])
        .write_u64(MUTABLE + 0x20, OUTER)
        .write_u64(MUTABLE + 0x28, INNER);
}

/// Where [`with_nmethod_17`] puts its nmethod: in a block of 8 segments from
/// segment 4, after the block's header.
pub const NMETHOD: u64 = HEAP_LOW + (4 << LOG2_SEGMENT) + 16;

/// A code cache of one heap of 1,024 segments holding JDK 17's nmethod (see
/// [`nmethod_17`]) at [`NMETHOD`]; the blob's address.
pub fn with_nmethod_17(memory: &mut FakeMemory, layout: &Layout) -> u64 {
    code_cache(memory, layout, 1024);
    let blob = block(memory, layout, 4, 8, true);
    assert_eq!(blob, NMETHOD, "a block header of sizeof(HeapBlock)");
    nmethod_17(memory, layout, blob);
    blob
}
