//! Names read from forged metadata: a `Method*`, its `ConstMethod`, constant pool,
//! class and symbols, and its line number table, as a JVM lays them out and as a
//! hostile process could write them instead.

use std::mem::size_of;

use allocbpf_runtime::toolkit::{cache::ENTRY_OVERHEAD, FakeMemory};

use super::*;
use crate::forged;

#[test]
fn class_names_read_as_java_writes_them() {
    assert_eq!(java_class_name("java/lang/String"), "java.lang.String");
    assert_eq!(java_class_name("[B"), "byte[]");
    assert_eq!(
        java_class_name("[[Ljava/lang/Object;"),
        "java.lang.Object[][]"
    );
    assert_eq!(java_class_name("Alloc$Point"), "Alloc$Point");
}

#[test]
fn a_bytecode_index_takes_the_line_of_the_entry_at_or_before_it() {
    let name = MethodName {
        function: "A.f".to_string(),
        file: "A.java".to_string(),
        code_base: 0,
        code_size: 0,
        lines: vec![(0, 10), (5, 11), (12, 14)],
    };
    assert_eq!(name.line(0), 10);
    assert_eq!(name.line(7), 11);
    assert_eq!(name.line(12), 14);
    assert_eq!(name.line(400), 14);
    assert_eq!(name.line(-1), 10);
}

/// The forged method, its `ConstMethod`, its constant pool and its class.
const METHOD: u64 = 0x80_0000;
const CONST: u64 = 0x81_0000;
const POOL: u64 = 0x82_0000;
const KLASS: u64 = 0x83_0000;
/// The symbols: the method's name, its file's and its class's.
const NAME: u64 = 0x84_0000;
const FILE: u64 = 0x84_1000;
const CLASS: u64 = 0x84_2000;
/// The pool's slots: its length, and where the name and file are.
const POOL_LENGTH: u32 = 8;
const NAME_INDEX: u16 = 3;
const FILE_INDEX: u16 = 5;
/// Bytes of the method's bytecodes.
const CODE_SIZE: u16 = 20;
/// Its line table: (bci 0, line 10) in the long form (`0xff`, then zigzag-coded
/// deltas 0 and 10), then (5, 11) and (12, 14) in the short form (`bci << 3 | line`),
/// then the end.
const LINE_TABLE: [u8; 6] = [0xff, 0, 20, 5 << 3 | 1, 7 << 3 | 3, 0];

/// Maps the symbol `text` at `address`, saying it is `length` bytes long.
fn symbol(memory: &mut FakeMemory, layout: &Layout, address: u64, text: &[u8], length: u16) {
    let mut bytes = vec![0u8; layout.symbol_body as usize];
    bytes[layout.symbol_length as usize..][..2].copy_from_slice(&length.to_le_bytes());
    bytes.extend_from_slice(text);
    memory.map(address, bytes);
}

/// Forges `com.example.Orders.place` in `Orders.java` (JDK 17's layout): a method
/// with a line number table, its constant pool and class.
fn forged_method() -> (FakeMemory, Layout) {
    let layout = forged::layout_17();
    let mut memory = FakeMemory::new();
    memory
        .map(METHOD, vec![0u8; 64])
        .write_u64(METHOD + layout.method_const, CONST);
    // A page: the line table is read page by page.
    let code = CONST + layout.const_method_size;
    memory
        .map(CONST, vec![0u8; 4096])
        .write_u64(CONST + layout.const_constants, POOL)
        .write(CONST + layout.const_flags.0, &1u16.to_le_bytes())
        .write(CONST + layout.const_code_size, &CODE_SIZE.to_le_bytes())
        .write(CONST + layout.const_name_index, &NAME_INDEX.to_le_bytes())
        .write(code + u64::from(CODE_SIZE), &LINE_TABLE);
    let slot = |index: u16| POOL + layout.pool_size + u64::from(index) * 8;
    memory
        .map(POOL, vec![0u8; (layout.pool_size + 8 * 8) as usize])
        .write_u64(POOL + layout.pool_holder, KLASS)
        .write(POOL + layout.pool_source_file, &FILE_INDEX.to_le_bytes())
        .write_u32(POOL + layout.pool_length, POOL_LENGTH)
        .write_u64(slot(NAME_INDEX), NAME)
        .write_u64(slot(FILE_INDEX), FILE);
    memory
        .map(KLASS, vec![0u8; 32])
        .write_u64(KLASS + layout.klass_name, CLASS);
    symbol(&mut memory, &layout, NAME, b"place", 5);
    symbol(&mut memory, &layout, FILE, b"Orders.java", 11);
    symbol(&mut memory, &layout, CLASS, b"com/example/Orders", 18);
    (memory, layout)
}

/// The forged method once `forge` rewrote it, named afresh.
fn method_after(forge: impl FnOnce(&mut FakeMemory, &Layout)) -> Option<MethodName> {
    let (mut memory, layout) = forged_method();
    forge(&mut memory, &layout);
    Names::default().method(&memory, &layout, METHOD).cloned()
}

#[test]
fn a_forged_method_is_named_with_its_class_file_and_lines() {
    let (memory, layout) = forged_method();
    let mut names = Names::default();
    let name = names.method(&memory, &layout, METHOD).cloned();
    let code_base = CONST + layout.const_method_size;
    let expected = MethodName {
        function: "com.example.Orders.place".to_string(),
        file: "Orders.java".to_string(),
        code_base,
        code_size: u64::from(CODE_SIZE),
        lines: vec![(0, 10), (5, 11), (12, 14)],
    };
    assert_eq!(name.as_ref(), Some(&expected));
    assert_eq!(expected.bci_of(code_base + 7), 7);
    assert_eq!(expected.line(7), 11);
    assert_eq!(
        expected.bci_of(code_base + u64::from(CODE_SIZE)),
        -1,
        "past its bytecodes"
    );
    assert_eq!(
        names.class(&memory, &layout, KLASS),
        Some("com.example.Orders")
    );
    // Each cache counts what its entry holds: its strings' and its table's bytes.
    let method_bytes = size_of::<Option<MethodName>>() + 24 + 11 + 3 * 8 + ENTRY_OVERHEAD;
    assert_eq!(names.methods.figures().bytes, method_bytes);
    let class_bytes = size_of::<Option<String>>() + 18 + ENTRY_OVERHEAD;
    assert_eq!(names.classes.figures().bytes, class_bytes);
    names.clear();
    assert_eq!((names.methods.len(), names.classes.len()), (0, 0));
}

#[test]
fn a_symbol_longer_than_believed_is_cut_or_refused() {
    let (mut memory, layout) = forged_method();
    let long = vec![b'a'; MAX_SYMBOL + 88];
    symbol(&mut memory, &layout, CLASS, &long, u16::MAX);
    let mut names = Names::default();
    let cut = "a".repeat(MAX_SYMBOL);
    assert_eq!(names.class(&memory, &layout, KLASS), Some(cut.as_str()));
    // A length past what is mapped: nothing is read.
    symbol(&mut memory, &layout, CLASS, &long[..100], u16::MAX);
    assert_eq!(Names::default().class(&memory, &layout, KLASS), None);
}

#[test]
fn constant_pool_indices_past_its_length_are_refused() {
    for index in [POOL_LENGTH as u16, u16::MAX, 0] {
        let name = method_after(|memory, layout| {
            memory.write(CONST + layout.const_name_index, &index.to_le_bytes());
        });
        assert_eq!(name, None, "name index {index} of {POOL_LENGTH}");
    }
    let negative_length = method_after(|memory, layout| {
        memory.write_u32(POOL + layout.pool_length, u32::MAX);
    });
    assert_eq!(negative_length, None);
    let file_past_pool = method_after(|memory, layout| {
        memory.write(POOL + layout.pool_source_file, &200u16.to_le_bytes());
    });
    let named = file_past_pool.expect("named without its file");
    assert_eq!(
        (named.function.as_str(), named.file.as_str()),
        ("com.example.Orders.place", "")
    );
}

#[test]
fn unmapped_null_or_unprintable_symbols_name_nothing() {
    let slot = |layout: &Layout| POOL + layout.pool_size + u64::from(NAME_INDEX) * 8;
    for pointer in [0xdead_0000, 0] {
        let name = method_after(|memory, layout| {
            memory.write_u64(slot(layout), pointer);
        });
        assert_eq!(name, None, "name symbol at {pointer:#x}");
    }
    let unprintable = method_after(|memory, layout| {
        symbol(memory, layout, NAME, b"pl\x07ce", 5);
    });
    assert_eq!(unprintable, None);
    let (mut memory, layout) = forged_method();
    let mut names = Names::default();
    assert_eq!(
        names.method(&memory, &layout, 0xdead_0000),
        None,
        "no method there"
    );
    assert_eq!(
        names.class(&memory, &layout, 0xdead_0000),
        None,
        "no class there"
    );
    memory.write_u64(KLASS + layout.klass_name, 0xdead_0000);
    assert_eq!(Names::default().class(&memory, &layout, KLASS), None);
    assert_eq!(
        names.methods.figures().entries,
        1,
        "what is not a method is remembered too"
    );
}

#[test]
fn a_line_table_without_its_end_or_its_flag_gives_no_lines() {
    let unended = method_after(|memory, layout| {
        let table = CONST + layout.const_method_size + u64::from(CODE_SIZE);
        let rest = 4096 - (table - CONST) as usize;
        memory.write(table, &vec![1 << 3; rest]);
    });
    let unended = unended.expect("named without its lines");
    assert_eq!((unended.lines.as_slice(), unended.line(5)), (&[][..], 0));
    let unflagged = method_after(|memory, layout| {
        memory.write(CONST + layout.const_flags.0, &[0, 0]);
    });
    assert_eq!(unflagged.map(|name| name.lines), Some(vec![]));
}
