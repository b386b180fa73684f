use std::{
    io::Write,
    path::{Path, PathBuf},
    process::Command,
};

use object::{Object, ObjectSection};

use super::*;
use super::{build_id::gnu_build_id, headers::name_at};

/// A scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sealed-copy-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run(command: &mut Command) {
    let status = command.status().expect("binutils and gcc are installed");
    assert!(status.success(), "{command:?}");
}

/// A C program built with `flags` in `dir`.
fn program(dir: &Path, flags: &[&str]) -> PathBuf {
    let source = dir.join("prog.c");
    std::fs::write(
        &source,
        "#include <stdlib.h>\n\
         __attribute__((noinline)) void *sealed_copy_site(int n) { return malloc(n); }\n\
         int main(int argc, char **argv) { free(sealed_copy_site(argc)); return 0; }\n",
    )
    .unwrap();
    let binary = dir.join("prog");
    run(Command::new("gcc")
        .args(flags)
        .arg("-o")
        .arg(&binary)
        .arg(&source));
    binary
}

/// The sealed copy's bytes.
fn copied(path: &Path) -> (SealedCopy, Vec<u8>) {
    let copy = sealed_copy(&File::open(path).unwrap()).unwrap();
    let mut bytes = Vec::new();
    File::open(copy.path())
        .unwrap()
        .read_to_end(&mut bytes)
        .unwrap();
    (copy, bytes)
}

fn section<'a>(elf: &'a object::File<'a>, name: &str) -> Option<&'a [u8]> {
    elf.section_by_name(name).map(|s| s.data().unwrap())
}

#[test]
fn sealed_copy_neutralizes_debug_links_and_keeps_symbols() {
    let dir = scratch("debuglink");
    let binary = program(&dir, &["-g", "-O1"]);
    let debug = dir.join("prog.debug");
    run(Command::new("objcopy")
        .arg("--only-keep-debug")
        .arg(&binary)
        .arg(&debug));
    run(Command::new("strip").arg("-g").arg(&binary));
    run(Command::new("objcopy")
        .arg(format!("--add-gnu-debuglink={}", debug.display()))
        .arg(&binary)
        .current_dir(&dir));
    let original = std::fs::read(&binary).unwrap();
    let (copy, bytes) = copied(&binary);
    assert_eq!(bytes.len(), original.len());
    let source = object::File::parse(&*original).unwrap();
    let elf = object::File::parse(&*bytes).unwrap();
    assert!(section(&source, ".gnu_debuglink").is_some());
    assert!(
        section(&elf, ".gnu_debuglink").is_none(),
        "the link is left"
    );
    assert!(section(&elf, "Xgnu_debuglink").is_some());
    for name in [
        ".symtab",
        ".strtab",
        ".dynsym",
        ".dynstr",
        ".note.gnu.build-id",
    ] {
        assert_eq!(section(&elf, name), section(&source, name), "{name}");
    }
    // Code is not copied: zeros, no memory.
    assert!(section(&elf, ".text").unwrap().iter().all(|&b| b == 0));
    assert!(copy.bytes() < original.len() as u64);
    assert_eq!(
        read_build_id(copy.file()),
        read_build_id(&File::open(&binary).unwrap())
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// File offsets translate to virtual addresses as the file's segments say.
#[test]
fn sealed_copy_translates_file_offsets() {
    use object::ObjectSegment;
    let exe = std::fs::read_link("/proc/self/exe").unwrap();
    let data = std::fs::read(&exe).unwrap();
    let elf = object::File::parse(&*data).unwrap();
    let copy = sealed_copy(&File::open(&exe).unwrap()).unwrap();
    for segment in elf.segments() {
        let (start, len) = segment.file_range();
        if len > 0 {
            assert_eq!(
                copy.virtual_offset(start + len - 1),
                Some(segment.address() + len - 1)
            );
        }
    }
    assert_eq!(copy.virtual_offset(u64::MAX), None);
}

/// The C library's detached debug file is found by its build id if installed
/// (libc6-dbg), and nothing is found for an id no file has.
#[test]
fn debug_files_are_found_by_build_id_in_roots_directory() {
    let libc = File::open("/usr/lib/x86_64-linux-gnu/libc.so.6").unwrap();
    let id = read_build_id(&libc).unwrap();
    if let Some(debug) = open_debug_file(&id) {
        assert_eq!(read_build_id(&debug), Some(id));
        assert!(sealed_copy(&debug).unwrap().has_debug_info());
    }
    assert!(open_debug_file(&[0x5a; 20]).is_none());
    assert!(open_debug_file(&[0x5a; 4]).is_none());
}

#[test]
fn sealed_copy_keeps_dwarf_and_inflates_zlib_sections() {
    let dir = scratch("dwarf");
    for flags in [&["-g", "-O1"][..], &["-g", "-O1", "-gz=zlib"][..]] {
        let binary = program(&dir, flags);
        let original = std::fs::read(&binary).unwrap();
        let source = object::File::parse(&*original).unwrap();
        let (copy, bytes) = copied(&binary);
        assert!(copy.has_debug_info());
        let elf = object::File::parse(&*bytes).unwrap();
        for name in [".debug_info", ".debug_line", ".debug_abbrev", ".debug_str"] {
            let theirs = source
                .section_by_name(name)
                .unwrap()
                .compressed_data()
                .unwrap();
            let theirs = match theirs.format {
                object::CompressionFormat::None => theirs.data.to_vec(),
                object::CompressionFormat::Zlib => {
                    let mut inflated = Vec::new();
                    flate2::read::ZlibDecoder::new(theirs.data)
                        .read_to_end(&mut inflated)
                        .unwrap();
                    inflated
                }
                other => panic!("{other:?}"),
            };
            let ours = elf.section_by_name(name).unwrap();
            // Ours is stored inflated.
            assert_eq!(ours.data().unwrap(), &*theirs, "{name} {flags:?}");
            assert_eq!(
                ours.compressed_file_range().unwrap().format,
                object::CompressionFormat::None
            );
        }
        if flags.contains(&"-gz=zlib") {
            let info = source.section_by_name(".debug_info").unwrap();
            let format = info.compressed_file_range().unwrap().format;
            assert_eq!(format, object::CompressionFormat::Zlib, "not compressed");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn sealed_copy_is_sealed() {
    let exe = std::fs::read_link("/proc/self/exe").unwrap();
    let copy = sealed_copy(&File::open(&exe).unwrap()).unwrap();
    // SAFETY: fcntl on a descriptor we own.
    let seals = unsafe { libc::fcntl(copy.file().as_raw_fd(), libc::F_GET_SEALS) };
    let all = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE | libc::F_SEAL_SEAL;
    assert_eq!(seals & all, all);
    let writable = std::fs::OpenOptions::new()
        .write(true)
        .open(copy.path())
        .unwrap();
    assert!(writable.write_all_at(b"x", 0).is_err());
    assert!(writable.set_len(1).is_err());
    assert!(writable.set_len(1 << 40).is_err());
}

#[test]
fn sealed_copy_fails_when_the_file_shrinks_before_or_while_it_is_read() {
    let dir = scratch("shrink");
    let binary = program(&dir, &["-g"]);
    let victim = dir.join("victim");
    std::fs::copy(&binary, &victim).unwrap();
    let file = File::options()
        .read(true)
        .write(true)
        .open(&victim)
        .unwrap();
    let plan = CopyPlan::new(&file).unwrap();
    let size = file.metadata().unwrap().len();
    file.set_len(size / 2).unwrap();
    assert!(matches!(
        plan.copy(&file),
        Err(CopyError::Changed | CopyError::Read(_))
    ));
    // Reading past the end of a shrunk file is an error, not a signal.
    let mut buffer = vec![0u8; 4096];
    assert!(copy_range(&file, &memfd().unwrap(), size - 4096..size, &mut buffer).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A minimal ELF header (`ET_DYN`) with `shnum` sections at `shoff` and no
/// program headers.
fn elf_header_bytes(shoff: u64, shnum: u16, shstrndx: u16) -> Vec<u8> {
    let mut elf = vec![0u8; 64];
    elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
    elf[0x10] = ET_DYN as u8;
    elf[0x28..0x30].copy_from_slice(&shoff.to_le_bytes());
    elf[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
    elf[0x3c..0x3e].copy_from_slice(&shnum.to_le_bytes());
    elf[0x3e..0x40].copy_from_slice(&shstrndx.to_le_bytes());
    elf
}

fn section_header(name: u32, kind: u32, flags: u64, offset: u64, size: u64) -> Vec<u8> {
    let mut header = vec![0u8; 64];
    header[0..4].copy_from_slice(&name.to_le_bytes());
    header[4..8].copy_from_slice(&kind.to_le_bytes());
    header[8..16].copy_from_slice(&flags.to_le_bytes());
    header[0x18..0x20].copy_from_slice(&offset.to_le_bytes());
    header[0x20..0x28].copy_from_slice(&size.to_le_bytes());
    header
}

fn file_of(bytes: &[u8]) -> File {
    let file = memfd().unwrap();
    (&file).write_all(bytes).unwrap();
    file
}

/// A crafted file: names at 64, `sections` after them.
fn crafted(names: &[u8], sections: &[Vec<u8>], tail: &[u8]) -> Vec<u8> {
    let shoff = 64 + names.len() as u64;
    let mut all = vec![section_header(0, 0, 0, 0, 0)];
    all.push(section_header(1, 3, 0, 64, names.len() as u64));
    all.extend_from_slice(sections);
    let mut bytes = elf_header_bytes(shoff, all.len() as u16, 1);
    bytes.extend_from_slice(names);
    for header in all {
        bytes.extend_from_slice(&header);
    }
    bytes.extend_from_slice(tail);
    bytes
}

#[test]
fn sealed_copy_refuses_headers_past_the_end_and_hides_compressed_sections() {
    // Section headers past the end of the file.
    let past = elf_header_bytes(1 << 40, 3, 1);
    assert!(matches!(
        sealed_copy(&file_of(&past)),
        Err(CopyError::Refused(_))
    ));
    let names = b"\0.shstrtab\0.symtab\0.debug_info\0.gnu_debugaltlink\0";
    let symtab = 11;
    let debug_info = 19;
    let altlink = 31;
    // A symbol table past the end of the file: refused.
    let bytes = crafted(names, &[section_header(symtab, 2, 0, 1 << 30, 24)], &[]);
    assert!(matches!(
        sealed_copy(&file_of(&bytes)),
        Err(CopyError::Refused(_))
    ));
    // A zlib debug section claiming 2^60 bytes, a zstd one, and an altlink: all
    // hidden, nothing allocated.
    let tail_at = 64 + names.len() as u64 + 5 * 64;
    let chdr = |kind: u32, size: u64| {
        let mut chdr = vec![0u8; 24];
        chdr[0..4].copy_from_slice(&kind.to_le_bytes());
        chdr[8..16].copy_from_slice(&size.to_le_bytes());
        chdr
    };
    let bytes = crafted(
        names,
        &[
            section_header(debug_info, 1, SHF_COMPRESSED, tail_at, 24),
            section_header(altlink, 1, 0, tail_at, 24),
            section_header(debug_info, 1, SHF_COMPRESSED, tail_at + 24, 24),
        ],
        &[chdr(1, 1 << 60), chdr(2, 100)].concat(),
    );
    let (copy, out) = {
        let copy = sealed_copy(&file_of(&bytes)).unwrap();
        let mut out = Vec::new();
        File::open(copy.path())
            .unwrap()
            .read_to_end(&mut out)
            .unwrap();
        (copy, out)
    };
    assert!(!copy.has_debug_info());
    let shoff = 64 + names.len();
    for i in 2..5 {
        let header = &out[shoff + i * 64..][..64];
        assert_eq!(u64_at(header, 8) & SHF_COMPRESSED, 0, "section {i}");
    }
    let out_names = &out[64..64 + names.len()];
    assert_eq!(name_at(out_names, u64::from(debug_info)), b"Xdebug_info");
    assert_eq!(name_at(out_names, u64::from(altlink)), b"Xgnu_debugaltlink");
}

/// Arbitrary damage to a real binary's headers: refused or copied, never a panic.
#[test]
fn sealed_copy_survives_damaged_headers() {
    let exe = std::fs::read_link("/proc/self/exe").unwrap();
    let original = std::fs::read(&exe).unwrap();
    let shoff = u64_at(&original, 0x28) as usize;
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for round in 0..200 {
        let mut bytes = original[..original.len().min(shoff + 64 * 64)].to_vec();
        if round % 2 == 0 {
            bytes = original.clone();
        }
        for _ in 0..1 + next() % 8 {
            let at = match next() % 3 {
                0 => (next() % 64) as usize,
                _ => shoff + (next() % (64 * 40)) as usize,
            };
            if at < bytes.len() {
                bytes[at] = next() as u8;
            }
        }
        let file = file_of(&bytes);
        let _ = sealed_copy(&file);
        let _ = read_build_id(&file);
    }
}

#[test]
fn build_ids_are_read_from_crafted_notes_and_real_files() {
    let note = |name: &[u8], kind: u32, desc: &[u8]| {
        let mut note = Vec::new();
        note.extend_from_slice(&(name.len() as u32).to_le_bytes());
        note.extend_from_slice(&(desc.len() as u32).to_le_bytes());
        note.extend_from_slice(&kind.to_le_bytes());
        note.extend_from_slice(name);
        note.resize(note.len().next_multiple_of(4), 0);
        note.extend_from_slice(desc);
        note.resize(note.len().next_multiple_of(4), 0);
        note
    };
    let id = [0xabu8, 0xcd, 0xef, 0x01, 0x23, 0x45, 0x67, 0x89, 0x10];
    // Another vendor's note of type 3 first, then a GNU property, then the id.
    let mut notes = note(b"Go\0\0", 3, b"not a gnu id");
    notes.extend(note(b"GNU\0", 5, &[0; 16]));
    notes.extend(note(b"GNU\0", 3, &id));
    assert_eq!(gnu_build_id(&notes, 4).as_deref(), Some(&id[..]));
    // A descriptor running past the notes, or a huge one: none.
    let mut bad = note(b"GNU\0", 3, &id);
    bad[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(gnu_build_id(&bad, 4), None);
    assert_eq!(gnu_build_id(&note(b"GNU\0", 3, &[7; 100]), 4), None);

    // In a PT_NOTE segment of a crafted file.
    let mut elf = elf_header_bytes(0, 0, 0);
    elf[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
    elf[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
    elf[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
    let mut phdr = vec![0u8; 56];
    phdr[0..4].copy_from_slice(&(PT_NOTE as u32).to_le_bytes());
    phdr[8..16].copy_from_slice(&120u64.to_le_bytes());
    phdr[32..40].copy_from_slice(&(notes.len() as u64).to_le_bytes());
    phdr[48..56].copy_from_slice(&4u64.to_le_bytes());
    elf.extend(phdr);
    elf.extend(&notes);
    assert_eq!(read_build_id(&file_of(&elf)).as_deref(), Some(&id[..]));
    // Its segment past the end of the file: none.
    elf.truncate(130);
    assert_eq!(read_build_id(&file_of(&elf)), None);

    // Our own executable, as object reads it.
    let exe = std::fs::read_link("/proc/self/exe").unwrap();
    let data = std::fs::read(&exe).unwrap();
    let expected = object::File::parse(&*data)
        .unwrap()
        .build_id()
        .unwrap()
        .map(<[u8]>::to_vec);
    assert!(expected.is_some());
    assert_eq!(read_build_id(&File::open(&exe).unwrap()), expected);
}
