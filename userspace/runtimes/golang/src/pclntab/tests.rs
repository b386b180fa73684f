//! Against real Go binaries: the workload `tests/workloads/go_allocs` built here with
//! the machine's Go (skipped where there is none), with and without a symbol table.

use std::{path::PathBuf, process::Command};

use object::{Object, ObjectSymbol};

use super::*;

/// Builds the workload into the test's scratch directory: (with symbols, stripped).
pub(crate) fn go_binaries() -> Option<(PathBuf, PathBuf)> {
    let workload =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../tests/workloads/go_allocs");
    let out = std::env::temp_dir().join("allocbpf-go-unit");
    std::fs::create_dir_all(&out).ok()?;
    let build = |name: &str, flags: &[&str]| {
        let path = out.join(name);
        let status = Command::new("go")
            .arg("build")
            .args(flags)
            .arg("-o")
            .arg(&path)
            .arg(".")
            .current_dir(&workload)
            .env("GOTOOLCHAIN", "local")
            .env("GOFLAGS", "-mod=mod")
            .status()
            .ok()?;
        status.success().then_some(path)
    };
    let Some(full) = build("full", &[]) else {
        println!("no go toolchain: nothing to check");
        return None;
    };
    Some((full, build("stripped", &["-ldflags=-s -w"])?))
}

#[test]
fn functions_files_and_lines_with_and_without_symbols() {
    let Some((full, stripped)) = go_binaries() else {
        return;
    };
    let full_data = std::fs::read(&full).unwrap();
    let full_file = object::File::parse(&*full_data).unwrap();
    let stripped_data = std::fs::read(&stripped).unwrap();
    let stripped_file = object::File::parse(&*stripped_data).unwrap();
    let symbol = |name: &str| {
        full_file
            .symbols()
            .find(|s| s.name() == Ok(name))
            .map(|s| s.address())
    };
    for file in [&full_file, &stripped_file] {
        let table = Pclntab::parse(file).unwrap();
        assert!(table.len() > 1000, "{} functions", table.len());
        for name in [
            "main.allocSmall",
            "runtime.mallocgc",
            "runtime.mProf_FlushLocked",
        ] {
            let func = table.find(name).unwrap_or_else(|| panic!("{name}"));
            assert_eq!(Some(func.entry), symbol(name), "{name}");
            assert_eq!(table.func_at(func.entry + 1), Some(func));
        }
        let small = table.find("main.allocSmall").unwrap();
        let location = table.location(&small, small.entry).unwrap();
        assert_eq!(location.function, "main.allocSmall");
        assert!(location
            .file
            .as_deref()
            .unwrap()
            .ends_with("go_allocs/main.go"));
        let source = std::fs::read_to_string(location.file.as_deref().unwrap()).unwrap();
        let line = source
            .lines()
            .position(|l| l.starts_with("func allocSmall"));
        assert_eq!(location.line, line.map(|l| l as u32 + 1), "{location:?}");
    }
}

/// The profiling variables are found the same with and without symbols, where the
/// symbol table says they are.
#[test]
fn profiling_variables_with_and_without_symbols() {
    let Some((full, stripped)) = go_binaries() else {
        return;
    };
    let full_data = std::fs::read(&full).unwrap();
    let full_file = object::File::parse(&*full_data).unwrap();
    let symbol = |name: &str| {
        full_file
            .symbols()
            .find(|s| s.name() == Ok(name))
            .map(|s| s.address())
    };
    let stripped_data = std::fs::read(&stripped).unwrap();
    let stripped_file = object::File::parse(&*stripped_data).unwrap();
    for file in [&full_file, &stripped_file] {
        let table = Pclntab::parse(file).unwrap();
        let found = crate::runtime::locate(file, &table).unwrap();
        assert_eq!(Some(found.mbuckets), symbol("runtime.mbuckets"));
        assert_eq!(Some(found.rate), symbol("runtime.MemProfileRate"));
        assert_eq!(found.cycle, symbol("runtime.mProfCycle"));
        let version = crate::buildinfo::version(file).unwrap();
        assert!(version.minor.is_some_and(|m| m >= 19), "{version:?}");
    }
}

/// The workload built with symbols, as bytes, and where its `.gopclntab` starts in them:
/// the real table, for tests that forge parts of it.
fn table_bytes() -> Option<(Vec<u8>, usize)> {
    let (full, _) = go_binaries()?;
    let data = std::fs::read(full).ok()?;
    let file = object::File::parse(&*data).ok()?;
    let section = (GO_PCLNTAB_SECTIONS.iter()).find_map(|name| file.section_by_name(name))?;
    let (offset, _) = section.file_range()?;
    Some((data, offset as usize))
}

/// `data` with `bytes` written at `offset` of its table (at `table`).
fn forged(data: &[u8], table: usize, offset: usize, bytes: &[u8]) -> Vec<u8> {
    let mut data = data.to_vec();
    data[table + offset..table + offset + bytes.len()].copy_from_slice(bytes);
    data
}

fn parse(data: &[u8]) -> Result<Pclntab, PclntabError> {
    Pclntab::parse(&object::File::parse(data).unwrap())
}

/// A header word's offset in the table (`nfunc` is word 0, the function table's
/// offset word 7).
fn word_at(index: usize) -> usize {
    8 + 8 * index
}

#[test]
fn forged_table_headers_are_refused() {
    let Some((data, table)) = table_bytes() else {
        return;
    };
    assert!(parse(&data).is_ok(), "the real table reads");
    let refused = |offset: usize, bytes: &[u8]| parse(&forged(&data, table, offset, bytes)).err();
    assert_eq!(
        refused(0, &0xdead_beef_u32.to_le_bytes()),
        Some(PclntabError::UnknownFormat(0xdead_beef))
    );
    assert_eq!(
        refused(6, &[4]),
        Some(PclntabError::Malformed(
            "not amd64 (pc quantum 1, 8-byte pointers)"
        ))
    );
    // A count of functions whose table cannot fit, or whose size wraps.
    for nfunc in [u64::MAX, u64::MAX / 8, 1 << 40, data.len() as u64] {
        assert_eq!(
            refused(word_at(0), &nfunc.to_le_bytes()),
            Some(PclntabError::Malformed("function table")),
            "nfunc {nfunc}"
        );
    }
    // Any sub-table said to start past the table's end.
    for index in 3..=7 {
        for offset in [u64::MAX, 1 << 40, (1 << 32) + 1] {
            assert_eq!(
                refused(word_at(index), &offset.to_le_bytes()),
                Some(PclntabError::Malformed("header offsets")),
                "word {index} = {offset:#x}"
            );
        }
    }
}

#[test]
fn forged_functions_and_text_start_are_read_without_being_believed() {
    let Some((data, table)) = table_bytes() else {
        return;
    };
    let real = parse(&data).unwrap();
    let small = real.find("main.allocSmall").unwrap();
    // A text start near the top of the address space: every entry wraps, nothing
    // panics, and no real address finds a function.
    let top = parse(&forged(
        &data,
        table,
        word_at(2),
        &(u64::MAX - 16).to_le_bytes(),
    ))
    .unwrap();
    for func in top.functions() {
        let _ = (
            top.name(&func),
            top.size(&func),
            top.location(&func, func.entry),
        );
    }
    assert_eq!(top.func_at(small.entry), None);
    // Every function record said to lie past the table: functions are found by
    // address, but have no name and no location.
    let funcdata = u64::from_le_bytes(data[table + word_at(7)..][..8].try_into().unwrap());
    let mut records = data.clone();
    for index in 0..real.len() {
        let at = table + funcdata as usize + 8 * index + 4;
        records[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    }
    let lost = parse(&records).unwrap();
    let found = lost.func_at(small.entry).expect("found by its address");
    assert_eq!(found.entry, small.entry);
    assert_eq!(lost.name(&found), None);
    assert_eq!(lost.location(&found, small.entry), None);
    assert_eq!(lost.find("main.allocSmall"), None);
    // Function names said to start past the names' table read as nothing.
    let names = parse(&forged(
        &data,
        table,
        word_at(3),
        &(funcdata - 1).to_le_bytes(),
    ))
    .unwrap();
    let _ = names.name(&small);
}
