//! User stacks unwound in userspace from a copy of the stack, with unwind tables.
//!
//! The probe sends `ip`, `sp`, `bp` and the top of the user stack. framehop unwinds it
//! with each module's `.eh_frame` / `.eh_frame_hdr` / `.debug_frame`, and in `auto` mode
//! falls back to frame pointers for code without unwind information. This is how
//! binaries without frame pointers (Debian's glibc, distro packages, release builds)
//! get complete stacks.
//!
//! Modules come from `/proc/PID/maps`, read at the process's first sample (and again,
//! at most once a second, when an address falls outside every known module). Files are
//! opened through `/proc/PID/map_files/`, so deleted or replaced binaries and
//! containers' files are the ones the process runs. Their unwind sections are cached by
//! build id (or path for files without one) in a cache bounded in bytes (`cache`), so
//! many processes of one program share one copy.
//!
//! One more rule comes from the code itself: an allocation entry left unprobed because
//! every block it returns comes from a probed entry it *calls* (musl's `calloc` calls
//! `malloc`) has its frame at that call derived by [`allocbpf_images::image`] (a
//! [`CallFrame`]), since musl has neither unwind tables nor frame pointers. A stack
//! sampled in `malloc` steps through `calloc` by that rule.

use std::{
    collections::{HashMap, HashSet},
    ops::Range,
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use framehop::{
    x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64},
    ExplicitModuleSectionInfo, FrameAddress, Module, Unwinder,
};
use object::{Object, ObjectSection, ObjectSegment};

use allocbpf_images::image::{self, CallFrame, Lookup};
use allocbpf_images::procfs::{self, MappedFileError, MapsEntry};
use allocbpf_images::sealed_copy::FileIdentity;

mod cache;

use cache::{LruCache, MAX_CACHED_BYTES};

/// Return addresses produced at most per stack.
const MAX_FRAMES: usize = 127;
/// Module lists re-read at most this often per process.
const REFRESH_EVERY: Duration = Duration::from_secs(1);

/// Bytes of unwind sections (`.eh_frame`, `.eh_frame_hdr`, `.debug_frame`, sizes as
/// their headers say) a file may have copied; a file with more keeps its module but not
/// its tables, and its code is unwound as code without them (frame pointers in `auto`,
/// the stack ends there in `dwarf`). The largest real ones: librustc_driver 11.0 MB
/// (9.6 MB of `.eh_frame`), libLLVM.so.22.1 7.6 MB, gcc's cc1 2.8 MB, Debian's libc
/// 183 KB. More than the cache's whole budget could never be kept
/// ([`LruCache::insert`]): it would be copied again at every refresh, and one file
/// would evict every other.
const MAX_UNWIND_BYTES: u64 = MAX_CACHED_BYTES;

/// Files remembered as unusable at most (keys only); past it the set starts over.
const MAX_UNUSABLE_FILES: usize = 4096;

/// How `dwarf`/`auto` treat code without unwind information.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fallback {
    /// `auto`: follow frame pointers there.
    FramePointers,
    /// `dwarf`: stop the stack there.
    Stop,
}

/// One file's unwind data, shared by every process that maps it.
struct FileSections {
    eh_frame: Option<(Range<u64>, Arc<[u8]>)>,
    eh_frame_hdr: Option<(Range<u64>, Arc<[u8]>)>,
    debug_frame: Option<Arc<[u8]>>,
    /// The `.text` address range only: framehop reads text bytes for Mach-O compact
    /// unwind info and PE, never for ELF's `.eh_frame`/`.debug_frame`, so copying them
    /// (the largest section of most binaries) only filled the cache.
    text_svma: Option<Range<u64>>,
    /// (file offset range, vaddr) of the executable loadable segments, to compute
    /// load biases.
    segments: Vec<(Range<u64>, u64)>,
    /// Frames of unprobed allocation entries at their calls, by return address
    /// (file virtual address).
    call_frames: HashMap<u64, CallFrame>,
}

impl cache::ByteSize for FileSections {
    /// Bytes of section copies held.
    fn bytes(&self) -> u64 {
        let range = |s: &Option<(Range<u64>, Arc<[u8]>)>| s.as_ref().map_or(0, |(_, d)| d.len());
        (range(&self.eh_frame)
            + range(&self.eh_frame_hdr)
            + self.debug_frame.as_ref().map_or(0, |d| d.len())) as u64
    }
}

impl FileSections {
    /// The unwind data of the file whose bytes are `data` (`what`: its path, for logs),
    /// its tables left out if they hold over `max_unwind_bytes`; `None` if it does not
    /// parse.
    fn read(
        data: &[u8],
        lookup: &Lookup,
        max_unwind_bytes: u64,
        what: &Path,
    ) -> Option<FileSections> {
        let file = object::File::parse(data).ok()?;
        // Sizes from the headers, before anything is copied.
        let unwind_bytes = [".eh_frame", ".eh_frame_hdr", ".debug_frame"]
            .iter()
            .filter_map(|name| file.section_by_name(name))
            .fold(0u64, |sum, s| sum.saturating_add(s.size()));
        let tables = unwind_bytes <= max_unwind_bytes;
        if !tables {
            tracing::warn!(
                "{}: {unwind_bytes} bytes of unwind tables, over the {max_unwind_bytes}-byte \
                 cap: not used, its code is unwound as code without tables (frame pointers)",
                what.display()
            );
        }
        let call_frames = image::resolve_entries(&file, data, lookup)
            .map(|entries| entries.call_frames)
            .unwrap_or_default()
            .into_iter()
            .map(|frame| (frame.return_address, frame))
            .collect();
        let section = |name: &str| {
            let s = file.section_by_name(name).filter(|_| tables)?;
            let bytes: Arc<[u8]> = Arc::from(s.data().ok()?);
            Some((s.address()..s.address() + s.size(), bytes))
        };
        Some(FileSections {
            eh_frame: section(".eh_frame"),
            eh_frame_hdr: section(".eh_frame_hdr"),
            debug_frame: section(".debug_frame").map(|(_, d)| d),
            text_svma: file
                .section_by_name(".text")
                .map(|s| s.address()..s.address() + s.size()),
            segments: file
                .segments()
                .filter(|s| match s.flags() {
                    object::SegmentFlags::Elf { p_flags } => p_flags & object::elf::PF_X != 0,
                    _ => true,
                })
                .map(|s| {
                    let (offset, size) = s.file_range();
                    (offset..offset + size, s.address())
                })
                .collect(),
            call_frames,
        })
    }

    fn has_unwind_info(&self) -> bool {
        self.eh_frame.is_some() || self.debug_frame.is_some()
    }

    /// The load bias of an executable mapping of file offset `offset` (page-aligned)
    /// at address `start`. The segment's first page may begin before its `p_offset`
    /// and be shared with the previous segment (lld lays segments out so), which is
    /// why only executable segments are considered.
    fn bias(&self, start: u64, offset: u64) -> Option<u64> {
        self.segments.iter().find_map(|(range, vaddr)| {
            let first_page = range.start & !0xfff;
            (first_page <= offset && offset < range.end).then(|| {
                // The byte at file offset `range.start` is at `vaddr` (+ bias).
                (start + (range.start - offset)).wrapping_sub(*vaddr)
            })
        })
    }
}

/// One executable mapping of a process.
struct MappedRange {
    range: Range<u64>,
    /// Its file has unwind information.
    has_info: bool,
    /// Load bias: file virtual address + bias = process address.
    bias: u64,
    file: Arc<FileSections>,
}

/// A process's modules, as framehop needs them.
struct ProcessModules {
    unwinder: UnwinderX86_64<Arc<[u8]>>,
    ranges: Vec<MappedRange>,
    read_at: Instant,
}

impl ProcessModules {
    fn range_of(&self, address: u64) -> Option<&MappedRange> {
        self.ranges.iter().find(|r| r.range.contains(&address))
    }

    /// The derived frame rule at return address `address`, if any.
    fn call_frame(&self, address: u64) -> Option<&CallFrame> {
        let range = self.range_of(address)?;
        range
            .file
            .call_frames
            .get(&address.wrapping_sub(range.bias))
    }
}

/// Unwinds copied user stacks for any number of processes.
pub struct StackUnwinder {
    fallback: Fallback,
    /// What discovery looks for: the same entries, so the same derived frames.
    lookup: Lookup,
    cache: CacheX86_64,
    /// Sections by file, and which file a device and inode is (a file seen before is
    /// not read again).
    files: LruCache<FileKey, FileSections>,
    /// Files that could not be read or parsed (refused for a hostile layout, not ELF,
    /// too large), by device and inode: left out of every process's modules (framehop
    /// follows frame pointers through code of no module) without being read again at
    /// each refresh, which could read up to a file-size cap once a second.
    unusable: HashSet<(u64, u64)>,
    processes: HashMap<u32, ProcessModules>,
    /// Stacks unwound, and time spent (for `-v` logs and the benchmark figures).
    pub unwound: u64,
    /// Time spent unwinding.
    pub elapsed: Duration,
    /// Opens of mapped files that failed for want of descriptors so far.
    pub descriptor_errors: u64,
    /// Process maps read that were cut at their size cap so far.
    pub maps_cut: u64,
}

/// Identity of a file: the `fstat` of our own descriptor to it (device, inode, size,
/// times). Not its build id: that is bytes in the file, which a stub library seen first
/// could carry to have its unwind tables used for every process's libc.
type FileKey = FileIdentity;

impl StackUnwinder {
    /// An unwinder for `auto` (frame-pointer fallback) or `dwarf` (stop) mode, for a
    /// session that discovers entries with `prefixes` (renamed allocators' prefixes).
    pub fn new(fallback: Fallback, prefixes: Vec<String>) -> Self {
        Self {
            fallback,
            lookup: Lookup {
                prefixes,
                unwind_tables: true,
            },
            cache: CacheX86_64::new(),
            files: LruCache::new(MAX_CACHED_BYTES),
            unusable: HashSet::new(),
            processes: HashMap::new(),
            unwound: 0,
            elapsed: Duration::ZERO,
            descriptor_errors: 0,
            maps_cut: 0,
        }
    }

    /// Bytes of unwind sections cached now.
    pub fn cached_bytes(&self) -> u64 {
        self.files.bytes()
    }

    /// Files evicted from the cache so far.
    pub fn evicted_files(&self) -> u64 {
        self.files.evicted
    }

    /// Reads `pid`'s modules now (at attach, while it surely lives).
    pub fn prime(&mut self, pid: u32) {
        self.refresh(pid);
    }

    fn file(&mut self, pid: u32, mapping: &MapsEntry) -> Option<Arc<FileSections>> {
        let inode = (mapping.device, mapping.inode);
        if let Some(sections) = self.files.by_inode(inode) {
            return Some(sections);
        }
        if self.unusable.contains(&inode) {
            return None;
        }
        // The process's own view: works for deleted/replaced files and containers.
        let path = mapping.file_path()?;
        let read = procfs::open_mapped(pid, mapping).and_then(|file| {
            let identity = FileIdentity::of(&file).map_err(|source| MappedFileError::Open {
                path: path.display().to_string(),
                source,
            })?;
            Ok((identity, procfs::read_mapped(&file, path)?))
        });
        let (key, data) = match read {
            Ok(read) => read,
            Err(error) => {
                self.descriptor_errors += u64::from(error.out_of_descriptors());
                tracing::debug!("pid {pid}: {error}");
                // Gone, or not the mapping's file: no verdict about the file itself.
                let transient = matches!(
                    error,
                    MappedFileError::Open { .. } | MappedFileError::NotTheMapping { .. }
                );
                if !transient {
                    self.remember_unusable(inode);
                }
                return None;
            }
        };
        let sections = match self.files.get(&key) {
            Some(sections) => sections,
            None => {
                let Some(sections) =
                    FileSections::read(&data, &self.lookup, MAX_UNWIND_BYTES, path)
                else {
                    tracing::debug!("pid {pid}: {} does not parse", path.display());
                    self.remember_unusable(inode);
                    return None;
                };
                let sections = Arc::new(sections);
                if !self.files.insert(key, sections.clone()) {
                    // Over the whole budget (not within MAX_UNWIND_BYTES): used for this
                    // process, read again for the next.
                    tracing::debug!("pid {pid}: {} not cached: too large", path.display());
                }
                sections
            }
        };
        self.files.index(inode, key);
        Some(sections)
    }

    /// Remembers that the file with this device and inode cannot be used.
    fn remember_unusable(&mut self, inode: (u64, u64)) {
        if self.unusable.len() >= MAX_UNUSABLE_FILES {
            self.unusable.clear();
        }
        self.unusable.insert(inode);
    }

    /// Drops `pid`'s modules (it exited or exec'd).
    pub fn forget(&mut self, pid: u32) {
        self.processes.remove(&pid);
    }

    fn refresh(&mut self, pid: u32) {
        let mappings: Vec<MapsEntry> = procfs::read_maps_counting_cuts(pid, &mut self.maps_cut)
            .into_iter()
            .filter(|e| e.executable && e.file_path().is_some())
            .collect();
        if mappings.is_empty() {
            return;
        }
        let mut unwinder = UnwinderX86_64::new();
        let mut ranges = Vec::new();
        for mapping in &mappings {
            let Some(file) = self.file(pid, mapping) else {
                continue;
            };
            let Some(bias) = file.bias(mapping.range.start, mapping.offset) else {
                continue;
            };
            ranges.push(MappedRange {
                range: mapping.range.clone(),
                has_info: file.has_unwind_info(),
                bias,
                file: file.clone(),
            });
            let info = ExplicitModuleSectionInfo {
                base_svma: 0,
                text_svma: file.text_svma.clone(),
                eh_frame_svma: file.eh_frame.as_ref().map(|e| e.0.clone()),
                eh_frame: file.eh_frame.as_ref().map(|e| e.1.clone()),
                eh_frame_hdr_svma: file.eh_frame_hdr.as_ref().map(|e| e.0.clone()),
                eh_frame_hdr: file.eh_frame_hdr.as_ref().map(|e| e.1.clone()),
                debug_frame: file.debug_frame.clone(),
                ..Default::default()
            };
            unwinder.add_module(Module::new(
                // framehop's name is for its messages only: text, lossily.
                mapping.name.to_string_lossy().into_owned(),
                mapping.range.clone(),
                bias,
                info,
            ));
        }
        self.processes.insert(
            pid,
            ProcessModules {
                unwinder,
                ranges,
                read_at: Instant::now(),
            },
        );
    }

    /// Return addresses, innermost first (the allocation function's own frame left
    /// out), unwound from `regs` = [ip, sp, bp] and the stack copied from `sp` up.
    pub fn unwind(&mut self, pid: u32, regs: [u64; 3], stack: &[u8]) -> Vec<u64> {
        let started = Instant::now();
        let [ip, sp, bp] = regs;
        let known = |p: &ProcessModules| p.range_of(ip).is_some();
        let stale = match self.processes.get(&pid) {
            None => true,
            Some(p) => !known(p) && p.read_at.elapsed() >= REFRESH_EVERY,
        };
        if stale {
            self.refresh(pid);
        }
        let Some(process) = self.processes.get(&pid) else {
            return Vec::new();
        };
        let mut read_stack = |address: u64| -> Result<u64, ()> {
            let offset = address.checked_sub(sp).ok_or(())? as usize;
            let bytes = stack.get(offset..offset + 8).ok_or(())?;
            Ok(u64::from_le_bytes(bytes.try_into().map_err(|_| ())?))
        };
        let mut regs = UnwindRegsX86_64::new(ip, sp, bp);
        let mut frame = FrameAddress::from_instruction_pointer(ip);
        let mut addresses = Vec::new();
        while addresses.len() < MAX_FRAMES {
            // A derived frame first (exact for that call site), else framehop.
            let derived = match frame {
                FrameAddress::ReturnAddress(address) => process.call_frame(address.get()),
                FrameAddress::InstructionPointer(_) => None,
            };
            let caller = match derived {
                Some(rule) => {
                    rule.unwind(regs.sp(), regs.bp(), &mut read_stack)
                        .map(|(address, sp, bp)| {
                            regs.set_ip(address);
                            regs.set_sp(sp);
                            regs.set_bp(bp);
                            address
                        })
                }
                None => process
                    .unwinder
                    .unwind_frame(frame, &mut regs, &mut self.cache, &mut read_stack)
                    .ok()
                    .flatten(),
            };
            let Some((address, next)) =
                caller.and_then(|a| Some((a, FrameAddress::from_return_address(a)?)))
            else {
                break;
            };
            addresses.push(address);
            if self.fallback == Fallback::Stop {
                // Only frames whose caller's code has unwind information (or a derived
                // frame) were unwound from tables; beyond a module without them, stop.
                let covered = process.range_of(address).is_some_and(|r| {
                    r.has_info
                        || r.file
                            .call_frames
                            .contains_key(&address.wrapping_sub(r.bias))
                });
                if !covered {
                    break;
                }
            }
            frame = next;
        }
        self.unwound += 1;
        self.elapsed += started.elapsed();
        addresses
    }
}

#[cfg(test)]
mod tests {
    use std::{fs::File, os::fd::AsRawFd};

    use super::*;

    /// This process's mapping of the C library.
    fn libc_mapping() -> MapsEntry {
        procfs::read_maps(std::process::id())
            .into_iter()
            .find(|e| {
                e.executable
                    && e.file_path()
                        .and_then(Path::file_name)
                        .is_some_and(|n| n == "libc.so.6")
            })
            .expect("tests run on glibc")
    }

    /// Tables over the cap are left out, the module kept: its code is unwound as code
    /// without tables, at the same load bias.
    #[test]
    fn unwind_tables_over_the_cap_are_left_out_and_the_module_kept() {
        let mapping = libc_mapping();
        let path = mapping.file_path().unwrap();
        let data = std::fs::read(path).unwrap();
        let lookup = Lookup::default();
        let whole = FileSections::read(&data, &lookup, MAX_UNWIND_BYTES, path).unwrap();
        assert!(whole.has_unwind_info());
        let capped = FileSections::read(&data, &lookup, 1000, path).unwrap();
        assert!(!capped.has_unwind_info());
        assert!(capped.eh_frame_hdr.is_none());
        assert_eq!(cache::ByteSize::bytes(&capped), 0);
        let bias = |f: &FileSections| f.bias(mapping.range.start, mapping.offset);
        assert!(bias(&capped).is_some());
        assert_eq!(bias(&capped), bias(&whole));
    }

    /// A mapped file refused unread (60,000 section headers) is remembered by device and
    /// inode: the next refresh does not read it again, and the process's other modules
    /// are still read.
    #[test]
    #[ignore = "needs root: opens files through /proc/PID/map_files (cargo xtask test runs it in its root lane)"]
    fn a_refused_file_is_remembered_and_not_read_again() {
        let dir = std::env::temp_dir().join(format!("unwind-refused-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("hostile.so");
        let sections: u64 = 60_000;
        let size: u64 = 8 << 20;
        let mut head = vec![0u8; 64];
        head[..7].copy_from_slice(b"\x7fELF\x02\x01\x01");
        head[0x28..0x30].copy_from_slice(&0x1000u64.to_le_bytes()); // e_shoff
        head[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes()); // e_shentsize
        head[0x3c..0x3e].copy_from_slice(&(sections as u16).to_le_bytes()); // e_shnum
        head[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes()); // e_shstrndx
        let file = File::create(&path).unwrap();
        std::io::Write::write_all(&mut &file, &head).unwrap();
        file.set_len(size).unwrap();
        drop(file);
        let file = File::open(&path).unwrap();
        // SAFETY: a new private read-only mapping of a file we own, unmapped below.
        let address = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size as usize,
                libc::PROT_READ | libc::PROT_EXEC,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(address, libc::MAP_FAILED);
        let pid = std::process::id();
        let mapping = procfs::read_maps(pid)
            .into_iter()
            .find(|e| e.range.start == address as u64)
            .unwrap();
        let mut unwinder = StackUnwinder::new(Fallback::FramePointers, Vec::new());
        assert!(unwinder.file(pid, &mapping).is_none());
        assert!(unwinder.unusable.contains(&(mapping.device, mapping.inode)));
        // Not read again: the same answer even once the file could no longer be read.
        std::fs::remove_file(&path).unwrap();
        assert!(unwinder.file(pid, &mapping).is_none());
        assert!(unwinder.file(pid, &libc_mapping()).is_some());
        unwinder.refresh(pid);
        let process = &unwinder.processes[&pid];
        assert!(process.range_of(address as u64).is_none());
        assert!(!process.ranges.is_empty());
        // SAFETY: the mapping made above, no longer used.
        unsafe { libc::munmap(address, size as usize) };
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
