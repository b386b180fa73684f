//! Allocator images: the files whose allocation functions allocbpf probes.
//!
//! An image is a file mapped executable by some process that defines `malloc` (or
//! `PREFIXmalloc` with `--allocator-symbol PREFIX`): the C library, a statically linked
//! executable, or a custom allocator such as jemalloc. A uprobe belongs to a file, not
//! to a process, so each image is probed once for every process that maps it, and is
//! identified by the device and inode it has in `/proc/PID/maps`: a container's own
//! libc (reached through `/proc/PID/root`) is a different image from the host's, even
//! at the same path.

use std::{
    collections::HashMap,
    fs,
    path::{Path, PathBuf},
};

use allocbpf_common::{AllocFn, ALLOC_FN_COUNT};
use object::{Object, ObjectSegment, ObjectSymbol};

use crate::{
    probe::free_offset::{find_free_probe, FreeProbe},
    procfs::{in_root, parse_maps, MapsEntry},
};

/// An image's identity: the device and inode of its file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ImageKey {
    /// Device (major << 32 | minor).
    pub device: u64,
    /// Inode number.
    pub inode: u64,
}

impl std::fmt::Display for ImageKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:x}:{:x}/{}",
            self.device >> 32,
            self.device & 0xffff_ffff,
            self.inode
        )
    }
}

/// Why a file cannot be probed as an allocator image.
#[derive(Debug, thiserror::Error)]
#[error("cannot probe {path}: {reason}")]
pub struct ImageError {
    /// The file.
    pub path: PathBuf,
    /// What went wrong.
    pub reason: String,
}

/// One allocation function found in an image, ready to attach.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocSymbol {
    /// Which function.
    pub function: AllocFn,
    /// File offset of its first instruction (what uprobes attach to).
    pub file_offset: u64,
    /// ELF virtual address.
    pub address: u64,
    /// Code size in bytes (`st_size`): the probe's attach cookie.
    pub size: u64,
}

/// An allocator image, resolved and ready to attach.
#[derive(Clone, Debug)]
pub struct AllocatorImage {
    /// Device and inode.
    pub key: ImageKey,
    /// The path as the process that revealed it sees it (from its maps).
    pub path_in_target: PathBuf,
    /// A path to the same file that works from our mount namespace.
    pub host_path: PathBuf,
    /// Symbol prefix of the allocation functions ("" for libc).
    pub prefix: String,
    /// Functions to probe, one per distinct address: glibc 2.36 exports `aligned_alloc`
    /// and `memalign` at one address, and two probes there would count each call twice.
    pub symbols: Vec<AllocSymbol>,
    /// Probed functions the image does not define.
    pub missing: Vec<AllocFn>,
    /// Where `--live` probes free, decoded from the same file, or why it cannot.
    pub free_probe: Result<FreeProbe, String>,
}

impl AllocatorImage {
    /// Reads the image mapped by `pid` at `path_in_target` (with identity `key`) and
    /// finds its `prefix`ed allocation functions.
    pub fn resolve(
        pid: u32,
        key: ImageKey,
        path_in_target: &Path,
        prefix: &str,
    ) -> Result<AllocatorImage, ImageError> {
        // Through the process's root, so containers' own files are the ones we probe.
        let host_path = in_root(pid, path_in_target);
        let (symbols, missing, free_probe) = resolve_alloc_symbols(&host_path, prefix)?;
        Ok(AllocatorImage {
            key,
            path_in_target: path_in_target.to_path_buf(),
            host_path,
            prefix: prefix.to_string(),
            symbols,
            missing,
            free_probe,
        })
    }

    /// The symbol a function has in this image (`je_malloc` with prefix `je_`).
    pub fn symbol_name(&self, function: AllocFn) -> String {
        format!("{}{}", self.prefix, function.symbol())
    }
}

/// True for a file name that is a C library providing malloc.
pub fn is_libc_name(name: &str) -> bool {
    // glibc: libc.so.6 (or libc-2.xx.so on old distributions); musl: ld-musl-ARCH.so.1
    // (musl's dynamic linker is its libc) or libc.musl-ARCH.so.1 (Alpine's link).
    name == "libc.so.6"
        || (name.starts_with("libc-") && name.ends_with(".so"))
        || (name.starts_with("ld-musl-") && name.contains(".so"))
        || name.starts_with("libc.musl-")
}

/// Returns the path of the first executable libc mapping in a `/proc/PID/maps` text.
pub fn find_libc_in_maps(maps: &str) -> Option<PathBuf> {
    parse_maps(maps).iter().find_map(|entry| {
        let path = entry.file_path()?;
        let name = path.file_name()?.to_str()?;
        (entry.executable && is_libc_name(name)).then(|| path.to_path_buf())
    })
}

/// The executable, file-backed mappings of a process that may hold an allocator, once
/// per file: its libc (by name), its main executable (`exe`, which may be statically
/// linked or define its own malloc), and with allocator prefixes every other file.
pub fn candidate_mappings<'a>(
    maps: &'a [MapsEntry],
    exe: Option<&Path>,
    any_file: bool,
) -> Vec<&'a MapsEntry> {
    let mut seen = Vec::new();
    let mut out = Vec::new();
    for entry in maps.iter().filter(|e| e.executable && e.inode != 0) {
        let Some(path) = entry.file_path() else {
            continue;
        };
        let is_libc = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(is_libc_name);
        if (is_libc || Some(path) == exe || any_file)
            && !seen.contains(&(entry.device, entry.inode))
        {
            seen.push((entry.device, entry.inode));
            out.push(entry);
        }
    }
    out
}

/// What [`resolve_alloc_symbols`] finds: the functions to probe, those missing, and
/// where free can be probed.
pub type AllocSymbols = (Vec<AllocSymbol>, Vec<AllocFn>, Result<FreeProbe, String>);

/// Finds the `prefix`ed allocation functions (and free's probe point) in a file.
/// Fails when the file does not define `PREFIXmalloc`.
pub fn resolve_alloc_symbols(path: &Path, prefix: &str) -> Result<AllocSymbols, ImageError> {
    let bad = |reason: String| ImageError {
        path: path.to_path_buf(),
        reason,
    };
    let data = fs::read(path).map_err(|e| bad(e.to_string()))?;
    let file = object::File::parse(&*data).map_err(|e| bad(e.to_string()))?;

    let mut by_name: HashMap<&str, (u64, u64)> = HashMap::new();
    for symbol in file.dynamic_symbols().chain(file.symbols()) {
        if !symbol.is_definition() || symbol.kind() != object::SymbolKind::Text {
            continue;
        }
        if let Ok(name) = symbol.name() {
            by_name
                .entry(name)
                .or_insert((symbol.address(), symbol.size()));
        }
    }

    let mut symbols: Vec<AllocSymbol> = Vec::new();
    let mut missing = Vec::new();
    for function in AllocFn::ALL {
        let name = format!("{prefix}{}", function.symbol());
        let Some(&(address, size)) = by_name.get(name.as_str()) else {
            missing.push(function);
            continue;
        };
        if symbols.iter().any(|s| s.address == address) {
            // An alias of a function already probed (glibc: aligned_alloc == memalign).
            continue;
        }
        let file_offset = file
            .segments()
            .find_map(|segment| {
                let (start, end) = (segment.address(), segment.address() + segment.size());
                (start..end)
                    .contains(&address)
                    .then(|| address - start + segment.file_range().0)
            })
            .ok_or_else(|| bad(format!("{name} is in no loadable segment")))?;
        symbols.push(AllocSymbol {
            function,
            file_offset,
            address,
            size,
        });
    }
    if !symbols.iter().any(|s| s.function == AllocFn::Malloc) {
        return Err(bad(format!("it does not define {prefix}malloc")));
    }
    debug_assert!(symbols.len() <= ALLOC_FN_COUNT);
    Ok((symbols, missing, find_free_probe(&file, prefix)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d0c0000000-55d0c0001000 r-xp 00000000 fe:01 123 /usr/bin/sleep
7f0000000000-7f0000028000 r--p 00000000 fe:01 456 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000028000-7f000019d000 r-xp 00028000 fe:01 456 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000200000-7f0000201000 r-xp 00001000 fe:01 789 /usr/lib/libz.so.1
7f00001f0000-7f00001f1000 rw-p 00000000 00:00 0 [heap]
";

    #[test]
    fn libc_is_found_by_its_executable_mapping() {
        assert_eq!(
            find_libc_in_maps(MAPS),
            Some(PathBuf::from("/usr/lib/x86_64-linux-gnu/libc.so.6"))
        );
        assert_eq!(
            find_libc_in_maps("7f-8f r-xp 0 0:0 1 /usr/bin/static\n"),
            None
        );
    }

    #[test]
    fn candidates_are_libc_and_the_executable_unless_any_file() {
        let maps = parse_maps(MAPS);
        let names = |c: Vec<&MapsEntry>| c.iter().map(|e| e.inode).collect::<Vec<_>>();
        let exe = Path::new("/usr/bin/sleep");
        assert_eq!(
            names(candidate_mappings(&maps, Some(exe), false)),
            [123, 456]
        );
        assert_eq!(names(candidate_mappings(&maps, None, false)), [456]);
        assert_eq!(
            names(candidate_mappings(&maps, None, true)),
            [123, 456, 789]
        );
    }

    #[test]
    fn musl_and_old_glibc_names_count() {
        assert!(is_libc_name("ld-musl-x86_64.so.1"));
        assert!(is_libc_name("libc.musl-x86_64.so.1"));
        assert!(is_libc_name("libc-2.31.so"));
        assert!(!is_libc_name("libcrypto.so.3"));
        assert!(!is_libc_name("libc++.so.1"));
    }

    #[test]
    fn this_machines_libc_has_malloc_and_no_duplicate_addresses() {
        let maps = fs::read_to_string("/proc/self/maps").unwrap();
        let libc = find_libc_in_maps(&maps).expect("tests run on a glibc system");
        let (symbols, _, _) = resolve_alloc_symbols(&libc, "").unwrap();
        assert!(symbols.iter().any(|s| s.function == AllocFn::Malloc));
        let mut addresses: Vec<u64> = symbols.iter().map(|s| s.address).collect();
        addresses.sort_unstable();
        addresses.dedup();
        assert_eq!(addresses.len(), symbols.len());
        assert!(symbols.iter().all(|s| s.size > 0));
        // No je_malloc in glibc.
        assert!(resolve_alloc_symbols(&libc, "je_").is_err());
    }
}
