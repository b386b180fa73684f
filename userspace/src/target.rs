//! The process being profiled and the libc it allocates through.
//!
//! The libc is found in the target's own `/proc/PID/maps` and opened through
//! `/proc/PID/root`, so a process in a container (its own mount namespace and libc) is
//! probed in the libc it really uses. Nothing is hard-coded about its path.

use std::{
    collections::HashMap,
    fs,
    path::{Path, PathBuf},
};

use allocbpf_common::{AllocFn, ALLOC_FN_COUNT};
use object::{Object, ObjectSegment, ObjectSymbol};

use crate::{
    probe::free_offset::{find_free_probe, FreeProbe},
    procfs::{in_root, parse_maps},
};

/// Errors about the target process or its libc.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    /// No such process.
    #[error("no process with pid {0} (check the pid; it may have exited)")]
    NoSuchProcess(u32),
    /// The process's memory map cannot be read.
    #[error("cannot read the memory map of pid {pid}")]
    Maps {
        /// The target pid.
        pid: u32,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A kernel thread: no user memory at all.
    #[error("pid {pid} ({comm}) is a kernel thread: it has no user-space heap to profile")]
    KernelThread {
        /// The target pid.
        pid: u32,
        /// Its command name.
        comm: String,
    },
    /// No dynamically linked libc in the process.
    #[error(
        "pid {pid} ({comm}) has no dynamically linked libc in its memory map: it is statically \
         linked or uses its own allocator, so there is no libc malloc to probe"
    )]
    NoLibc {
        /// The target pid.
        pid: u32,
        /// Its command name.
        comm: String,
    },
    /// The libc file could not be parsed.
    #[error("cannot read libc {path}: {reason}")]
    BadLibc {
        /// Path to the libc file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
}

/// One allocation function found in the libc, ready to attach.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocSymbol {
    /// Which function.
    pub function: AllocFn,
    /// File offset of its first instruction (what uprobes attach to).
    pub file_offset: u64,
    /// ELF virtual address.
    pub address: u64,
    /// Code size in bytes (`st_size`).
    pub size: u64,
}

/// The libc image a target uses.
#[derive(Clone, Debug)]
pub struct Libc {
    /// The path as the target sees it (from its maps).
    pub path_in_target: PathBuf,
    /// A path to the same file that works from our mount namespace.
    pub host_path: PathBuf,
    /// Functions to probe, one per distinct address: glibc 2.36 exports `aligned_alloc`
    /// and `memalign` at one address, and two probes there would count each call twice.
    pub symbols: Vec<AllocSymbol>,
    /// Probed functions the libc does not export.
    pub missing: Vec<AllocFn>,
    /// Where `--live` probes free, decoded from the same file, or why it cannot.
    pub free_probe: Result<FreeProbe, String>,
}

impl Libc {
    /// Code sizes indexed by [`AllocFn`], for the eBPF `FN_SIZES` global.
    pub fn function_sizes(&self) -> [u64; ALLOC_FN_COUNT] {
        let mut sizes = [0; ALLOC_FN_COUNT];
        for symbol in &self.symbols {
            sizes[symbol.function as usize] = symbol.size;
        }
        sizes
    }
}

/// A process to profile.
#[derive(Clone, Debug)]
pub struct Target {
    /// Its pid (tgid).
    pub pid: u32,
    /// Its command name.
    pub comm: String,
    /// The libc it allocates through.
    pub libc: Libc,
}

/// True for a file name that is a C library providing malloc.
fn is_libc_name(name: &str) -> bool {
    // glibc: libc.so.6 (or libc-2.xx.so on old distributions); musl: ld-musl-ARCH.so.1
    // (musl's dynamic linker is its libc) or libc.musl-ARCH.so.1 (Alpine's link).
    name == "libc.so.6"
        || (name.starts_with("libc-") && name.ends_with(".so"))
        || (name.starts_with("ld-musl-") && name.contains(".so"))
        || name.starts_with("libc.musl-")
}

/// Reads `/proc/PID/comm`.
pub fn comm_of(pid: u32) -> Option<String> {
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|s| s.trim_end().to_string())
}

/// Returns the path of the first executable libc mapping in a `/proc/PID/maps` text.
pub fn find_libc_in_maps(maps: &str) -> Option<PathBuf> {
    parse_maps(maps).iter().find_map(|entry| {
        let path = entry.file_path()?;
        let name = path.file_name()?.to_str()?;
        (entry.executable && is_libc_name(name)).then(|| path.to_path_buf())
    })
}

impl Target {
    /// Resolves a pid to a target: checks the process exists, finds its libc and the
    /// allocation functions in it.
    pub fn resolve(pid: u32) -> Result<Target, TargetError> {
        if pid == 0 || !Path::new(&format!("/proc/{pid}")).exists() {
            return Err(TargetError::NoSuchProcess(pid));
        }
        let comm = comm_of(pid).ok_or(TargetError::NoSuchProcess(pid))?;
        let maps = fs::read_to_string(format!("/proc/{pid}/maps")).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                TargetError::NoSuchProcess(pid)
            } else {
                TargetError::Maps { pid, source }
            }
        })?;
        if maps.trim().is_empty() {
            return Err(TargetError::KernelThread { pid, comm });
        }
        let Some(path_in_target) = find_libc_in_maps(&maps) else {
            return Err(TargetError::NoLibc { pid, comm });
        };
        // Through the target's root, so containers' own libcs are the ones we probe.
        let host_path = in_root(pid, &path_in_target);
        let (symbols, missing, free_probe) = resolve_alloc_symbols(&host_path)?;
        Ok(Target {
            pid,
            comm,
            libc: Libc {
                path_in_target,
                host_path,
                symbols,
                missing,
                free_probe,
            },
        })
    }
}

/// What [`resolve_alloc_symbols`] finds: the functions to probe, those missing, and
/// where free can be probed.
pub type AllocSymbols = (Vec<AllocSymbol>, Vec<AllocFn>, Result<FreeProbe, String>);

/// Finds the allocation functions (and free's probe point) in a libc file.
pub fn resolve_alloc_symbols(path: &Path) -> Result<AllocSymbols, TargetError> {
    let bad = |reason: String| TargetError::BadLibc {
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
        let Some(&(address, size)) = by_name.get(function.symbol()) else {
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
            .ok_or_else(|| bad(format!("{} is in no loadable segment", function.symbol())))?;
        symbols.push(AllocSymbol {
            function,
            file_offset,
            address,
            size,
        });
    }
    if !symbols.iter().any(|s| s.function == AllocFn::Malloc) {
        return Err(bad("it does not export malloc".to_string()));
    }
    Ok((symbols, missing, find_free_probe(&file)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d0c0000000-55d0c0001000 r--p 00000000 fe:01 123 /usr/bin/sleep
7f0000000000-7f0000028000 r--p 00000000 fe:01 456 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000028000-7f000019d000 r-xp 00028000 fe:01 456 /usr/lib/x86_64-linux-gnu/libc.so.6
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
        let (symbols, _, _) = resolve_alloc_symbols(&libc).unwrap();
        assert!(symbols.iter().any(|s| s.function == AllocFn::Malloc));
        let mut addresses: Vec<u64> = symbols.iter().map(|s| s.address).collect();
        addresses.sort_unstable();
        addresses.dedup();
        assert_eq!(addresses.len(), symbols.len());
        assert!(symbols.iter().all(|s| s.size > 0));
    }
}
