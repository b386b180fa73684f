//! Is a process a CPython interpreter, and where are its runtime, its code type and its
//! eval loop? Found from the dynamic symbols of the file that defines `_PyRuntime` (the
//! executable, as Debian links it, or `libpython3.x.so`): no debug symbols needed.
//!
//! Files are read through the kernel's link to the very file mapped
//! (`allocbpf_images::procfs::open_mapped`: checked, size-capped); the runtime's
//! pointers are read from the process's memory and believed only as far as the eBPF
//! walk needs them (it checks the thread state against the thread it samples).

use std::{collections::HashMap, ops::Range, path::Path};

use allocbpf_common::python::{PythonWalk, NO_OFFSET};
use allocbpf_images::{
    image::inlined::{self, Usedpools},
    procfs::{self, MapsEntry},
};
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

/// Most interpreter files remembered (by device and inode): a host runs a handful of
/// interpreters in many processes, and each file is read once rather than per process.
const MAX_FILES: usize = 64;

/// Interpreter files examined, by (device, inode): `None` for a file that is not one.
#[derive(Default)]
pub struct InterpreterFiles {
    files: HashMap<(u64, u64), Result<Option<InterpreterFile>, PythonError>>,
    /// Opens that failed for want of descriptors so far.
    descriptor_errors: u64,
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
            if !self.files.contains_key(&key) {
                if self.files.len() >= MAX_FILES {
                    self.files.clear();
                }
                let examined = examine(pid, mapping, path, &mut self.descriptor_errors);
                self.files.insert(key, examined);
            }
            let file = match self.files.get(&key) {
                Some(Ok(Some(file))) => file,
                Some(Ok(None)) | None => continue,
                Some(Err(error)) => return Err(error.clone()),
            };
            return in_process(pid, mapping, path, file).map(Some);
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
            .map(|(a, size)| bias.wrapping_add(a)..bias.wrapping_add(a + size.max(1))),
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

/// The walk of process `pid` whose `_PyRuntime` is at `runtime`, and whose `usedpools`
/// address `usedpools` tells from the main interpreter's address.
fn walk_of(
    pid: u32,
    layout: &Layout,
    runtime: u64,
    usedpools: impl Fn(&ProcessMemory, u64) -> u64,
) -> Result<PythonWalk, PythonError> {
    let memory = ProcessMemory::new(pid);
    let unreadable = |what| PythonError::Unreadable { pid, what };
    let interpreter = memory
        .u64(runtime + layout.runtime_main_interpreter as u64)
        .map_err(|_| unreadable("the main interpreter"))?;
    let holder = match (layout.runtime_tstate_current, layout.interpreter_gil) {
        (Some(current), _) => runtime + current as u64,
        (None, Some(gil)) => {
            let gil = memory
                .u64(interpreter + gil as u64)
                .map_err(|_| unreadable("the GIL"))?;
            if gil == 0 {
                return Err(unreadable("the GIL"));
            }
            gil + layout.gil_last_holder.unwrap_or(8) as u64
        }
        (None, None) => return Err(unreadable("the GIL holder")),
    };
    let pthread_tid = match layout.thread_native_id {
        Some(_) => NO_OFFSET,
        None => pthread_tid_offset(&memory, layout, interpreter).unwrap_or(GLIBC_PTHREAD_TID),
    };
    let opt = |offset: Option<u32>| offset.unwrap_or(NO_OFFSET);
    Ok(PythonWalk {
        holder,
        threads_head: interpreter + layout.interpreter_threads_head as u64,
        usedpools: usedpools(&memory, interpreter),
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

/// Where this process's libc keeps a thread's id in its thread descriptor: the offset
/// at which some thread state's descriptor holds one of the process's thread ids.
fn pthread_tid_offset(memory: &ProcessMemory, layout: &Layout, interpreter: u64) -> Option<u32> {
    let tids: Vec<i32> = std::fs::read_dir(format!("/proc/{}/task", memory.pid()))
        .ok()?
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    let mut thread = memory
        .u64(interpreter + layout.interpreter_threads_head as u64)
        .ok()?;
    let mut descriptor = vec![0u8; PTHREAD_SEARCH_BYTES];
    for _ in 0..MAX_THREAD_STATES {
        if thread == 0 {
            break;
        }
        let pthread = memory.u64(thread + layout.thread_pthread as u64).ok()?;
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
        thread = memory.u64(thread + layout.thread_next as u64).ok()?;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

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
