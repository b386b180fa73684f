//! Where CPython keeps what allocbpf reads, per minor version.
//!
//! To put Python frames in a sample, the eBPF program follows pointers from the
//! interpreter's `_PyRuntime` to the thread state holding the GIL, from it to the
//! thread's innermost frame and on through its callers; userspace then reads each
//! frame's code object, its names (`str`) and its line table (`bytes`). [`Layout`] holds
//! the offsets of those fields for one minor version, [`LAYOUTS`] for every version
//! known.
//!
//! The numbers are not hand-written: `tests/workloads/python_layout.c` prints them
//! (with the argument `rust`, as the literals below) when compiled with
//! `gcc -DPy_BUILD_CORE -I$INC -I$INC/internal` against a version's own headers, the
//! internal ones included. Each entry says which headers it came from. The tests compile
//! and run that program against every version whose headers are on the machine and
//! compare its output with this table, so the two cannot drift apart. (They were also
//! checked once against running interpreters, by following them through the memory of
//! the interpreter itself, and 3.13's against the `_Py_DebugOffsets` it carries.)
//!
//! x86-64 Linux only, and the default builds only: a free-threaded (`Py_GIL_DISABLED`,
//! "3.13t"), debug (`Py_DEBUG`) or `Py_TRACE_REFS` build lays out its objects
//! differently and is not described here. Patch releases of one minor version share a
//! layout (Debian's 3.11.2 and pyenv's 3.11.7 give identical output), so the table is
//! keyed by minor version.

/// Offsets (bytes) of the fields allocbpf reads in one CPython minor version.
///
/// `None` means that the version has no such field (the doc of each field says which
/// versions do).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// The minor version: 3.`minor`.
    pub minor: u8,
    /// Up to 3.11: `offsetof(_PyRuntimeState, gilstate.tstate_current)`, the thread
    /// state of the thread holding the GIL (NULL while nobody holds it). 3.12 replaced it
    /// with a thread-local variable (`_Py_tss_tstate`), so `None` from 3.12.
    pub runtime_tstate_current: Option<u32>,
    /// `offsetof(_PyRuntimeState, interpreters.main)`: the main interpreter.
    pub runtime_main_interpreter: u32,
    /// 3.12+: `offsetof(PyInterpreterState, ceval.gil)`, a pointer to the
    /// `struct _gil_runtime_state` the interpreter uses (the main interpreter's own
    /// `_gil`). `None` up to 3.11, where the one GIL is in `_PyRuntimeState`.
    pub interpreter_gil: Option<u32>,
    /// `offsetof(struct _gil_runtime_state, last_holder)`, in every version: the thread
    /// state that holds the GIL or held it last (it is not cleared when the GIL is
    /// dropped). From 3.12 this is read through [`interpreter_gil`](Self::interpreter_gil).
    pub gil_last_holder: Option<u32>,
    /// Up to 3.11: `offsetof(_PyRuntimeState, ceval.gil.last_holder)`, the same pointer
    /// in the runtime's one GIL. `None` from 3.12.
    pub runtime_gil_last_holder: Option<u32>,
    /// `offsetof(PyInterpreterState, tstate_head)` (3.9, 3.10) or `threads.head`
    /// (3.11+): the newest thread state of the interpreter.
    pub interpreter_threads_head: u32,
    /// `offsetof(PyThreadState, next)`: the next (older) thread state.
    pub thread_next: u32,
    /// `offsetof(PyThreadState, thread_id)`: the thread's `pthread_t`.
    pub thread_pthread: u32,
    /// 3.11+: `offsetof(PyThreadState, native_thread_id)`, the kernel thread id.
    pub thread_native_id: Option<u32>,
    /// `offsetof(PyThreadState, frame)` (3.9, 3.10: the innermost `PyFrameObject`),
    /// `cframe` (3.11, 3.12: a `_PyCFrame`, see
    /// [`cframe_current_frame`](Self::cframe_current_frame)) or `current_frame` (3.13:
    /// the innermost `_PyInterpreterFrame`).
    pub thread_frame: u32,
    /// 3.11, 3.12: `offsetof(_PyCFrame, current_frame)`, the second hop to the innermost
    /// `_PyInterpreterFrame`. `None` otherwise.
    pub cframe_current_frame: Option<u32>,
    /// The frame's code object: `PyFrameObject.f_code` (3.9, 3.10),
    /// `_PyInterpreterFrame.f_code` (3.11, 3.12) or `.f_executable` (3.13, a code object
    /// or, in a shim frame, another object).
    pub frame_code: u32,
    /// The calling frame: `PyFrameObject.f_back` (3.9, 3.10),
    /// `_PyInterpreterFrame.previous` (3.11+).
    pub frame_back: u32,
    /// Where the frame is: `PyFrameObject.f_lasti` (an `int`: a byte offset in 3.9, a
    /// code-unit index in 3.10), `_PyInterpreterFrame.prev_instr` (3.11, 3.12: a pointer
    /// to the code unit before the next instruction) or `.instr_ptr` (3.13: a pointer to
    /// the instruction executing or about to).
    pub frame_instruction: u32,
    /// A byte of the frame: `_PyInterpreterFrame.is_entry` in 3.11 (a `bool`: the frame
    /// is the first one its `_PyEval_EvalFrameDefault` call pushed), `.owner` from 3.12
    /// (a `char` of `enum _frameowner`, compared with
    /// [`owner_cstack`](Self::owner_cstack)). `None` in 3.9, 3.10.
    pub frame_owner: Option<u32>,
    /// `offsetof(PyCodeObject, co_filename)` (a `str`).
    pub code_filename: u32,
    /// `offsetof(PyCodeObject, co_name)` (a `str`).
    pub code_name: u32,
    /// 3.11+: `offsetof(PyCodeObject, co_qualname)` (a `str`).
    pub code_qualname: Option<u32>,
    /// `offsetof(PyCodeObject, co_firstlineno)` (an `int`).
    pub code_firstlineno: u32,
    /// `offsetof(PyCodeObject, co_lnotab)` (3.9) or `co_linetable` (3.10+): the line
    /// table, a `bytes`.
    pub code_linetable: u32,
    /// 3.11+: `offsetof(PyCodeObject, co_code_adaptive)`, the bytecode, inline at the end
    /// of the code object; the frame's instruction pointer points into it.
    pub code_adaptive: Option<u32>,
    /// `sizeof(PyASCIIObject)`: where a compact ASCII `str`'s characters start.
    pub unicode_ascii_size: u32,
    /// `sizeof(PyCompactUnicodeObject)`: where a compact non-ASCII `str`'s characters
    /// start.
    pub unicode_compact_size: u32,
    /// `offsetof(PyASCIIObject, state)`: the bit field holding kind, compact and ascii.
    pub unicode_state: u32,
    /// `offsetof(PyASCIIObject, length)`: the length in code points.
    pub unicode_length: u32,
    /// `offsetof(PyBytesObject, ob_sval)`: where a `bytes`' contents start.
    pub bytes_data: u32,
    /// `offsetof(PyVarObject, ob_size)`: a `bytes`' length.
    pub var_size: u32,
    /// 3.12+: `FRAME_OWNED_BY_CSTACK`, the [`frame_owner`](Self::frame_owner) value of a
    /// shim frame that an entry into the interpreter pushes below its first Python frame
    /// (not Python code: skipped). `None` otherwise.
    pub owner_cstack: Option<u8>,
}

/// The layouts known, oldest first.
pub const LAYOUTS: &[Layout] = &[
    // CPython 3.9.18 (pyenv's headers).
    Layout {
        minor: 9,
        runtime_tstate_current: Some(568),
        runtime_main_interpreter: 40,
        interpreter_gil: None,
        gil_last_holder: Some(8),
        runtime_gil_last_holder: Some(360),
        interpreter_threads_head: 8,
        thread_next: 8,
        thread_pthread: 176,
        thread_native_id: None,
        thread_frame: 24,
        cframe_current_frame: None,
        frame_code: 32,
        frame_back: 24,
        frame_instruction: 104,
        frame_owner: None,
        code_filename: 104,
        code_name: 112,
        code_qualname: None,
        code_firstlineno: 40,
        code_linetable: 120,
        code_adaptive: None,
        unicode_ascii_size: 48,
        unicode_compact_size: 72,
        unicode_state: 32,
        unicode_length: 16,
        bytes_data: 32,
        var_size: 16,
        owner_cstack: None,
    },
    // CPython 3.10.13 (pyenv's headers).
    Layout {
        minor: 10,
        runtime_tstate_current: Some(568),
        runtime_main_interpreter: 40,
        interpreter_gil: None,
        gil_last_holder: Some(8),
        runtime_gil_last_holder: Some(360),
        interpreter_threads_head: 8,
        thread_next: 8,
        thread_pthread: 176,
        thread_native_id: None,
        thread_frame: 24,
        cframe_current_frame: None,
        frame_code: 32,
        frame_back: 24,
        frame_instruction: 96,
        frame_owner: None,
        code_filename: 104,
        code_name: 112,
        code_qualname: None,
        code_firstlineno: 40,
        code_linetable: 120,
        code_adaptive: None,
        unicode_ascii_size: 48,
        unicode_compact_size: 72,
        unicode_state: 32,
        unicode_length: 16,
        bytes_data: 32,
        var_size: 16,
        owner_cstack: None,
    },
    // CPython 3.11.7 (pyenv's headers); Debian's 3.11.2 (/usr/include/python3.11) gives the same.
    Layout {
        minor: 11,
        runtime_tstate_current: Some(576),
        runtime_main_interpreter: 48,
        interpreter_gil: None,
        gil_last_holder: Some(8),
        runtime_gil_last_holder: Some(368),
        interpreter_threads_head: 16,
        thread_next: 8,
        thread_pthread: 152,
        thread_native_id: Some(160),
        thread_frame: 56,
        cframe_current_frame: Some(8),
        frame_code: 32,
        frame_back: 48,
        frame_instruction: 56,
        frame_owner: Some(68),
        code_filename: 112,
        code_name: 120,
        code_qualname: Some(128),
        code_firstlineno: 72,
        code_linetable: 136,
        code_adaptive: Some(184),
        unicode_ascii_size: 48,
        unicode_compact_size: 72,
        unicode_state: 32,
        unicode_length: 16,
        bytes_data: 32,
        var_size: 16,
        owner_cstack: None,
    },
    // CPython 3.12.1 (pyenv's headers).
    Layout {
        minor: 12,
        runtime_tstate_current: None,
        runtime_main_interpreter: 48,
        interpreter_gil: Some(384),
        gil_last_holder: Some(8),
        runtime_gil_last_holder: None,
        interpreter_threads_head: 72,
        thread_next: 8,
        thread_pthread: 136,
        thread_native_id: Some(144),
        thread_frame: 56,
        cframe_current_frame: Some(0),
        frame_code: 0,
        frame_back: 8,
        frame_instruction: 56,
        frame_owner: Some(70),
        code_filename: 112,
        code_name: 120,
        code_qualname: Some(128),
        code_firstlineno: 68,
        code_linetable: 136,
        code_adaptive: Some(192),
        unicode_ascii_size: 40,
        unicode_compact_size: 56,
        unicode_state: 32,
        unicode_length: 16,
        bytes_data: 32,
        var_size: 16,
        owner_cstack: Some(3),
    },
    // CPython 3.13.0 (pyenv's headers).
    Layout {
        minor: 13,
        runtime_tstate_current: None,
        runtime_main_interpreter: 640,
        interpreter_gil: Some(16),
        gil_last_holder: Some(8),
        runtime_gil_last_holder: None,
        interpreter_threads_head: 7344,
        thread_next: 8,
        thread_pthread: 152,
        thread_native_id: Some(160),
        thread_frame: 72,
        cframe_current_frame: None,
        frame_code: 0,
        frame_back: 8,
        frame_instruction: 56,
        frame_owner: Some(70),
        code_filename: 112,
        code_name: 120,
        code_qualname: Some(128),
        code_firstlineno: 68,
        code_linetable: 136,
        code_adaptive: Some(200),
        unicode_ascii_size: 40,
        unicode_compact_size: 56,
        unicode_state: 32,
        unicode_length: 16,
        bytes_data: 32,
        var_size: 16,
        owner_cstack: Some(3),
    },
];

/// The layout of 3.`minor`, if known.
pub fn for_minor(minor: u8) -> Option<&'static Layout> {
    LAYOUTS.iter().find(|layout| layout.minor == minor)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::path::{Path, PathBuf};
    use std::process::Command;

    #[test]
    fn table_is_sorted_and_found_by_minor() {
        assert!(LAYOUTS.windows(2).all(|w| w[0].minor < w[1].minor));
        let minors: Vec<u8> = LAYOUTS.iter().map(|layout| layout.minor).collect();
        assert_eq!(minors, [9, 10, 11, 12, 13]);
        for layout in LAYOUTS {
            assert_eq!(for_minor(layout.minor), Some(layout));
        }
        assert_eq!(for_minor(8), None);
        assert_eq!(for_minor(14), None);
    }

    /// The generator's `name value` lines, each taken once.
    struct Fields(BTreeMap<String, Option<u32>>);

    impl Fields {
        fn parse(output: &str) -> Self {
            let mut fields = BTreeMap::new();
            for line in output.lines() {
                let (name, value) = line.split_once(' ').expect("a `name value` line");
                let value = match value {
                    "none" => None,
                    number => Some(number.parse().expect("an offset")),
                };
                assert!(
                    fields.insert(name.to_owned(), value).is_none(),
                    "{name} printed twice"
                );
            }
            Fields(fields)
        }

        fn opt(&mut self, name: &str) -> Option<u32> {
            self.0
                .remove(name)
                .unwrap_or_else(|| panic!("{name} not printed"))
        }

        fn req(&mut self, name: &str) -> u32 {
            self.opt(name)
                .unwrap_or_else(|| panic!("{name} printed as none"))
        }

        fn layout(mut self) -> Layout {
            let layout = Layout {
                minor: u8::try_from(self.req("minor")).unwrap(),
                runtime_tstate_current: self.opt("runtime_tstate_current"),
                runtime_main_interpreter: self.req("runtime_main_interpreter"),
                interpreter_gil: self.opt("interpreter_gil"),
                gil_last_holder: self.opt("gil_last_holder"),
                runtime_gil_last_holder: self.opt("runtime_gil_last_holder"),
                interpreter_threads_head: self.req("interpreter_threads_head"),
                thread_next: self.req("thread_next"),
                thread_pthread: self.req("thread_pthread"),
                thread_native_id: self.opt("thread_native_id"),
                thread_frame: self.req("thread_frame"),
                cframe_current_frame: self.opt("cframe_current_frame"),
                frame_code: self.req("frame_code"),
                frame_back: self.req("frame_back"),
                frame_instruction: self.req("frame_instruction"),
                frame_owner: self.opt("frame_owner"),
                code_filename: self.req("code_filename"),
                code_name: self.req("code_name"),
                code_qualname: self.opt("code_qualname"),
                code_firstlineno: self.req("code_firstlineno"),
                code_linetable: self.req("code_linetable"),
                code_adaptive: self.opt("code_adaptive"),
                unicode_ascii_size: self.req("unicode_ascii_size"),
                unicode_compact_size: self.req("unicode_compact_size"),
                unicode_state: self.req("unicode_state"),
                unicode_length: self.req("unicode_length"),
                bytes_data: self.req("bytes_data"),
                var_size: self.req("var_size"),
                owner_cstack: self.opt("owner_cstack").map(|v| u8::try_from(v).unwrap()),
            };
            let unknown: Vec<&String> = self.0.keys().collect();
            assert!(unknown.is_empty(), "fields Layout lacks: {unknown:?}");
            layout
        }
    }

    /// The header directories of 3.`minor` on this machine: Debian's
    /// (`/usr/include/python3.M`) and pyenv's (`$PYENV_ROOT/versions/3.M.*`), those with
    /// the internal headers.
    fn header_dirs(minor: u8) -> Vec<PathBuf> {
        let name = format!("python3.{minor}");
        let mut dirs = vec![Path::new("/usr/include").join(&name)];
        let pyenv = std::env::var_os("PYENV_ROOT")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|home| Path::new(&home).join(".pyenv")));
        if let Some(Ok(versions)) = pyenv.map(|root| std::fs::read_dir(root.join("versions"))) {
            let prefix = format!("3.{minor}.");
            let mut found: Vec<PathBuf> = versions
                .flatten()
                .filter(|entry| entry.file_name().to_string_lossy().starts_with(&prefix))
                .map(|entry| entry.path().join("include").join(&name))
                .collect();
            found.sort();
            dirs.extend(found);
        }
        dirs.retain(|dir| dir.join("internal/pycore_runtime.h").is_file());
        dirs
    }

    /// Compiles tests/workloads/python_layout.c against `include` and runs it.
    fn generate(include: &Path, binary: &Path) -> String {
        let source =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../tests/workloads/python_layout.c");
        let status = Command::new("gcc")
            .arg("-DPy_BUILD_CORE")
            .arg("-I")
            .arg(include)
            .arg("-I")
            .arg(include.join("internal"))
            .arg(&source)
            .arg("-o")
            .arg(binary)
            .status()
            .expect("running gcc");
        assert!(status.success(), "gcc failed on {}", include.display());
        let output = Command::new(binary)
            .output()
            .expect("running python_layout");
        assert!(output.status.success(), "python_layout failed");
        String::from_utf8(output.stdout).expect("UTF-8 output")
    }

    #[test]
    fn table_matches_the_headers_on_this_machine() {
        let dir =
            std::env::temp_dir().join(format!("allocbpf-python-layout-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut checked = Vec::new();
        for layout in LAYOUTS {
            for (i, include) in header_dirs(layout.minor).iter().enumerate() {
                let binary = dir.join(format!("python_layout-3.{}-{i}", layout.minor));
                let derived = Fields::parse(&generate(include, &binary)).layout();
                assert_eq!(&derived, layout, "headers {}", include.display());
                checked.push(include.clone());
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
        eprintln!("the table matches the headers in {checked:?}");
        // Debian's libpython3.11-dev is always there; without any headers this test
        // would compare nothing.
        assert!(
            !checked.is_empty(),
            "no CPython headers found (apt-get install libpython3.11-dev)"
        );
    }
}
