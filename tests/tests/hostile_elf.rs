//! A process that maps a hostile ELF file executable must not stall the profiler.
//!
//! The file is valid as far as its headers go: an ELF64 header, one `PT_LOAD` R+X
//! program header and 60,000 section headers, every one a `SHT_PROGBITS` section at
//! offset 0 as long as the file, which is a sparse 256 MiB. Reading it section by
//! section, as allocbpf did, reads 60,000 x 256 MiB (of zeros the kernel makes up):
//! a 3 s system-wide run had not finished after 90 s. It is refused unread now
//! (`elf_ranges.rs`: more section headers than a linked file has), counted and logged
//! once, and the process is profiled through its other files (its C library).

use std::{
    fs::File,
    io::Write,
    path::Path,
    time::{Duration, Instant},
};

use allocbpf_e2e::{
    compile_workload, one_profiler_at_a_time, require_root, run_allocbpf, scratch_dir, stacks_with,
    Workload,
};
use serde_json::Value;

/// Section headers in the hostile file (`e_shnum` is 16 bits: 60,000 needs no extended
/// numbering, and `e_shstrndx`, 59,999, stays below the reserved indices from 0xff00).
const SECTIONS: u64 = 60_000;
/// The hostile file's size: sparse, so it costs no disk.
const FILE_BYTES: u64 = 256 << 20;
/// The whole run (3 s of profiling, start-up and the report) must end within this.
const MAX_RUN: Duration = Duration::from_secs(20);

/// Writes the hostile file at `path`: ELF header, one `PT_LOAD` R+X program header at
/// 64, the section table at 4 KiB (section 0 `SHT_NULL`, 1..59,998 `.text`
/// `SHT_PROGBITS` R+X at offset 0 covering the whole file, the last `.shstrtab`), the
/// names after it, and the rest a hole up to [`FILE_BYTES`].
fn write_hostile_elf(path: &Path) {
    let table: u64 = 0x1000;
    let names_at = table + SECTIONS * 64;
    let names = b"\0.text\0.shstrtab\0";
    let mut head = vec![0u8; names_at as usize + names.len()];
    let put = |bytes: &mut [u8], at: usize, value: &[u8]| {
        bytes[at..at + value.len()].copy_from_slice(value)
    };
    put(&mut head, 0, b"\x7fELF\x02\x01\x01"); // ELFCLASS64, little-endian, EV_CURRENT
    put(&mut head, 0x10, &3u16.to_le_bytes()); // ET_DYN
    put(&mut head, 0x12, &62u16.to_le_bytes()); // EM_X86_64
    put(&mut head, 0x14, &1u32.to_le_bytes()); // e_version
    put(&mut head, 0x20, &64u64.to_le_bytes()); // e_phoff
    put(&mut head, 0x28, &table.to_le_bytes()); // e_shoff
    put(&mut head, 0x34, &64u16.to_le_bytes()); // e_ehsize
    put(&mut head, 0x36, &56u16.to_le_bytes()); // e_phentsize
    put(&mut head, 0x38, &1u16.to_le_bytes()); // e_phnum
    put(&mut head, 0x3a, &64u16.to_le_bytes()); // e_shentsize
    put(&mut head, 0x3c, &(SECTIONS as u16).to_le_bytes()); // e_shnum
    put(&mut head, 0x3e, &(SECTIONS as u16 - 1).to_le_bytes()); // e_shstrndx
                                                                // PT_LOAD, PF_R | PF_X, the whole file at vaddr 0.
    put(&mut head, 64, &1u32.to_le_bytes());
    put(&mut head, 64 + 4, &5u32.to_le_bytes());
    put(&mut head, 64 + 0x20, &FILE_BYTES.to_le_bytes()); // p_filesz
    put(&mut head, 64 + 0x28, &FILE_BYTES.to_le_bytes()); // p_memsz
    put(&mut head, 64 + 0x30, &0x1000u64.to_le_bytes()); // p_align
    for i in 1..SECTIONS {
        let at = (table + i * 64) as usize;
        if i == SECTIONS - 1 {
            put(&mut head, at, &7u32.to_le_bytes()); // ".shstrtab"
            put(&mut head, at + 4, &3u32.to_le_bytes()); // SHT_STRTAB
            put(&mut head, at + 0x18, &names_at.to_le_bytes());
            put(&mut head, at + 0x20, &(names.len() as u64).to_le_bytes());
            put(&mut head, at + 0x30, &1u64.to_le_bytes()); // sh_addralign
        } else {
            put(&mut head, at, &1u32.to_le_bytes()); // ".text"
            put(&mut head, at + 4, &1u32.to_le_bytes()); // SHT_PROGBITS
            put(&mut head, at + 8, &6u64.to_le_bytes()); // SHF_ALLOC | SHF_EXECINSTR
            put(&mut head, at + 0x18, &0u64.to_le_bytes()); // sh_offset
            put(&mut head, at + 0x20, &FILE_BYTES.to_le_bytes()); // sh_size
            put(&mut head, at + 0x30, &16u64.to_le_bytes()); // sh_addralign
        }
    }
    put(&mut head, names_at as usize, names);
    let mut file = File::create(path).unwrap();
    file.write_all(&head).unwrap();
    // A hole to the end: 256 MiB that takes no disk and reads as zeros.
    file.set_len(FILE_BYTES).unwrap();
}

/// The stacks of process `pid` in the JSON profile `json`.
fn stacks_of(json: &Value, pid: u32) -> Vec<&Value> {
    json["stacks"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .filter(|s| s["pid"].as_u64() == Some(u64::from(pid)))
        .collect()
}

/// A process maps the hostile file PROT_READ|PROT_EXEC and allocates: a 3 s system-wide
/// run ends within [`MAX_RUN`] with exit 0, the file is refused (logged once), and the
/// process is still sampled, at its allocation site (its executable and libc unwound
/// and symbolized).
#[test]
fn a_mapped_elf_with_60000_whole_file_sections_does_not_stall_the_profiler() {
    require_root();
    let _one = one_profiler_at_a_time();
    let dir = scratch_dir("hostile-elf");
    let hostile = dir.join("hostile.so");
    write_hostile_elf(&hostile);
    let binary = compile_workload("execmap", &["-O1"]).unwrap();
    let mut workload = Workload::start(&binary, &[hostile.to_str().unwrap(), "60"]).unwrap();
    workload
        .stdout
        .wait_for("mapped", Duration::from_secs(10))
        .unwrap();
    let out = dir.join("profile.json");
    let args = [
        "--comm",
        "^execmap",
        // Probed full time: every sample of the 3 s counts.
        "--budget",
        "100%",
        "--duration",
        "3s",
        "--format",
        "json",
        "--output",
        out.to_str().unwrap(),
        "-v",
    ];
    let started = Instant::now();
    // Killed (and failed) past MAX_RUN.
    let finished = run_allocbpf(&args, MAX_RUN);
    let elapsed = started.elapsed();
    let _ = workload.child.kill();
    let finished = finished.unwrap();
    assert_eq!(finished.code, Some(0), "{}", finished.stderr);
    assert!(elapsed < MAX_RUN, "took {elapsed:?}");
    // Refused for its section count, and said once (the file is one file).
    let refusals = finished
        .stderr
        .lines()
        .filter(|l| l.contains(&format!("{SECTIONS} section headers")))
        .count();
    assert_eq!(refusals, 1, "{}", finished.stderr);
    let json: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    let stacks = stacks_of(&json, workload.pid);
    let samples: u64 = stacks.iter().filter_map(|s| s["samples"].as_u64()).sum();
    assert!(
        samples > 0,
        "pid {} has no sample: totals {:#}",
        workload.pid,
        json["totals"]
    );
    let at_site = stacks_with(&json, "execmap_alloc_site")
        .into_iter()
        .filter(|s| s["pid"].as_u64() == Some(u64::from(workload.pid)))
        .count();
    assert!(
        at_site > 0,
        "no stack of pid {} through execmap_alloc_site: {:#}",
        workload.pid,
        Value::from(stacks.into_iter().take(5).cloned().collect::<Vec<_>>())
    );
    let _ = std::fs::remove_file(&hostile);
}
