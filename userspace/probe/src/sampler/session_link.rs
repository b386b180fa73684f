//! uprobe session and uprobe_multi links, created through the bpf syscall.
//!
//! A session link (kernel 6.13+) runs one program at a function's entry and, only if
//! that run returned 0, again at its return. That is what live tracking needs: only
//! sampled calls pay for the return. A uprobe_multi link (kernel 6.6+) puts one program
//! on many offsets of a file; closing it removes every breakpoint at once and waits for
//! the kernel's grace period once, where closing one aya (perf event) uprobe per entry
//! waits a grace period per probe under a global lock (docs/benchmarks.md has the
//! figures), with the later probes still trapping
//! meanwhile: the overhead budget's windows detach images every period, so they use
//! these. aya 0.14 can neither load a program with those expected attach types (the
//! kernel requires them) nor create such links, so this module does both itself: it
//! relocates the program from the same embedded object with `aya-obj` against the maps
//! aya already created (so both sides share every map, including `.rodata` with its
//! globals set), loads it with `BPF_PROG_LOAD`, and links it with `BPF_LINK_CREATE`.
//! The programs aya loads are used for everything else.

use std::{
    collections::{HashMap, HashSet},
    ffi::CString,
    io,
    os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd},
    path::Path,
};

use aya::{maps::Map, Ebpf};

/// `BPF_PROG_TYPE_KPROBE`: uprobe programs are kprobe programs.
const BPF_PROG_TYPE_KPROBE: u32 = 2;
/// `BPF_TRACE_UPROBE_MULTI` in `enum bpf_attach_type` (Linux 6.6).
const BPF_TRACE_UPROBE_MULTI: u32 = 48;
/// `BPF_TRACE_UPROBE_SESSION` in `enum bpf_attach_type` (Linux 6.13).
const BPF_TRACE_UPROBE_SESSION: u32 = 57;

/// Which kind of link a [`SessionPrograms`] makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkKind {
    /// uprobe session links (entry and, for sampled calls, return).
    Session,
    /// uprobe_multi links (entry only, many offsets per link).
    Multi,
}

impl LinkKind {
    fn attach_type(self) -> u32 {
        match self {
            LinkKind::Session => BPF_TRACE_UPROBE_SESSION,
            LinkKind::Multi => BPF_TRACE_UPROBE_MULTI,
        }
    }
}
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_LINK_CREATE: libc::c_long = 28;

/// Why a session link could not be made. Callers fall back to uretprobes.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// The object could not be relocated.
    #[error("relocating {program} for a session link: {reason}")]
    Relocate {
        /// Program name.
        program: String,
        /// What failed.
        reason: String,
    },
    /// The kernel refused the program (old kernel: unknown attach type).
    #[error(
        "the kernel refused {program} as a uprobe session or multi program: {source}; verifier log: {log}"
    )]
    Load {
        /// Program name.
        program: String,
        /// The errno.
        source: io::Error,
        /// The verifier's log, if any.
        log: String,
    },
    /// The kernel refused the link.
    #[error("the kernel refused a uprobe session or multi link for {program}: {source}")]
    Link {
        /// Program name.
        program: String,
        /// The errno.
        source: io::Error,
    },
}

/// The BPF_PROG_LOAD prefix of `union bpf_attr` that we use (the kernel zero-fills the
/// fields after `size`).
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

/// The BPF_LINK_CREATE prefix of `union bpf_attr` with its `uprobe_multi` member.
#[repr(C)]
#[derive(Default)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_fd: u32,
    attach_type: u32,
    flags: u32,
    path: u64,
    offsets: u64,
    ref_ctr_offsets: u64,
    cookies: u64,
    cnt: u32,
    multi_flags: u32,
    pid: u32,
    pad: u32,
}

fn bpf<T>(command: libc::c_long, attr: &mut T) -> io::Result<OwnedFd> {
    // SAFETY: `attr` is a valid, initialised bpf_attr prefix of the given size that
    // outlives the call; pointers inside it point at live buffers.
    let fd = unsafe { super::bpf_syscall::bpf(command, attr)? };
    // SAFETY: a new fd the kernel just returned to us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// True if the kernel knows uprobe session programs (Linux 6.13+): it accepts a
/// two-instruction program (`r0 = 0; exit`) with that expected attach type. Like
/// libbpf's feature probes, this is decided once, before anything else is loaded.
pub fn kernel_supports_sessions() -> bool {
    kernel_supports(LinkKind::Session)
}

/// True if the kernel has uprobe_multi links that filter by process (libbpf's probe):
/// a program of that type loads, a link on `/` fails with EBADF (the attach type is
/// known; `/` is not an ELF file), and again with pid -1 fails with EINVAL (kernels
/// before the fix of "bpf: fix multi-uprobe PID filtering logic" filtered by thread,
/// and would see only a target's main thread).
pub fn kernel_supports_multi_links() -> bool {
    let Ok(program) = load_trivial(LinkKind::Multi) else {
        return false;
    };
    let path = c"/";
    let offsets = [0u64];
    let link = |pid: u32| {
        let mut attr = LinkCreateAttr {
            prog_fd: program.as_raw_fd() as u32,
            attach_type: BPF_TRACE_UPROBE_MULTI,
            path: path.as_ptr() as u64,
            offsets: offsets.as_ptr() as u64,
            cnt: 1,
            pid,
            ..Default::default()
        };
        bpf(BPF_LINK_CREATE, &mut attr).map(drop).err()
    };
    let errno = |error: Option<io::Error>| error.and_then(|e| e.raw_os_error());
    errno(link(0)) == Some(libc::EBADF) && errno(link(u32::MAX)) == Some(libc::EINVAL)
}

/// True if the kernel loads programs for `kind` links (same probe as above).
pub fn kernel_supports(kind: LinkKind) -> bool {
    load_trivial(kind).is_ok()
}

/// Loads a two-instruction program (`r0 = 0; exit`) with `kind`'s expected attach type,
/// the feature probes' program.
fn load_trivial(kind: LinkKind) -> io::Result<OwnedFd> {
    // mov64 r0, 0 ; exit
    let insns: [u64; 2] = [u64::from_le_bytes([0xb7, 0, 0, 0, 0, 0, 0, 0]), 0x95];
    let license = c"GPL";
    let mut attr = ProgLoadAttr {
        prog_type: BPF_PROG_TYPE_KPROBE,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        expected_attach_type: kind.attach_type(),
        ..Default::default()
    };
    bpf(BPF_PROG_LOAD, &mut attr)
}

/// The raw fd of any aya map.
fn map_fd(map: &Map) -> RawFd {
    let data = match map {
        Map::Array(m)
        | Map::ArrayOfMaps(m)
        | Map::BloomFilter(m)
        | Map::CgroupArray(m)
        | Map::CgroupStorage(m)
        | Map::CgrpStorage(m)
        | Map::CpuMap(m)
        | Map::DevMap(m)
        | Map::DevMapHash(m)
        | Map::HashMap(m)
        | Map::HashOfMaps(m)
        | Map::InodeStorage(m)
        | Map::LpmTrie(m)
        | Map::LruHashMap(m)
        | Map::PerCpuArray(m)
        | Map::PerCpuCgroupStorage(m)
        | Map::PerCpuHashMap(m)
        | Map::PerCpuLruHashMap(m)
        | Map::PerfEventArray(m)
        | Map::ProgramArray(m)
        | Map::Queue(m)
        | Map::ReusePortSockArray(m)
        | Map::RingBuf(m)
        | Map::SockHash(m)
        | Map::SockMap(m)
        | Map::SkStorage(m)
        | Map::Stack(m)
        | Map::StackTraceMap(m)
        | Map::Unsupported(m)
        | Map::XskMap(m) => m,
    };
    data.fd().as_fd().as_raw_fd()
}

/// Loads program `name` of the relocated `object` with `kind`'s expected attach type;
/// on failure, loads it again with the verifier's log for the message.
fn load_program(
    object: &aya_obj::Object,
    kind: LinkKind,
    name: &str,
) -> Result<OwnedFd, SessionError> {
    let program = object
        .programs
        .get(name)
        .ok_or_else(|| SessionError::Relocate {
            program: name.into(),
            reason: "no such program in the object".into(),
        })?;
    let function = &object.functions[&program.function_key()];
    let license = c"GPL";
    let mut prog_name = [0u8; 16];
    for (dst, src) in prog_name.iter_mut().zip(name.bytes().take(15)) {
        *dst = src;
    }
    let load = |log: Option<&mut Vec<u8>>| {
        let (log_level, log_size, log_buf) = match log {
            Some(log) => (1, log.len() as u32, log.as_mut_ptr() as u64),
            None => (0, 0, 0),
        };
        let mut attr = ProgLoadAttr {
            prog_type: BPF_PROG_TYPE_KPROBE,
            insn_cnt: function.instructions.len() as u32,
            insns: function.instructions.as_ptr() as u64,
            license: license.as_ptr() as u64,
            log_level,
            log_size,
            log_buf,
            prog_name,
            expected_attach_type: kind.attach_type(),
            ..Default::default()
        };
        bpf(BPF_PROG_LOAD, &mut attr)
    };
    load(None).map_err(|source| {
        let mut log = vec![0u8; 1 << 20];
        let _ = load(Some(&mut log));
        let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
        let text = String::from_utf8_lossy(&log[..end]);
        let tail: String = text.lines().rev().take(8).collect::<Vec<_>>().join(" | ");
        SessionError::Load {
            program: name.into(),
            source,
            log: tail,
        }
    })
}

/// Programs relocated from the embedded object against `ebpf`'s maps, loaded for one
/// [`LinkKind`].
pub struct SessionPrograms {
    object: aya_obj::Object,
    kind: LinkKind,
    loaded: HashMap<String, OwnedFd>,
}

impl SessionPrograms {
    /// Relocates the object's programs against the maps `ebpf` created. `ebpf` must
    /// have been loaded from `object_bytes` (same maps, same globals).
    pub fn relocate(
        object_bytes: &[u8],
        ebpf: &Ebpf,
        kind: LinkKind,
    ) -> Result<SessionPrograms, SessionError> {
        let error = |reason: String| SessionError::Relocate {
            program: "(object)".into(),
            reason,
        };
        let mut object = aya_obj::Object::parse(object_bytes).map_err(|e| error(e.to_string()))?;
        let fds: HashMap<&str, RawFd> = ebpf.maps().map(|(name, m)| (name, map_fd(m))).collect();
        let maps = object.maps.clone();
        let mut missing = Vec::new();
        let with_fds: Vec<(&str, RawFd, &aya_obj::Map)> = maps
            .iter()
            .filter_map(|(name, map)| match fds.get(name.as_str()) {
                Some(&fd) => Some((name.as_str(), fd, map)),
                None => {
                    missing.push(name.clone());
                    None
                }
            })
            .collect();
        if !missing.is_empty() {
            return Err(error(format!("maps not created by aya: {missing:?}")));
        }
        let text_sections: HashSet<usize> = object.functions.keys().map(|(s, _)| *s).collect();
        object
            .relocate_maps(with_fds.into_iter(), &text_sections)
            .map_err(|e| error(e.to_string()))?;
        object
            .relocate_calls(&text_sections)
            .map_err(|e| error(e.to_string()))?;
        Ok(SessionPrograms {
            object,
            kind,
            loaded: HashMap::new(),
        })
    }

    /// Loads `name` for this kind of link (once) and returns its fd.
    fn load(&mut self, name: &str) -> Result<RawFd, SessionError> {
        self.preload(&[name])?;
        Ok(self.loaded[name].as_raw_fd())
    }

    /// Loads every program of `names` not loaded yet, each on a thread of its own: the
    /// verifier takes tens of milliseconds per program and works on one CPU, so a
    /// target's programs verified together are live sooner (docs/design.md,
    /// "Attaching and detaching").
    pub fn preload(&mut self, names: &[&str]) -> Result<(), SessionError> {
        let mut missing: Vec<&str> = names
            .iter()
            .copied()
            .filter(|name| !self.loaded.contains_key(*name))
            .collect();
        missing.sort_unstable();
        missing.dedup();
        let (object, kind) = (&self.object, self.kind);
        let results: Vec<(&str, Result<OwnedFd, SessionError>)> = match missing.as_slice() {
            [] => return Ok(()),
            [name] => vec![(name, load_program(object, kind, name))],
            _ => std::thread::scope(|scope| {
                let handles: Vec<_> = missing
                    .iter()
                    .map(|&name| (name, scope.spawn(move || load_program(object, kind, name))))
                    .collect();
                handles
                    .into_iter()
                    .map(|(name, handle)| {
                        let result = handle.join().unwrap_or_else(|_| {
                            Err(SessionError::Relocate {
                                program: name.into(),
                                reason: "its loading thread panicked".into(),
                            })
                        });
                        (name, result)
                    })
                    .collect()
            }),
        };
        for (name, result) in results {
            self.loaded.insert(name.to_string(), result?);
        }
        Ok(())
    }

    /// Attaches program `name` at `offset` of the ELF file `path` as one link, for
    /// `pid` only (or every process for `None`). The link lives as long as the fd.
    pub fn attach(
        &mut self,
        name: &str,
        path: &Path,
        offset: u64,
        cookie: u64,
        pid: Option<u32>,
    ) -> Result<OwnedFd, SessionError> {
        self.attach_many(name, path, &[offset], &[cookie], pid)
    }

    /// Attaches program `name` at every offset of `offsets` (with the cookie at the
    /// same index) of the ELF file `path` as one link.
    pub fn attach_many(
        &mut self,
        name: &str,
        path: &Path,
        offsets: &[u64],
        cookies: &[u64],
        pid: Option<u32>,
    ) -> Result<OwnedFd, SessionError> {
        assert_eq!(offsets.len(), cookies.len(), "one cookie per offset");
        let prog_fd = self.load(name)?;
        let c_path = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| {
            SessionError::Relocate {
                program: name.into(),
                reason: format!("path {} has a NUL byte", path.display()),
            }
        })?;
        let mut attr = LinkCreateAttr {
            prog_fd: prog_fd as u32,
            attach_type: self.kind.attach_type(),
            path: c_path.as_ptr() as u64,
            offsets: offsets.as_ptr() as u64,
            cookies: cookies.as_ptr() as u64,
            cnt: offsets.len() as u32,
            pid: pid.unwrap_or(0),
            ..Default::default()
        };
        bpf(BPF_LINK_CREATE, &mut attr).map_err(|source| SessionError::Link {
            program: name.into(),
            source,
        })
    }
}
