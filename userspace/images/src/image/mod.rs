//! Allocator images: the files whose allocation entries allocbpf probes.
//!
//! An image is any file mapped executable by some process that defines an allocation
//! entry of the catalogue ([`crate::allocators`]): a C library, jemalloc, tcmalloc,
//! mimalloc, a static executable's own malloc, a library defining C++ `operator new`.
//! Files are recognised by the symbols they define, never by name. A uprobe belongs
//! to a file, not to a process, so each image is probed once for every process that
//! maps it, and is identified by the device and inode it has in `/proc/PID/maps`: a
//! container's own libc (opened through `/proc/PID/map_files`, [`procfs::open_mapped`])
//! is a different image from the host's, even at the same path.
//!
//! For each entry the image resolves where to probe it ([`point`]) and
//! whether it forwards to another entry ([`calls`]): an entry whose every call lands
//! in another probed entry (a tail-jump stub, or a C++ runtime's `operator new` that
//! calls `malloc`) is not probed at all, and one that only sometimes forwards is
//! probed as a wrapper, whose nested call the kernel side does not count again. A
//! link-time optimised CPython also allocates where its `PyObject_Malloc` was inlined:
//! those sites are found in its code and probed too ([`inlined`]).

mod addresses;
pub mod calls;
mod cfi;
mod entries;
mod frame;
mod indirect;
pub mod inlined;
pub mod point;
mod purity;

pub use entries::{resolve_entries, ResolvedEntries};
pub use frame::CallFrame;

use std::{
    collections::HashSet,
    fs::File,
    path::{Path, PathBuf},
    sync::Arc,
};

use allocbpf_common::{
    cookie::{ProbeCookie, Reg},
    AllocFn, Shape,
};
use object::{Object, ObjectSymbol};

use crate::allocators;
use crate::elf_ranges::Refusal;
use crate::image::point::ProbePoint;
use crate::procfs::{self, MapsEntry};

/// An image's identity: the device and inode of its file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ImageKey {
    /// Device (major << 32 | minor).
    pub device: u64,
    /// Inode number.
    pub inode: u64,
}

impl ImageKey {
    /// The file behind a mapping, as its maps line names it.
    pub fn of(mapping: &MapsEntry) -> ImageKey {
        ImageKey {
            device: mapping.device,
            inode: mapping.inode,
        }
    }
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
    /// The mapping could not be opened (the process exited or unmapped it): no verdict
    /// about the file itself.
    pub gone: bool,
    /// The file was refused unread for a hostile layout ([`crate::elf_ranges`]): worth
    /// counting and telling, unlike a file that is simply no allocator.
    pub refusal: Option<Refusal>,
    /// The open failed for want of descriptors
    /// ([`procfs::MappedFileError::out_of_descriptors`]).
    pub out_of_descriptors: bool,
}

/// One entry of an image, ready to attach.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbedEntry {
    /// Its symbol in the image (`je_malloc`, `_Znwm`).
    pub symbol: String,
    /// What it is.
    pub function: AllocFn,
    /// How the probe reads it.
    pub shape: Shape,
    /// File offset of its first byte.
    pub file_offset: u64,
    /// ELF virtual address.
    pub address: u64,
    /// Code size in bytes (`st_size`).
    pub size: u64,
    /// Where it is probed and where its inputs are there.
    pub point: ProbePoint,
    /// It may call another probed entry: its nested call is not counted again.
    pub wrapper: bool,
    /// It reaches other probed entries through other code (function pointers): a
    /// probed call beneath it while it runs, from code within `nest_span` bytes of its
    /// entry, is nested (see `ProbeCookie::nests`).
    pub nests: bool,
    /// With `nests`: how far from the entry, either way, the image's allocator code
    /// lies (the span a nested call returns into), in `NEST_SPAN_UNIT`s.
    pub nest_span: u64,
    /// With `nests`: the span is wide (no allocator function of the image is named),
    /// so a nested call must also find the wrapper still running.
    pub nests_checked: bool,
    /// A wrapper whose code runs straight to a call of its forward: how far below its
    /// stack pointer the forward's is at the forward's entry (`frame::straight_call_depth`).
    pub forward_call_depth: Option<u32>,
    /// It may reach another probed entry by a tail jump.
    pub tail_forward: bool,
    /// It resizes, and its tail jumps land only in entries that do not: only a
    /// resize of no block can forward by a tail jump (see `ProbeCookie`).
    pub tail_only_if_null: bool,
}

impl ProbedEntry {
    /// The file offset the uprobe is attached at.
    pub fn probe_file_offset(&self) -> u64 {
        self.file_offset + self.point.offset
    }

    /// The attach cookie telling the program where it is (`allocbpf_common::cookie`),
    /// probed full time.
    pub fn cookie(&self) -> u64 {
        self.cookie_in_windows(0)
    }

    /// The attach cookie for a probe that samples `2^window_shift` times denser than the
    /// configured rate (inside observation windows).
    pub fn cookie_in_windows(&self, window_shift: u8) -> u64 {
        self.cookie_for(window_shift, false)
    }

    /// The attach cookie of a probe in observation windows (`window_shift`, see
    /// [`ProbedEntry::cookie_in_windows`]) or, with `own_link`, of one process's own
    /// full-time links (`allocbpf_common::cookie::ProbeCookie::own_link`).
    pub fn cookie_for(&self, window_shift: u8, own_link: bool) -> u64 {
        ProbeCookie {
            code_size: if self.nests {
                self.nest_span
            } else {
                self.size
            },
            probe_offset: self.point.offset as u8,
            inputs: self.point.registers.map(|r| r as u8),
            overflow_check: self.point.overflow_check,
            wrapper: self.wrapper,
            nests: self.nests,
            nests_checked: self.nests_checked,
            abi_inputs: self.point.registers[..self.shape.inputs()]
                == Reg::ARGUMENTS[..self.shape.inputs()],
            tail_forward: self.tail_forward,
            tail_only_if_null: self.tail_only_if_null,
            forward_call_slots: self
                .forward_call_depth
                .map_or(0, allocbpf_common::cookie::forward_call_slots),
            stepped: !self.point.emulated,
            function: self.function as u8,
            window_shift,
            own_link,
        }
        .encode()
    }
}

/// An entry the image defines but that is not probed, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SkippedEntry {
    /// Its symbol.
    pub symbol: String,
    /// Why (`forwards to malloc`).
    pub reason: String,
}

/// An allocator image, resolved and ready to attach.
#[derive(Clone, Debug)]
pub struct AllocatorImage {
    /// Device and inode.
    pub key: ImageKey,
    /// The path as the process that revealed it sees it (from its maps), for messages
    /// only: it is another user's path, never opened.
    pub path_in_target: PathBuf,
    /// The file itself, opened through map_files and checked ([`procfs::open_mapped`]).
    /// Probes attach through it ([`AllocatorImage::attach_path`]), so what is probed is
    /// the file that was examined, whatever the path names meanwhile.
    pub file: Arc<File>,
    /// The allocator families its symbols reveal (`glibc`, `jemalloc`...).
    pub families: Vec<&'static str>,
    /// Allocation entries to probe, one per distinct address (glibc 2.36 exports
    /// `aligned_alloc` and `memalign` at one address; two probes there would count
    /// each call twice).
    pub entries: Vec<ProbedEntry>,
    /// Deallocation entries, probed when live blocks are tracked.
    pub frees: Vec<ProbedEntry>,
    /// Allocation sites inlined into other functions ([`inlined`]), probed by plain
    /// uprobes (a site has no return: with live tracking, its block is predicted).
    pub inlined: Vec<ProbedEntry>,
    /// Deallocation sites inlined into other functions, probed with live tracking.
    pub inlined_frees: Vec<ProbedEntry>,
    /// Entries defined but not probed: every call they make is counted where it lands.
    pub skipped: Vec<SkippedEntry>,
}

/// What discovery looks for, and what the session's stacks can rely on.
#[derive(Clone, Debug, Default)]
pub struct Lookup {
    /// Extra symbol prefixes (renamed allocators), searched besides the catalogue's.
    pub prefixes: Vec<String>,
    /// Stacks are unwound from a stack copy with unwind tables (in userspace). An entry that *calls* its forward keeps a frame between the probed
    /// function and the program; it is left unprobed only when that frame can be
    /// unwound (the entry has its own table entry, `cfi`). Kernel frame-pointer
    /// stacks cannot unwind it (allocators omit frame pointers): such entries stay
    /// probed, as wrappers, when frame pointers are walked in the kernel.
    pub unwind_tables: bool,
}

/// The names of a Go executable's function table section: `.gopclntab`, or in a
/// position-independent build before Go 1.26 `.data.rel.ro.gopclntab`.
pub const GO_PCLNTAB_SECTIONS: [&str; 2] = [".gopclntab", ".data.rel.ro.gopclntab"];

/// What examining one mapped file found: whether it is an allocator image, and the
/// facts that tell why a process made no probed call.
#[derive(Clone, Debug)]
pub struct FileFacts {
    /// The allocator image, if the file defines allocation entries to probe.
    pub image: Option<AllocatorImage>,
    /// The file imports an allocation symbol (its code calls malloc, operator new...).
    pub imports_allocation: bool,
    /// The file holds the Go runtime (`runtime.mallocgc`): its heap is Go's own.
    pub go_runtime: bool,
}

/// Reads the file of `pid`'s mapping `mapping` (through map_files, checked, size
/// capped: [`procfs`]): finds its allocation entries (as `lookup` says) and its imports.
pub fn examine(pid: u32, mapping: &MapsEntry, lookup: &Lookup) -> Result<FileFacts, ImageError> {
    let prefixes = lookup.prefixes.as_slice();
    let path_in_target = mapping.file_path().unwrap_or(Path::new(&mapping.name));
    let bad = |reason: String, gone: bool| ImageError {
        path: path_in_target.to_path_buf(),
        reason,
        gone,
        refusal: None,
        out_of_descriptors: false,
    };
    let opened = procfs::open_mapped(pid, mapping).map_err(|e| {
        // No verdict about the file itself: the process is gone, or its own mount
        // table could not tell where the file is.
        let gone = matches!(
            e,
            procfs::MappedFileError::Open { .. }
                | procfs::MappedFileError::UnknownFileSystem { .. }
        );
        ImageError {
            out_of_descriptors: e.out_of_descriptors(),
            ..bad(e.to_string(), gone)
        }
    })?;
    let data = procfs::read_mapped(&opened, path_in_target).map_err(|e| ImageError {
        refusal: match e {
            procfs::MappedFileError::Refused { refusal, .. } => Some(refusal),
            _ => None,
        },
        ..bad(e.to_string(), false)
    })?;
    let key = ImageKey::of(mapping);
    let file = object::File::parse(&*data).map_err(|e| bad(e.to_string(), false))?;
    let imports_allocation = file.dynamic_symbols().any(|symbol| {
        symbol.is_undefined()
            && symbol
                .name()
                .is_ok_and(|name| allocators::is_allocation_symbol(name, prefixes))
    });
    // Every Go executable keeps its function table, stripped or not.
    let go_runtime = GO_PCLNTAB_SECTIONS
        .iter()
        .any(|name| file.section_by_name(name).is_some())
        || file
            .symbols()
            .any(|symbol| symbol.name() == Ok("runtime.mallocgc"));
    let image = match resolve_entries(&file, &data, lookup) {
        Ok(found) => {
            let inlined = inlined::find(&file, &found.entries, &found.frees);
            if inlined.unrecognised > 0 {
                tracing::debug!(
                    "{}: {} inlined PyObject_Malloc and {} PyObject_Free sites probed, {} \
                     not understood",
                    path_in_target.display(),
                    inlined.sites.len(),
                    inlined.frees.len(),
                    inlined.unrecognised
                );
            }
            Some(AllocatorImage {
                key,
                path_in_target: path_in_target.to_path_buf(),
                file: Arc::new(opened),
                families: found.families,
                entries: found.entries,
                frees: found.frees,
                inlined: inlined.sites,
                inlined_frees: inlined.frees,
                skipped: found.skipped,
            })
        }
        Err(reason) => {
            tracing::debug!("{}: {reason}", path_in_target.display());
            None
        }
    };
    Ok(FileFacts {
        image,
        imports_allocation,
        go_runtime,
    })
}

impl AllocatorImage {
    /// The path probes attach through: our own descriptor of the examined file
    /// (`/proc/self/fd/N`), which the kernel resolves to that very inode.
    pub fn attach_path(&self) -> PathBuf {
        procfs::descriptor_path(&self.file)
    }

    /// Every probed entry, allocations first.
    pub fn all_entries(&self) -> impl Iterator<Item = &ProbedEntry> {
        self.entries.iter().chain(&self.frees)
    }

    /// Entries probed at their first byte with an instruction the kernel single-steps.
    pub fn single_stepped(&self) -> impl Iterator<Item = &ProbedEntry> {
        self.all_entries().filter(|e| !e.point.emulated)
    }

    /// Logs where each entry is probed (`-v`), which entries are not probed and why,
    /// and warns about entries the kernel must single-step.
    pub fn log_probe_points(&self) {
        let path = self.path_in_target.display();
        for entry in self.all_entries() {
            tracing::info!(
                "{path}: {} ({}) probed at +{} ({}){}",
                entry.symbol,
                entry.function.name(),
                entry.point.offset,
                entry.point.instruction,
                match (entry.wrapper, entry.forward_call_depth) {
                    (true, Some(depth)) => format!(
                        ", may forward to another entry (its first call, {depth} bytes \
                         down the stack)"
                    ),
                    (true, None) => ", may forward to another entry".to_string(),
                    (false, _) => String::new(),
                },
            );
        }
        if !self.inlined.is_empty() {
            let constant = self
                .inlined
                .iter()
                .filter(|e| e.point.registers[0] == Reg::One);
            tracing::info!(
                "{path}: {} sites where PyObject_Malloc is inlined probed at their branch to \
                 it ({} of a constant size); {} where PyObject_Free is, if live blocks are \
                 tracked",
                self.inlined.len(),
                constant.count(),
                self.inlined_frees.len()
            );
        }
        for skipped in &self.skipped {
            tracing::info!("{path}: {} not probed: {}", skipped.symbol, skipped.reason);
        }
        for entry in self.single_stepped() {
            tracing::warn!(
                "{path}: {} has no instruction the kernel emulates before its arguments are \
                 lost; probed at +0 ({}), which the kernel single-steps: ~14 us per call \
                 instead of ~0.5 us (docs/benchmarks.md)",
                entry.symbol,
                entry.point.instruction
            );
        }
    }

    /// One line for the start-up message: `libjemalloc.so.2 (jemalloc, 14 entries)`.
    pub fn describe(&self) -> String {
        let families = if self.families.is_empty() {
            "allocation entries".to_string()
        } else {
            self.families.join(", ")
        };
        let inlined = match self.inlined.len() {
            0 => String::new(),
            n => format!(" and {n} inlined sites"),
        };
        format!(
            "{} ({families}: {} entries{inlined})",
            self.path_in_target.display(),
            self.entries.len()
        )
    }
}

/// The executable, file-backed mappings of a process, once per file: every one may
/// define allocation entries.
///
/// Files seen are a set: any process can map tens of thousands of distinct files
/// executable (the kernel allows 65,530 mappings by default), and looking each up in a
/// list made every look at its maps quadratic.
pub fn candidate_mappings(maps: &[MapsEntry]) -> Vec<&MapsEntry> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for entry in maps.iter().filter(|e| e.executable && e.inode != 0) {
        if entry.file_path().is_some() && seen.insert((entry.device, entry.inode)) {
            out.push(entry);
        }
    }
    out
}

/// The next instruction `decoder` reads: `None` at the end of its code or at bytes
/// that do not decode (every walk of a function's code stops there).
pub(crate) fn next_instruction(
    decoder: &mut iced_x86::Decoder<'_>,
) -> Option<iced_x86::Instruction> {
    if !decoder.can_decode() {
        return None;
    }
    let instruction = decoder.decode();
    (!instruction.is_invalid()).then_some(instruction)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    use crate::procfs::parse_maps;

    const MAPS: &str = "\
55d0c0000000-55d0c0001000 r-xp 00000000 fe:01 123 /usr/bin/sleep
7f0000000000-7f0000028000 r--p 00000000 fe:01 456 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000028000-7f000019d000 r-xp 00028000 fe:01 456 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000200000-7f0000201000 r-xp 00001000 fe:01 789 /usr/lib/libz.so.1
7f0000300000-7f0000301000 r-xp 00001000 fe:01 789 /usr/lib/libz.so.1
7f00001f0000-7f00001f1000 rw-p 00000000 00:00 0 [heap]
";

    #[test]
    fn every_executable_file_is_a_candidate_once() {
        let maps = parse_maps(MAPS);
        let inodes: Vec<u64> = candidate_mappings(&maps).iter().map(|e| e.inode).collect();
        assert_eq!(inodes, [123, 456, 789]);
    }

    fn this_libc() -> PathBuf {
        let maps = fs::read_to_string("/proc/self/maps").unwrap();
        parse_maps(&maps)
            .iter()
            .filter_map(|e| e.file_path().map(Path::to_path_buf))
            .find(|p| p.file_name().is_some_and(|n| n == "libc.so.6"))
            .expect("tests run on glibc")
    }

    #[test]
    fn this_machines_libc_is_probed_at_emulated_instructions_only() {
        let data = fs::read(this_libc()).unwrap();
        let file = object::File::parse(&*data).unwrap();
        let found = resolve_entries(&file, &data, &Lookup::default()).unwrap();
        assert_eq!(found.families, ["glibc"]);
        let names: Vec<&str> = found.entries.iter().map(|e| e.symbol.as_str()).collect();
        for expected in ["malloc", "calloc", "realloc", "posix_memalign", "valloc"] {
            assert!(names.contains(&expected), "{names:?}");
        }
        let mut addresses: Vec<u64> = found.all_entries().map(|e| e.address).collect();
        addresses.sort_unstable();
        addresses.dedup();
        assert_eq!(addresses.len(), found.entries.len() + found.frees.len());
        for entry in found.all_entries() {
            assert!(
                entry.point.emulated,
                "{} at {:?}",
                entry.symbol, entry.point
            );
        }
        assert!(found.frees.iter().any(|e| e.symbol == "free"));
        // realloc(NULL, n) calls malloc: a wrapper. malloc itself forwards nothing.
        let malloc = found.entries.iter().find(|e| e.symbol == "malloc").unwrap();
        assert!(!malloc.wrapper);
    }

    #[test]
    fn a_forward_only_entry_that_calls_is_skipped_only_where_its_frame_unwinds() {
        // tcmalloc's posix_memalign calls tc_memalign and stores the block through its
        // first argument: forward-only, with an FDE of its own.
        let path = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4";
        let data = fs::read(path).expect("cargo xtask setup installs libtcmalloc-minimal4");
        let file = object::File::parse(&*data).unwrap();
        let probed = |unwind_tables| {
            let lookup = Lookup {
                prefixes: Vec::new(),
                unwind_tables,
            };
            let found = resolve_entries(&file, &data, &lookup).unwrap();
            let entry = found.entries.iter().find(|e| e.symbol == "posix_memalign");
            entry.map(|e| e.wrapper)
        };
        // Unwound from a stack copy: counted at tc_memalign, its frame unwinds.
        assert_eq!(probed(true), None);
        // Kernel frame-pointer stacks would lose the program's call site: a wrapper.
        assert_eq!(probed(false), Some(true));
    }

    impl ResolvedEntries {
        fn all_entries(&self) -> impl Iterator<Item = &ProbedEntry> {
            self.entries.iter().chain(&self.frees)
        }
    }

    #[test]
    #[ignore = "needs root: opens files through /proc/PID/map_files (cargo xtask test runs it in its root lane)"]
    fn a_file_without_allocation_entries_is_refused() {
        let pid = std::process::id();
        let exe = fs::read_link("/proc/self/exe").unwrap();
        let mapping = procfs::read_maps(pid)
            .into_iter()
            .find(|e| e.executable && e.file_path() == Some(exe.as_path()))
            .unwrap();
        let facts = examine(pid, &mapping, &Lookup::default()).unwrap();
        // The test binary links glibc dynamically and defines no malloc of its own, but
        // calls it.
        assert!(facts.image.is_none());
        assert!(facts.imports_allocation);
        assert!(!facts.go_runtime);
    }
}
