//! Whether a process is still in its dynamic loader: exec'd, its executable and
//! `ld.so` mapped, its libraries (libc among them) not yet.
//!
//! A process looked at in that first moment (`prog & allocbpf --pid $!`) maps no
//! allocator yet, and would be taken for one that has none. The kernel's auxiliary
//! vector tells the moment apart: `AT_BASE` is where it loaded the interpreter (zero
//! for a static executable), `AT_ENTRY` the executable's entry point. While every
//! file mapped is one of those two, the loader has not mapped a library yet.

use std::io::Read;

use super::MapsEntry;

/// `AT_BASE`: the interpreter's load address.
const AT_BASE: u64 = 7;
/// `AT_ENTRY`: the executable's entry point.
const AT_ENTRY: u64 = 9;
/// `/proc/PID/auxv` read at most: a few dozen pairs of 8-byte words in practice.
const MAX_AUXV_BYTES: u64 = 4096;

/// True if `pid`, whose map is `maps`, maps no file but its executable and the
/// interpreter the kernel loaded for it: its loader has not mapped its libraries yet.
/// False for a static executable, a process run as `ld.so PROG`, or when the auxiliary
/// vector cannot be read (gone, or not ours to read).
pub fn in_dynamic_loader(pid: u32, maps: &[MapsEntry]) -> bool {
    let Some(auxv) = read_auxv(pid) else {
        return false;
    };
    loader_only(&auxv, maps)
}

/// `/proc/PID/auxv`, at most [`MAX_AUXV_BYTES`].
fn read_auxv(pid: u32) -> Option<Vec<u8>> {
    let file = std::fs::File::open(format!("/proc/{pid}/auxv")).ok()?;
    let mut bytes = Vec::new();
    file.take(MAX_AUXV_BYTES).read_to_end(&mut bytes).ok()?;
    Some(bytes)
}

/// The value of the first `key` entry of an auxiliary vector (native-endian 8-byte
/// pairs, ended by `AT_NULL`).
fn auxv_value(auxv: &[u8], key: u64) -> Option<u64> {
    auxv.chunks_exact(16)
        .map(|pair| {
            let word = |at: usize| u64::from_ne_bytes(pair[at..at + 8].try_into().unwrap());
            (word(0), word(8))
        })
        .take_while(|&(kind, _)| kind != 0)
        .find(|&(kind, _)| kind == key)
        .map(|(_, value)| value)
}

/// [`in_dynamic_loader`] on a read auxiliary vector.
fn loader_only(auxv: &[u8], maps: &[MapsEntry]) -> bool {
    let (Some(base), Some(entry)) = (auxv_value(auxv, AT_BASE), auxv_value(auxv, AT_ENTRY)) else {
        return false;
    };
    if base == 0 {
        return false;
    }
    let file_at = |address: u64| {
        maps.iter()
            .find(|mapping| mapping.range.contains(&address) && mapping.inode != 0)
            .map(|mapping| (mapping.device, mapping.inode))
    };
    let (Some(interpreter), Some(executable)) = (file_at(base), file_at(entry)) else {
        return false;
    };
    maps.iter()
        .filter(|mapping| mapping.inode != 0)
        .all(|mapping| {
            let file = (mapping.device, mapping.inode);
            file == interpreter || file == executable
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    fn mapping(start: u64, inode: u64, name: &str) -> MapsEntry {
        MapsEntry {
            range: start..start + 0x1000,
            executable: true,
            offset: 0,
            device: if inode == 0 { 0 } else { 8 },
            inode,
            name: OsString::from(name),
        }
    }

    fn auxv(pairs: &[(u64, u64)]) -> Vec<u8> {
        (pairs.iter().chain(&[(0, 0)]))
            .flat_map(|&(kind, value)| [kind.to_ne_bytes(), value.to_ne_bytes()])
            .flatten()
            .collect()
    }

    #[test]
    fn a_process_mapping_only_its_executable_and_loader_is_loading() {
        let maps = [
            mapping(0x1000, 10, "/usr/bin/sleep"),
            mapping(0x9000, 0, "[vdso]"),
            mapping(
                0x7000_0000,
                20,
                "/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
            ),
        ];
        let vector = auxv(&[(AT_ENTRY, 0x1010), (AT_BASE, 0x7000_0000)]);
        assert!(loader_only(&vector, &maps));
        // Once a library is mapped, it is not.
        let mut loaded = maps.to_vec();
        loaded.push(mapping(
            0x7100_0000,
            30,
            "/usr/lib/x86_64-linux-gnu/libc.so.6",
        ));
        assert!(!loader_only(&vector, &loaded));
    }

    #[test]
    fn static_executables_and_unreadable_vectors_are_not_loading() {
        let maps = [mapping(0x1000, 10, "/usr/bin/busybox")];
        // A static executable: no interpreter.
        assert!(!loader_only(
            &auxv(&[(AT_ENTRY, 0x1010), (AT_BASE, 0)]),
            &maps
        ));
        assert!(!loader_only(&auxv(&[(AT_ENTRY, 0x1010)]), &maps));
        // Garbage, empty and truncated vectors.
        assert!(!loader_only(&[], &maps));
        assert!(!loader_only(&[0xff; 15], &maps));
        // Addresses that fall in no file mapping.
        let vector = auxv(&[(AT_ENTRY, 0xdead_0000), (AT_BASE, 0x7000_0000)]);
        assert!(!loader_only(&vector, &maps));
    }

    #[test]
    fn this_process_is_past_its_loader() {
        let pid = std::process::id();
        let maps = super::super::try_read_maps(pid).unwrap();
        assert!(read_auxv(pid).is_some_and(|auxv| auxv_value(&auxv, AT_ENTRY).is_some()));
        assert!(!in_dynamic_loader(pid, &maps));
    }
}
