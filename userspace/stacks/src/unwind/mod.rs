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
//! build id (or path for files without one) in a cache bounded in bytes ([`cache`]), so
//! many processes of one program share one copy.
//!
//! One more rule comes from the code itself: an allocation entry left unprobed because
//! every block it returns comes from a probed entry it *calls* (musl's `calloc` calls
//! `malloc`) has its frame at that call derived by [`allocbpf_probe::image`] (a
//! [`CallFrame`]), since musl has neither unwind tables nor frame pointers. A stack
//! sampled in `malloc` steps through `calloc` by that rule.

use std::{
    collections::HashMap,
    ops::Range,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use framehop::{
    x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64},
    ExplicitModuleSectionInfo, FrameAddress, Module, Unwinder,
};
use object::{Object, ObjectSection, ObjectSegment};

use allocbpf_probe::image::{self, CallFrame, Lookup};
use allocbpf_probe::procfs::{self, MapsEntry};

mod cache;

use cache::{LruCache, MAX_CACHED_BYTES};

/// Return addresses produced at most per stack.
const MAX_FRAMES: usize = 127;
/// Module lists re-read at most this often per process.
const REFRESH_EVERY: Duration = Duration::from_secs(1);

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
    fn read(data: &[u8], lookup: &Lookup) -> Option<FileSections> {
        let file = object::File::parse(data).ok()?;
        let call_frames = image::resolve_entries(&file, data, lookup)
            .map(|entries| entries.call_frames)
            .unwrap_or_default()
            .into_iter()
            .map(|frame| (frame.return_address, frame))
            .collect();
        let section = |name: &str| {
            let s = file.section_by_name(name)?;
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
    processes: HashMap<u32, ProcessModules>,
    /// Stacks unwound, and time spent (for `-v` logs and the benchmark figures).
    pub unwound: u64,
    /// Time spent unwinding.
    pub elapsed: Duration,
}

/// Identity of a file: its GNU build id, or its path when it has none.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum FileKey {
    BuildId(Vec<u8>),
    Path(PathBuf),
}

/// The GNU build id note of an ELF file, if any.
fn build_id(data: &[u8]) -> Option<Vec<u8>> {
    let file = object::File::parse(data).ok()?;
    file.build_id().ok().flatten().map(<[u8]>::to_vec)
}

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
            processes: HashMap::new(),
            unwound: 0,
            elapsed: Duration::ZERO,
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
        // The process's own view: works for deleted/replaced files and containers.
        let path = mapping.file_path()?;
        let data = procfs::open_mapped(pid, mapping)
            .and_then(|file| procfs::read_mapped(&file, path))
            .map_err(|error| tracing::debug!("pid {pid}: {error}"))
            .ok()?;
        let key = match build_id(&data) {
            Some(id) => FileKey::BuildId(id),
            None => FileKey::Path(path.to_path_buf()),
        };
        let sections = match self.files.get(&key) {
            Some(sections) => sections,
            None => {
                let sections = Arc::new(FileSections::read(&data, &self.lookup)?);
                self.files.insert(key.clone(), sections.clone());
                sections
            }
        };
        self.files.index(inode, key);
        Some(sections)
    }

    /// Drops `pid`'s modules (it exited or exec'd).
    pub fn forget(&mut self, pid: u32) {
        self.processes.remove(&pid);
    }

    fn refresh(&mut self, pid: u32) {
        let mappings: Vec<MapsEntry> = procfs::read_maps(pid)
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
                mapping.name.clone(),
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
