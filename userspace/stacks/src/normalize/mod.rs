//! Normalization: process addresses to (module, file offset), done on receipt.
//!
//! A process's address space is only readable while it lives, so every sample is
//! normalized as soon as it leaves the ring buffer. A (module, file offset) pair stays
//! meaningful after the process exits, and is what symbolization and pprof need.

use std::{
    collections::HashMap,
    fs::File,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use blazesym::normalize::{NormalizeOpts, Normalizer, UserMeta};

use allocbpf_images::procfs::{self, MapsEntry};
use allocbpf_images::sealed_copy::{self, FileIdentity};
use allocbpf_profile::frame::{Frame, Module};

/// Interned modules, shared by all samples.
///
/// A module is the file we opened: identified by our own descriptor's device, inode,
/// size and times ([`FileIdentity`]), so one library mapped by several processes is one
/// module, symbolized once, and two files are two modules whatever they say. Never by
/// build id: that is bytes in the file, and a stub library carrying libc's build id,
/// seen first, would otherwise symbolize every process's libc from the stub. The build
/// id stays the module's metadata (pprof mappings). A module whose file could not be
/// opened is keyed by its mapping's device, inode and path, and never symbolized.
/// While the process that maps it lives, its file is opened through
/// `/proc/PID/map_files/` and kept open, so it can be symbolized after the process
/// exits, and even if the file was deleted or replaced.
#[derive(Debug, Default)]
pub struct ModuleTable {
    modules: Vec<Module>,
    files: Vec<Option<Arc<File>>>,
    /// Each module's key in `index` (`None` once released).
    keys: Vec<Option<ModuleKey>>,
    /// Ids of modules released ([`ModuleTable::release_files`]), reused by the next
    /// modules interned: the table holds what current stacks refer to, not every file
    /// the host has run since the agent started.
    free: Vec<u32>,
    index: HashMap<ModuleKey, u32>,
    /// Modules by the device and inode of a mapping they were seen through: after the
    /// process exits its file can no longer be opened (map_files is gone), but the
    /// cached maps still say which file an address is in. The module's file, held
    /// open, keeps its inode from being reused.
    by_inode: HashMap<(u64, u64), u32>,
}

/// What makes two modules one.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum ModuleKey {
    /// The file we opened, as our descriptor's `fstat` says.
    File(FileIdentity),
    /// Not opened: the mapping's device and inode (as the maps print them) and path.
    Unopened {
        device: u64,
        inode: u64,
        path: PathBuf,
    },
    /// Not opened and no mapping known: its path (display only).
    Path(PathBuf),
}

impl ModuleTable {
    /// The id of `module`, seen through `mapping` whose file (opened through the
    /// mapping, [`procfs::open_mapped`], never by path) is `file`; added if new.
    pub fn intern(
        &mut self,
        module: Module,
        mapping: Option<&MapsEntry>,
        file: Option<Arc<File>>,
    ) -> u32 {
        let inode = mapping.map(|m| (m.device, m.inode));
        let identity = file.as_deref().and_then(|f| FileIdentity::of(f).ok());
        let file = file.filter(|_| identity.is_some());
        if identity.is_none() {
            // Not opened: the process may have exited since its maps were read. The
            // module of that very inode, if one was opened, is its file.
            if let Some(&id) = inode.and_then(|i| self.by_inode.get(&i)) {
                return id;
            }
        }
        let key = match (identity, mapping) {
            (Some(identity), _) => ModuleKey::File(identity),
            (None, Some(mapping)) => ModuleKey::Unopened {
                device: mapping.device,
                inode: mapping.inode,
                path: module.path.clone(),
            },
            (None, None) => ModuleKey::Path(module.path.clone()),
        };
        // A module keeps the file it was interned with: a later file is another module
        // unless it is the same file (same key).
        let id = match self.index.get(&key) {
            Some(&id) => id,
            None => {
                let id = match self.free.pop() {
                    Some(id) => {
                        self.files[id as usize] = file;
                        self.modules[id as usize] = module;
                        self.keys[id as usize] = Some(key.clone());
                        id
                    }
                    None => {
                        self.files.push(file);
                        self.modules.push(module);
                        self.keys.push(Some(key.clone()));
                        self.modules.len() as u32 - 1
                    }
                };
                self.index.insert(key, id);
                id
            }
        };
        if let Some(inode) = inode {
            self.by_inode.insert(inode, id);
        }
        id
    }

    /// The file kept open at intern time for module `id`, and its identity: what the
    /// symbolizer copies ([`allocbpf_images::sealed_copy`]) for blazesym to read. `None`
    /// if it could not be opened then: the module's path is another process's to point
    /// anywhere, and is never opened.
    pub fn file(&self, id: u32) -> Option<(&File, FileIdentity)> {
        let file = self.files.get(id as usize)?.as_deref()?;
        match self.keys.get(id as usize)? {
            Some(ModuleKey::File(identity)) => Some((file, *identity)),
            _ => None,
        }
    }

    /// Releases the modules `keep` rejects (no profile, live block or running process
    /// refers to them any more): their files are closed, and their entries and ids
    /// freed for reuse; returns how many files were closed. A module seen again is
    /// interned again, with a file. Descriptors and entries follow the current
    /// workload. The caller must hold no frame of a released module (cached
    /// normalizations included).
    pub fn release_files(&mut self, keep: impl Fn(u32) -> bool) -> usize {
        let mut closed = 0;
        let mut released = vec![false; self.modules.len()];
        for &id in &self.free {
            released[id as usize] = true;
        }
        for (id, released) in released.iter_mut().enumerate() {
            if *released || keep(id as u32) {
                continue;
            }
            if self.files[id].take().is_some() {
                closed += 1;
            }
            if let Some(key) = self.keys[id].take() {
                self.index.remove(&key);
            }
            self.modules[id] = Module {
                path: PathBuf::new(),
                build_id: None,
            };
            *released = true;
            self.free.push(id as u32);
        }
        self.by_inode.retain(|_, id| !released[*id as usize]);
        closed
    }

    /// Modules in the table now (released ones excluded).
    pub fn len(&self) -> usize {
        self.modules.len() - self.free.len()
    }

    /// True if no module is in the table.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Modules whose file is open now.
    pub fn open_files(&self) -> usize {
        self.files.iter().filter(|f| f.is_some()).count()
    }

    /// The module with this id.
    pub fn get(&self, id: u32) -> Option<&Module> {
        self.modules.get(id as usize)
    }

    /// All modules, indexed by id.
    pub fn all(&self) -> &[Module] {
        &self.modules
    }
}

/// How often the cached memory maps may be re-read when an address is not covered.
const MAPS_REFRESH_LIMIT: Duration = Duration::from_secs(1);

/// How often one process's maps may be read to tell whether an address it missed is in
/// a mapping made since (a library it loaded): then the caches are re-read at once.
const MISS_CHECK_LIMIT: Duration = Duration::from_millis(100);

/// Missed addresses of one stack asked about in a miss check at most.
const MISSED_QUERIED: usize = 16;

/// Processes whose last miss check is remembered at most (the checks' times are then
/// forgotten, which only allows one more check each).
const MAX_MISS_CHECKED: usize = 1 << 16;

/// Miss checks per second at most, all processes together: a host full of frame-pointer
/// garbage costs this many checks a second (each a few mapping queries, or a read of
/// the maps where the kernel has no query), not one per process per tenth.
const MAX_MISS_CHECKS_PER_SECOND: u32 = 200;

/// Turns process addresses into [`Frame`]s.
///
/// Memory maps are cached per process, so samples that arrive after their process
/// exited are still normalized with the maps it had. When an address falls outside
/// every cached mapping while the process still lives (a library loaded since), the
/// process's own maps are read (at most once per `MISS_CHECK_LIMIT`), and the caches
/// re-read at once if they now cover it with a file: the samples of a program that
/// just loaded a library (a Python import) are not left unknown. Only when the host's
/// checks are spent for the second are the caches re-read on a miss, at most once per
/// `MAPS_REFRESH_LIMIT`. Addresses that stay unknown are usually frame-pointer
/// garbage from code built without frame pointers.
pub struct AddressNormalizer {
    normalizer: Normalizer,
    refreshed: Instant,
    /// When each process's maps were last read to check a miss.
    miss_checked: HashMap<u32, Instant>,
    /// The second the miss checks are counted in, and how many it had.
    miss_checks: (Instant, u32),
    /// The mappings behind blazesym's `/proc/PID/map_files/START-END` paths (it reads
    /// build ids through them, never through the paths the maps print, which belong
    /// to the process), with their files opened while the process lives. Read from
    /// the process's maps at [`AddressNormalizer::prime`] or on a miss; reset with the
    /// normalizer, so bounded like its own cache.
    mappings: MappedFiles,
    /// Frames already normalized, by pid and address: a process's hot stacks repeat,
    /// and each blazesym call stats every module's map_files path (microseconds of the
    /// reader's time per sample). As valid as blazesym's cached maps, so reset with
    /// them, and a process's are dropped when it exits or execs; at most
    /// [`MAX_CACHED_FRAMES`] entries in all (`cached_frames`).
    resolved: HashMap<u32, HashMap<u64, Frame>>,
    cached_frames: usize,
    /// Modules seen so far.
    pub modules: ModuleTable,
}

/// Normalized frames kept at most (~40 bytes each): emptied when full.
const MAX_CACHED_FRAMES: usize = 1 << 17;

impl Default for AddressNormalizer {
    fn default() -> Self {
        Self::new()
    }
}

impl AddressNormalizer {
    /// A normalizer that reads build ids and caches maps and build ids.
    pub fn new() -> Self {
        Self {
            normalizer: Self::caching_normalizer(),
            refreshed: Instant::now(),
            miss_checked: HashMap::new(),
            miss_checks: (Instant::now(), 0),
            mappings: MappedFiles::default(),
            resolved: HashMap::new(),
            cached_frames: 0,
            modules: ModuleTable::default(),
        }
    }

    /// blazesym reads only the maps: it would read build ids by opening each
    /// module's map_files path itself, with none of `procfs::open_mapped`'s checks (a
    /// file on FUSE would stall it), so build ids come from [`MappedFiles`].
    fn caching_normalizer() -> Normalizer {
        Normalizer::builder()
            .enable_vma_caching(true)
            .enable_build_ids(false)
            .build()
    }

    /// Opens of mapped files that failed for want of descriptors so far.
    pub fn descriptor_errors(&self) -> u64 {
        self.mappings.descriptor_errors
    }

    /// Process maps read that were cut at their size cap so far.
    pub fn maps_cut(&self) -> u64 {
        self.mappings.maps_cut
    }

    /// Reads and caches `pid`'s memory maps now, while it lives.
    pub fn prime(&mut self, pid: u32) {
        let _ = self.normalize_once(pid, &[0]);
        self.mappings.read(pid);
    }

    /// Called when process `pid` exits or execs: drops its normalized frames now, and
    /// the cached maps of every process (blazesym caches per process and cannot forget
    /// one) at most once per `MAPS_REFRESH_LIMIT`, so the cache of a long-running
    /// agent stays bounded. The module table (what frames refer to) is kept.
    pub fn forget(&mut self, pid: u32) {
        if let Some(frames) = self.resolved.remove(&pid) {
            self.cached_frames -= frames.len();
        }
        self.miss_checked.remove(&pid);
        if self.refreshed.elapsed() >= MAPS_REFRESH_LIMIT {
            self.reset();
        }
    }

    /// Drops every cached map (blazesym's and ours).
    fn reset(&mut self) {
        self.normalizer = Self::caching_normalizer();
        self.mappings = MappedFiles {
            descriptor_errors: self.mappings.descriptor_errors,
            maps_cut: self.mappings.maps_cut,
            ..MappedFiles::default()
        };
        self.resolved = HashMap::new();
        self.cached_frames = 0;
        self.refreshed = Instant::now();
    }

    /// Releases the modules `keep` rejects ([`ModuleTable::release_files`]).
    /// The normalized frames cached so far are dropped with them: a cached frame may
    /// name a released module, whose id the next new module takes.
    pub fn release_module_files(&mut self, keep: impl Fn(u32) -> bool) -> usize {
        let before = self.modules.len();
        let closed = self.modules.release_files(keep);
        if closed > 0 || self.modules.len() != before {
            self.resolved.clear();
            self.cached_frames = 0;
        }
        closed
    }

    /// Normalizes `addrs` of process `pid`; addresses no mapping covers (or of a
    /// process never seen alive) come back as [`Frame::Unknown`].
    pub fn normalize(&mut self, pid: u32, addrs: &[u64]) -> Vec<Frame> {
        let cached = self.resolved.get(&pid);
        let mut frames: Vec<Frame> = addrs
            .iter()
            .map(|&a| {
                cached
                    .and_then(|c| c.get(&a))
                    .copied()
                    .unwrap_or(Frame::Unknown(a))
            })
            .collect();
        let missing: Vec<usize> = (0..addrs.len())
            .filter(|&i| matches!(frames[i], Frame::Unknown(_)))
            .collect();
        if missing.is_empty() {
            return frames;
        }
        let uncached: Vec<u64> = missing.iter().map(|&i| addrs[i]).collect();
        let resolved = self.normalize_uncached(pid, &uncached);
        if self.cached_frames + resolved.len() > MAX_CACHED_FRAMES {
            self.resolved.clear();
            self.cached_frames = 0;
        }
        let cache = self.resolved.entry(pid).or_default();
        for (&i, frame) in missing.iter().zip(resolved) {
            frames[i] = frame;
            if matches!(frame, Frame::Module { .. }) && cache.insert(addrs[i], frame).is_none() {
                self.cached_frames += 1;
            }
        }
        frames
    }

    /// [`AddressNormalizer::normalize`] through blazesym, re-reading the maps on a miss.
    fn normalize_uncached(&mut self, pid: u32, addrs: &[u64]) -> Vec<Frame> {
        let frames = self.normalize_once(pid, addrs);
        let missed: Vec<u64> = frames
            .iter()
            .filter_map(|f| match f {
                Frame::Unknown(address) => Some(*address),
                _ => None,
            })
            .collect();
        if missed.is_empty() {
            return frames;
        }
        // Re-read every cache only if the process's maps now cover a missed address
        // with a file mapped since, or (their check not allowed now) after a second:
        // frame-pointer garbage from code built without frame pointers misses at
        // every sample, and a reset per second for it re-read every process's maps.
        let reread = match self.newly_mapped(pid, &missed) {
            Some(newly) => newly,
            None => self.refreshed.elapsed() >= MAPS_REFRESH_LIMIT && procfs::is_alive(pid),
        };
        if reread {
            self.reset();
            return self.normalize_once(pid, addrs);
        }
        frames
    }

    /// Whether `pid`'s maps, read now, map one of the `missed` addresses from an
    /// executable file (the cached maps are older than that mapping): `false` within
    /// [`MISS_CHECK_LIMIT`] of its last check, `None` past
    /// [`MAX_MISS_CHECKS_PER_SECOND`] checks in all. (Anonymous code, a JIT's, never
    /// normalizes: it is no reason to re-read.)
    fn newly_mapped(&mut self, pid: u32, missed: &[u64]) -> Option<bool> {
        let now = Instant::now();
        if let Some(last) = self.miss_checked.get(&pid) {
            // Checked lately: had that check found the address mapped, the caches
            // would have been re-read then.
            if now.duration_since(*last) < MISS_CHECK_LIMIT {
                return Some(false);
            }
        }
        let (second, count) = &mut self.miss_checks;
        if now.duration_since(*second) >= Duration::from_secs(1) {
            (*second, *count) = (now, 0);
        }
        if *count >= MAX_MISS_CHECKS_PER_SECOND {
            return None;
        }
        *count += 1;
        if self.miss_checked.len() >= MAX_MISS_CHECKED {
            self.miss_checked.clear();
        }
        self.miss_checked.insert(pid, now);
        // The kernel's mapping query, an ioctl a missed address (the first few: a
        // library mapped since shows in most of a stack's misses); else the maps'
        // text, charged as the ten queries it costs about.
        let asked = &missed[..missed.len().min(MISSED_QUERIED)];
        if let Ok(found) = procfs::procmap::any_in_executable_file(pid, asked) {
            return Some(found);
        }
        self.miss_checks.1 += 9;
        let maps = procfs::read_maps_counting_cuts(pid, &mut self.mappings.maps_cut);
        Some(maps.iter().any(|entry| {
            entry.executable
                && entry.inode != 0
                && missed.iter().any(|address| entry.range.contains(address))
        }))
    }

    fn normalize_once(&mut self, pid: u32, addrs: &[u64]) -> Vec<Frame> {
        let unknown = || addrs.iter().map(|&a| Frame::Unknown(a)).collect();
        if addrs.is_empty() {
            return Vec::new();
        }
        // map_files: blazesym reads build ids through the mapping itself.
        let opts = NormalizeOpts {
            map_files: true,
            ..Default::default()
        };
        let Self {
            normalizer,
            mappings,
            modules,
            ..
        } = self;
        let Ok(output) = normalizer.normalize_user_addrs_opts(pid.into(), addrs, &opts) else {
            return unknown();
        };
        let mut ids: HashMap<usize, Option<u32>> = HashMap::new();
        let mut frames = Vec::with_capacity(addrs.len());
        for (&(offset, meta_index), &addr) in output.outputs.iter().zip(addrs) {
            let id = match ids.get(&meta_index) {
                Some(&id) => id,
                None => {
                    let id = match output.meta.get(meta_index) {
                        Some(UserMeta::Elf(elf)) => {
                            let mapped = mappings.get(pid, &elf.path);
                            // The path as the process names it, for display only.
                            let path = mapped
                                .as_ref()
                                .and_then(|(m, _)| m.file_path())
                                .map_or_else(|| elf.path.clone(), Path::to_path_buf);
                            let (mapping, opened) = mapped.unzip();
                            let opened = opened.unwrap_or_default();
                            let module = Module {
                                path,
                                build_id: opened.build_id,
                            };
                            Some(modules.intern(module, mapping.as_ref(), opened.file))
                        }
                        _ => None,
                    };
                    ids.insert(meta_index, id);
                    id
                }
            };
            frames.push(match id {
                Some(module) => Frame::Module { module, offset },
                None => Frame::Unknown(addr),
            });
        }
        frames
    }
}

/// A mapped file as opened by `procfs::open_mapped` (`None` if it was refused or is
/// gone), and its GNU build id.
#[derive(Clone, Debug, Default)]
struct OpenedFile {
    file: Option<Arc<File>>,
    build_id: Option<Vec<u8>>,
}

impl OpenedFile {
    /// Opens `pid`'s mapping `entry`; a failure for want of descriptors adds one to
    /// `descriptor_errors`.
    fn open(pid: u32, entry: &MapsEntry, descriptor_errors: &mut u64) -> OpenedFile {
        let file = procfs::open_mapped(pid, entry)
            .map_err(|error| {
                *descriptor_errors += u64::from(error.out_of_descriptors());
                tracing::debug!("pid {pid}: {error}");
            })
            .ok();
        let build_id = file.as_ref().and_then(sealed_copy::read_build_id);
        OpenedFile {
            file: file.map(Arc::new),
            build_id,
        }
    }
}

/// Mappings of processes by blazesym's map_files path, with their files.
#[derive(Debug, Default)]
struct MappedFiles {
    by_path: HashMap<PathBuf, (MapsEntry, OpenedFile)>,
    /// One open file per device and inode.
    files: HashMap<(u64, u64), OpenedFile>,
    /// Opens that failed for want of descriptors so far.
    descriptor_errors: u64,
    /// Process maps read that were cut at their size cap so far.
    maps_cut: u64,
}

/// Distinct files held open for symbolization at most. A process may map tens of
/// thousands of executable files (each a descriptor here, and a read of its build id):
/// past this many, further files are not opened and their frames stay unsymbolized
/// (module + offset), until the periodic release of unused files makes room.
const MAX_OPEN_MAPPED_FILES: usize = 8192;

impl MappedFiles {
    /// Reads `pid`'s executable file mappings and opens their files (at most
    /// [`MAX_OPEN_MAPPED_FILES`] in all).
    fn read(&mut self, pid: u32) {
        for entry in procfs::read_maps_counting_cuts(pid, &mut self.maps_cut) {
            if !entry.executable || entry.file_path().is_none() {
                continue;
            }
            let full = self.files.len() >= MAX_OPEN_MAPPED_FILES;
            if full && !self.files.contains_key(&(entry.device, entry.inode)) {
                tracing::debug!(
                    "pid {pid}: {} not opened: {MAX_OPEN_MAPPED_FILES} mapped files are open",
                    entry.name.to_string_lossy()
                );
                self.by_path.insert(
                    PathBuf::from(entry.map_files_path(pid)),
                    (entry, OpenedFile::default()),
                );
                continue;
            }
            let file = self
                .files
                .entry((entry.device, entry.inode))
                .or_insert_with(|| OpenedFile::open(pid, &entry, &mut self.descriptor_errors))
                .clone();
            self.by_path
                .insert(PathBuf::from(entry.map_files_path(pid)), (entry, file));
        }
    }

    /// The mapping of `pid` behind blazesym's map_files path `path`, and its file.
    fn get(&mut self, pid: u32, path: &Path) -> Option<(MapsEntry, OpenedFile)> {
        if !self.by_path.contains_key(path) {
            self.read(pid);
        }
        self.by_path.get(path).cloned()
    }
}

#[cfg(test)]
mod tests;
