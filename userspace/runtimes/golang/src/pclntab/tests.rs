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
