//! Is a process a CPython interpreter, and where are its runtime, its code type and its
//! eval loop? Found from the dynamic symbols of the file that defines `_PyRuntime` (the
//! executable, as Debian links it, or `libpython3.x.so`): no debug symbols needed.
//!
//! Files are read through the kernel's link to the very file mapped
//! (`allocbpf_images::procfs::open_mapped`: checked, size-capped); the runtime's
//! pointers are read from the process's memory and believed only as far as the eBPF
//! walk needs them (it checks the thread state against the thread it samples).

use std::{ops::Range, path::Path};

use allocbpf_common::python::{PythonWalk, NO_OFFSET};
use allocbpf_images::{
    image::inlined::{self, Usedpools},
    procfs::{self, MapsEntry},
};
use allocbpf_runtime::toolkit::{cache::ENTRY_OVERHEAD, ByteCache, RemoteMemory};
use object::{Object, ObjectSegment, ObjectSymbol};

use crate::{layout::Layout, memory::ProcessMemory, pools::usedpools_address};

/// Where libc's thread descriptor (`struct pthread`) keeps the kernel thread id in
/// glibc on x86-64; used before 3.11 (no `native_thread_id`) when the descriptor of
/// no thread could be read to find it.
const GLIBC_PTHREAD_TID: u32 = 0x2d0;

/// Bytes of a thread descriptor searched for its thread id.
const PTHREAD_SEARCH_BYTES: usize = 2048;

/// Thread states followed at most when looking at a process's threads.
const MAX_THREAD_STATES: usize = 256;

/// A CPython process, as the walk and the resolution of its frames need it.
#[derive(Clone, Debug)]
pub struct PythonProcess {
    /// Process id.
    pub pid: u32,
    /// `3.minor`.
    pub minor: u8,
    /// Its structures' offsets.
    pub layout: &'static Layout,
    /// What the eBPF program follows at a sample.
    pub walk: PythonWalk,
    /// Address of `PyCode_Type`: a frame's code object must have it as its type.
    pub code_type: u64,
    /// Address of `PyUnicode_Type`, when exported: names must be `str`.
    pub unicode_type: Option<u64>,
    /// The eval loop's code (`_PyEval_EvalFrameDefault`): the native frames that the
    /// Python frames replace.
    pub eval_loop: Option<Range<u64>>,
    /// The file that holds the interpreter.
    pub image: std::path::PathBuf,
}

/// Why a process that looks like Python gets no Python frames.
#[derive(Clone, Debug, thiserror::Error)]
pub enum PythonError {
    /// A version this build has no layout for.
    #[error("CPython 3.{minor} is not a version allocbpf knows the layout of (3.9 to 3.13)")]
    UnknownVersion {
        /// The minor version found.
        minor: u8,
    },
    /// The file defines `_PyRuntime` but its version could not be told.
    #[error("{path}: defines _PyRuntime but no Py_Version and no python3.N name")]
    NoVersion {
        /// The interpreter's file.
        path: String,
    },
    /// The file lacks a symbol the resolution needs.
    #[error("{path}: defines _PyRuntime but not {symbol}")]
    NoSymbol {
        /// The interpreter's file.
        path: String,
        /// The symbol.
        symbol: &'static str,
    },
    /// The process's memory did not hold what the layout says.
    #[error("pid {pid}: {what} could not be read from the interpreter's memory")]
    Unreadable {
        /// Process id.
        pid: u32,
        /// What.
        what: &'static str,
    },
}

/// What an interpreter's file says, whichever process maps it: its version and the
/// addresses (in the file) of the symbols the walk and the resolution need.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InterpreterFile {
    /// `3.minor`.
    pub minor: u8,
    /// `_PyRuntime`.
    runtime: u64,
    /// `PyCode_Type`.
    code_type: u64,
    /// `PyUnicode_Type`, when exported.
    unicode_type: Option<u64>,
    /// `_PyEval_EvalFrameDefault`: address and size.
    eval_loop: Option<(u64, u64)>,
    /// The lowest address of its loadable segments (mapped at file offset 0).
    first_address: u64,
    /// Where its pymalloc's `usedpools` is, when its allocator is inlined.
    usedpools: Option<Usedpools>,
}

/// What examining one file found: an interpreter's, another file (`None`), or why an
/// interpreter's cannot be read.
type Examined = Result<Option<InterpreterFile>, PythonError>;

/// What one examined file realistically costs in the cache: the entry, a path of a
/// couple of hundred bytes when it holds an error, and the cache's own bookkeeping.
const TYPICAL_FILE_BYTES: usize = size_of::<Examined>() + 192 + ENTRY_OVERHEAD;

/// Bytes of interpreter files remembered (by device and inode): as many realistic
/// entries as the 64 files the cache was bounded by when it counted entries. A host
/// runs a handful of interpreters in many processes, and each file is read once rather
/// than per process; files whose names say Python but hold no interpreter (extension
/// modules, `*.cpython-*.so`) take entries too, and are the first to go when they are
/// not seen again.
const MAX_FILES_BYTES: usize = 64 * TYPICAL_FILE_BYTES;

/// The bytes one examined file holds: the entry, and the path an error keeps.
fn examined_bytes(examined: &Examined) -> usize {
    let path = match examined {
        Err(PythonError::NoVersion { path } | PythonError::NoSymbol { path, .. }) => path.len(),
        Ok(_) | Err(PythonError::UnknownVersion { .. } | PythonError::Unreadable { .. }) => 0,
    };
    size_of::<Examined>() + path
}

/// Interpreter files examined, by (device, inode): `None` for a file that is not one.
pub struct InterpreterFiles {
    files: ByteCache<(u64, u64), Examined>,
    /// Opens that failed for want of descriptors so far.
    descriptor_errors: u64,
}

impl Default for InterpreterFiles {
    fn default() -> Self {
        Self {
            files: ByteCache::new(MAX_FILES_BYTES),
            descriptor_errors: 0,
        }
    }
}

impl InterpreterFiles {
    /// The interpreter in `pid`'s mappings, if any: `Ok(None)` when no mapped file
    /// whose name says Python defines `_PyRuntime`.
    pub fn discover(
        &mut self,
        pid: u32,
        maps: &[MapsEntry],
    ) -> Result<Option<PythonProcess>, PythonError> {
        let mut seen = Vec::new();
        for mapping in maps {
            let Some(path) = mapping.file_path() else {
                continue;
            };
            let key = (mapping.device, mapping.inode);
            if mapping.offset != 0 || seen.contains(&key) || !names_python(path) {
                continue;
            }
            seen.push(key);
            let examined = match self.files.get(&key) {
                Some(examined) => examined.clone(),
                None => {
                    let examined = examine(pid, mapping, path, &mut self.descriptor_errors);
                    let bytes = examined_bytes(&examined);
                    self.files.insert(key, examined.clone(), bytes);
                    examined
                }
            };
            let file = match examined {
                Ok(Some(file)) => file,
                Ok(None) => continue,
                Err(error) => return Err(error),
            };
            return in_process(pid, mapping, path, &file).map(Some);
        }
        Ok(None)
    }

    /// Opens of interpreter files that failed for want of descriptors so far.
    pub fn descriptor_errors(&self) -> u64 {
        self.descriptor_errors
    }
}

/// Reads one mapped file: an interpreter's, or `Ok(None)`; an open that fails for want
/// of descriptors adds one to `descriptor_errors`.
fn examine(
    pid: u32,
    mapping: &MapsEntry,
    path: &Path,
    descriptor_errors: &mut u64,
) -> Result<Option<InterpreterFile>, PythonError> {
    let Some(data) = procfs::read_mapped_file(pid, mapping, path, descriptor_errors) else {
        return Ok(None);
    };
    let Ok(elf) = object::File::parse(&*data) else {
        return Ok(None);
    };
    let symbol = |name: &str| {
        elf.dynamic_symbols()
            .find(|s| s.name() == Ok(name) && s.is_definition())
            .map(|s| (s.address(), s.size()))
    };
    let Some((runtime, _)) = symbol("_PyRuntime") else {
        return Ok(None);
    };
    let minor = match symbol("Py_Version").and_then(|(address, _)| read_u32(&elf, address)) {
        Some(hex) if hex >> 24 == 3 => ((hex >> 16) & 0xff) as u8,
        _ => minor_from_name(path).ok_or_else(|| PythonError::NoVersion {
            path: path.display().to_string(),
        })?,
    };
    let code_type = symbol("PyCode_Type").ok_or(PythonError::NoSymbol {
        path: path.display().to_string(),
        symbol: "PyCode_Type",
    })?;
    Ok(Some(InterpreterFile {
        minor,
        runtime,
        code_type: code_type.0,
        unicode_type: symbol("PyUnicode_Type").map(|(address, _)| address),
        eval_loop: symbol("_PyEval_EvalFrameDefault"),
        first_address: elf.segments().map(|s| s.address()).min().unwrap_or(0),
        usedpools: inlined::usedpools(&elf),
    }))
}

/// `file`, mapped by `pid` at `mapping` (its first page), as that process's interpreter.
fn in_process(
    pid: u32,
    mapping: &MapsEntry,
    path: &Path,
    file: &InterpreterFile,
) -> Result<PythonProcess, PythonError> {
    let minor = file.minor;
    let layout = crate::layout::for_minor(minor).ok_or(PythonError::UnknownVersion { minor })?;
    // The first loadable segment starts at file offset 0, as this mapping does.
    let bias = mapping
        .range
        .start
        .wrapping_sub(file.first_address & !0xfff);
    Ok(PythonProcess {
        pid,
        minor,
        layout,
        walk: walk_of(
            &ProcessMemory::new(pid),
            pid,
            layout,
            bias.wrapping_add(file.runtime),
            |memory, interpreter| {
                let address = usedpools_address(memory, file.usedpools, bias, interpreter);
                if address == 0 && file.usedpools.is_some() {
                    tracing::info!(
                        "pid {pid}: pymalloc's usedpools is not where {} says: --live does \
                         not track its inlined small objects",
                        path.display()
                    );
                }
                address
            },
        )?,
        code_type: bias.wrapping_add(file.code_type),
        unicode_type: file.unicode_type.map(|a| bias.wrapping_add(a)),
        eval_loop: file
            .eval_loop
            .map(|(a, size)| bias.wrapping_add(a)..bias.wrapping_add(a.wrapping_add(size.max(1)))),
        image: path.to_path_buf(),
    })
}

/// A file name that can hold an interpreter: `python3.11`, `libpython3.11.so.1.0`,
/// `python3.13-dbg`... (a cheap filter before any file is read).
fn names_python(path: &Path) -> bool {
    path.file_name()
        .and_then(|name| name.to_str())
        .is_some_and(|name| name.contains("python"))
}

/// `11` of `python3.11` or `libpython3.11.so.1.0`.
fn minor_from_name(path: &Path) -> Option<u8> {
    let name = path.file_name()?.to_str()?;
    let rest = &name[name.find("python3.")? + "python3.".len()..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// The u32 at virtual address `address` in the file's data.
fn read_u32(elf: &object::File, address: u64) -> Option<u32> {
    elf.segments().find_map(|segment| {
        let data = segment.data_range(address, 4).ok()??;
        Some(u32::from_le_bytes(data.try_into().ok()?))
    })
}

/// The walk of process `pid`, whose memory `memory` reads, whose `_PyRuntime` is at
/// `runtime`, and whose `usedpools` address `usedpools` tells from the main
/// interpreter's address.
fn walk_of(
    memory: &dyn RemoteMemory,
    pid: u32,
    layout: &Layout,
    runtime: u64,
    usedpools: impl Fn(&dyn RemoteMemory, u64) -> u64,
) -> Result<PythonWalk, PythonError> {
    let unreadable = |what| PythonError::Unreadable { pid, what };
    // Every address below is the process's to forge: sums wrap (and the reads of
    // what they name fail) rather than overflow.
    let interpreter = memory
        .u64(runtime.wrapping_add(layout.runtime_main_interpreter as u64))
        .map_err(|_| unreadable("the main interpreter"))?;
    let holder = match (layout.runtime_tstate_current, layout.interpreter_gil) {
        (Some(current), _) => runtime.wrapping_add(current as u64),
        (None, Some(gil)) => {
            let gil = memory
                .u64(interpreter.wrapping_add(gil as u64))
                .map_err(|_| unreadable("the GIL"))?;
            if gil == 0 {
                return Err(unreadable("the GIL"));
            }
            gil.wrapping_add(layout.gil_last_holder.unwrap_or(8) as u64)
        }
        (None, None) => return Err(unreadable("the GIL holder")),
    };
    let pthread_tid = match layout.thread_native_id {
        Some(_) => NO_OFFSET,
        None => thread_ids(pid)
            .and_then(|tids| pthread_tid_offset(memory, layout, interpreter, &tids))
            .unwrap_or(GLIBC_PTHREAD_TID),
    };
    let opt = |offset: Option<u32>| offset.unwrap_or(NO_OFFSET);
    Ok(PythonWalk {
        holder,
        threads_head: interpreter.wrapping_add(layout.interpreter_threads_head as u64),
        usedpools: usedpools(memory, interpreter),
        interpreter,
        thread_next: layout.thread_next,
        thread_native_id: opt(layout.thread_native_id),
        thread_pthread: layout.thread_pthread,
        pthread_tid,
        thread_frame: layout.thread_frame,
        cframe_current_frame: opt(layout.cframe_current_frame),
        frame_code: layout.frame_code,
        frame_back: layout.frame_back,
        frame_instruction: layout.frame_instruction,
        frame_owner: opt(layout.frame_owner),
    })
}

/// The ids of process `pid`'s threads, as its `/proc/<pid>/task` lists them.
fn thread_ids(pid: u32) -> Option<Vec<i32>> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    Some(
        tasks
            .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
            .collect(),
    )
}

/// Where the libc of the process whose memory `memory` reads keeps a thread's id in
/// its thread descriptor: the offset at which some thread state's descriptor holds one
/// of the process's thread ids `tids`.
fn pthread_tid_offset(
    memory: &dyn RemoteMemory,
    layout: &Layout,
    interpreter: u64,
    tids: &[i32],
) -> Option<u32> {
    let mut thread = memory
        .u64(interpreter.wrapping_add(layout.interpreter_threads_head as u64))
        .ok()?;
    let mut descriptor = vec![0u8; PTHREAD_SEARCH_BYTES];
    for _ in 0..MAX_THREAD_STATES {
        if thread == 0 {
            break;
        }
        let pthread = memory
            .u64(thread.wrapping_add(layout.thread_pthread as u64))
            .ok()?;
        if memory.read(pthread, &mut descriptor).is_ok() {
            let found = descriptor.chunks_exact(4).position(|word| {
                tids.contains(&i32::from_le_bytes(word.try_into().unwrap_or_default()))
            });
            // The descriptor starts with pointers (to itself first): a small offset is
            // a pointer's half, not the thread id.
            if let Some(index) = found.filter(|&i| i >= 4) {
                return Some(index as u32 * 4);
            }
        }
        thread = memory
            .u64(thread.wrapping_add(layout.thread_next as u64))
            .ok()?;
    }
    None
}

#[cfg(test)]
mod tests {
    use allocbpf_runtime::toolkit::FakeMemory;

    use super::*;

    /// Where the forged runtime, interpreter, GIL and thread states are.
    const RUNTIME: u64 = 0x50_0000;
    const INTERPRETER: u64 = 0x60_0000;
    const GIL: u64 = 0x70_0000;
    const THREAD: u64 = 0x80_0000;
    const PTHREAD: u64 = 0x90_0000;

    fn layout(minor: u8) -> &'static Layout {
        crate::layout::for_minor(minor).expect("a known version")
    }

    /// The walk of the forged process `memory` (pid 0: no thread of its own to read).
    fn walk(memory: &FakeMemory, minor: u8) -> Result<PythonWalk, PythonError> {
        walk_of(memory, 0, layout(minor), RUNTIME, |_, interpreter| {
            interpreter + 1
        })
    }

    /// A `_PyRuntime` whose main interpreter is `interpreter`, and the interpreter
    /// (room for its fields read) whose GIL pointer (3.12+) is `gil`.
    fn runtime(minor: u8, interpreter: u64, gil: u64) -> FakeMemory {
        let layout = layout(minor);
        let mut memory = FakeMemory::new();
        memory
            .map(RUNTIME, vec![0u8; 1024])
            .write_u64(
                RUNTIME + layout.runtime_main_interpreter as u64,
                interpreter,
            )
            .map(INTERPRETER, vec![0u8; 8192]);
        if let Some(at) = layout.interpreter_gil {
            memory.write_u64(INTERPRETER + at as u64, gil);
        }
        memory
    }

    #[test]
    fn walks_are_read_from_a_forged_runtime() {
        // 3.11: the GIL holder is a field of the runtime.
        let walk11 = walk(&runtime(11, INTERPRETER, 0), 11).unwrap();
        let layout11 = layout(11);
        assert_eq!(
            (walk11.holder, walk11.threads_head, walk11.interpreter),
            (
                RUNTIME + layout11.runtime_tstate_current.unwrap() as u64,
                INTERPRETER + layout11.interpreter_threads_head as u64,
                INTERPRETER
            )
        );
        assert_eq!(
            (walk11.usedpools, walk11.pthread_tid),
            (INTERPRETER + 1, NO_OFFSET)
        );
        assert_eq!(walk11.frame_owner, layout11.frame_owner.unwrap());
        // 3.12: behind the interpreter's GIL pointer.
        let walk12 = walk(&runtime(12, INTERPRETER, GIL), 12).unwrap();
        assert_eq!(
            walk12.holder,
            GIL + layout(12).gil_last_holder.unwrap() as u64
        );
    }

    #[test]
    fn a_forged_runtime_that_does_not_hold_what_the_layout_says_is_unreadable() {
        let what = |result: Result<PythonWalk, PythonError>| match result {
            Err(PythonError::Unreadable { what, .. }) => what,
            other => panic!("read as {other:?}"),
        };
        // Nothing mapped; a null GIL; an interpreter at the top of the address space,
        // whose GIL field's address wraps around to nothing mapped.
        assert_eq!(what(walk(&FakeMemory::new(), 12)), "the main interpreter");
        assert_eq!(what(walk(&runtime(12, INTERPRETER, 0), 12)), "the GIL");
        assert_eq!(what(walk(&runtime(12, u64::MAX - 8, GIL), 12)), "the GIL");
    }

    #[test]
    fn the_thread_id_is_found_in_a_forged_thread_descriptor() {
        let layout = layout(10);
        let mut memory = FakeMemory::new();
        memory
            .map(INTERPRETER, vec![0u8; 64])
            .write_u64(INTERPRETER + layout.interpreter_threads_head as u64, THREAD)
            .map(THREAD, vec![0u8; 256])
            .write_u64(THREAD + layout.thread_pthread as u64, PTHREAD)
            .map(PTHREAD, vec![0u8; PTHREAD_SEARCH_BYTES])
            .write_u32(PTHREAD + 0x2c0, 4242);
        assert_eq!(
            pthread_tid_offset(&memory, layout, INTERPRETER, &[7, 4242]),
            Some(0x2c0)
        );
        assert_eq!(pthread_tid_offset(&memory, layout, INTERPRETER, &[7]), None);
        // A thread id in the descriptor's leading pointers is a pointer's half: that
        // descriptor is not believed.
        memory.write_u32(PTHREAD + 4, 4242);
        assert_eq!(
            pthread_tid_offset(&memory, layout, INTERPRETER, &[4242]),
            None
        );
        // A thread state that is its own next: looked at a bounded number of times.
        memory.write_u64(THREAD + layout.thread_next as u64, THREAD);
        assert_eq!(pthread_tid_offset(&memory, layout, INTERPRETER, &[7]), None);
        // A descriptor that cannot be read: the next thread state is looked at.
        memory.write_u64(THREAD + layout.thread_pthread as u64, 0xdead_0000);
        assert_eq!(
            pthread_tid_offset(&memory, layout, INTERPRETER, &[4242]),
            None
        );
    }

    #[test]
    fn versions_from_file_names() {
        assert_eq!(minor_from_name(Path::new("/usr/bin/python3.11")), Some(11));
        assert_eq!(
            minor_from_name(Path::new("/x/lib/libpython3.9.so.1.0")),
            Some(9)
        );
        assert_eq!(minor_from_name(Path::new("/usr/bin/python3")), None);
        assert!(names_python(Path::new("/usr/lib/libpython3.13.so.1.0")));
        assert!(!names_python(Path::new("/usr/lib/libc.so.6")));
    }
}
