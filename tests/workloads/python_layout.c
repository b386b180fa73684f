/*
 * The CPython layout table of userspace/python/src/layout.rs, derived from the headers.
 *
 * Compiled against one CPython version's own headers, this prints the offsets (bytes)
 * of the fields allocbpf reads in that version: the chain from _PyRuntime to the thread
 * holding the GIL, from its thread state to its innermost frame and on through the
 * callers, and the code, str and bytes objects a frame leads to. The internal structures
 * need the internal headers, so build it as CPython's core is built:
 *
 *   INC=/root/.pyenv/versions/3.12.1/include/python3.12
 *   gcc -DPy_BUILD_CORE -I"$INC" -I"$INC/internal" python_layout.c -o python_layout
 *
 * Output: one line per field of layout.rs's `Layout`, in its order: `name value`, or
 * `name none` where the version has no such field. With the argument `rust` it prints
 * the same values as a `Layout { .. },` literal to paste into the `LAYOUTS` table
 * instead. layout.rs's tests compile and run this against every version whose headers
 * are on the machine and compare the lines with the table.
 *
 * Supported: CPython 3.9 to 3.13, x86-64 Linux, default (GIL) builds. A free-threaded
 * (Py_GIL_DISABLED), debug (Py_DEBUG) or Py_TRACE_REFS build has other offsets (the
 * object header alone differs); such headers are refused below. Nothing here is linked
 * against libpython: only offsetof, sizeof and enum constants are used.
 */
#include <Python.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#if PY_MAJOR_VERSION != 3 || PY_MINOR_VERSION < 9 || PY_MINOR_VERSION > 13
#error "python_layout.c knows CPython 3.9 to 3.13"
#endif
#if defined(Py_GIL_DISABLED) || defined(Py_DEBUG) || defined(Py_TRACE_REFS)
#error "python_layout.c describes default (GIL, release) builds only"
#endif
#if !defined(__x86_64__)
#error "python_layout.c describes x86-64 only"
#endif

/* The internal headers that define the structures (all need Py_BUILD_CORE). */
#include "pycore_runtime.h" /* _PyRuntimeState */
#include "pycore_interp.h"  /* PyInterpreterState (struct _is) */
#if PY_MINOR_VERSION <= 10
#include <code.h>        /* PyCodeObject (not included by Python.h before 3.11) */
#include <frameobject.h> /* PyFrameObject: the frame itself up to 3.10 */
#else
#include "pycore_frame.h" /* _PyInterpreterFrame, enum _frameowner */
#endif

/* Printing: each field once, in the order of layout.rs's `Layout`. */

static int rust; /* 1: print a Rust `Layout` literal, 0: `name value` lines */

/* A field every supported version has (a `u32` in `Layout`). */
static void field(const char *name, size_t value) {
    if (rust)
        printf("    %s: %zu,\n", name, value);
    else
        printf("%s %zu\n", name, value);
}

/* An `Option` field that this version has. */
static void some(const char *name, size_t value) {
    if (rust)
        printf("    %s: Some(%zu),\n", name, value);
    else
        printf("%s %zu\n", name, value);
}

/* An `Option` field that this version does not have. */
static void none(const char *name) {
    if (rust)
        printf("    %s: None,\n", name);
    else
        printf("%s none\n", name);
}

int main(int argc, char **argv) {
    rust = argc > 1 && strcmp(argv[1], "rust") == 0;
    if (rust) printf("Layout {\n");
    field("minor", PY_MINOR_VERSION);

    /* --- The runtime: who holds the GIL, and the main interpreter. ------------- */

#if PY_MINOR_VERSION <= 11
    /* The thread state of the thread holding the GIL; set to NULL when it drops it. */
    some("runtime_tstate_current", offsetof(_PyRuntimeState, gilstate.tstate_current));
#else
    /* 3.12 removed it: the current thread state is the thread-local _Py_tss_tstate. */
    none("runtime_tstate_current");
#endif
    field("runtime_main_interpreter", offsetof(_PyRuntimeState, interpreters.main));

#if PY_MINOR_VERSION >= 12
    /* The GIL moved into the interpreter (PEP 684): ceval.gil points at the GIL the
       interpreter uses (the main interpreter's own, interp->_gil). */
    some("interpreter_gil", offsetof(PyInterpreterState, ceval.gil));
#else
    none("interpreter_gil");
#endif
    /* The last thread state to have taken the GIL (kept after it is dropped). */
    some("gil_last_holder", offsetof(struct _gil_runtime_state, last_holder));
#if PY_MINOR_VERSION <= 11
    /* Up to 3.11 the one GIL is _PyRuntime.ceval.gil (3.10's
       EXPERIMENTAL_ISOLATED_SUBINTERPRETERS, which moves it, is off by default). */
    some("runtime_gil_last_holder", offsetof(_PyRuntimeState, ceval.gil.last_holder));
#else
    none("runtime_gil_last_holder");
#endif

    /* --- The interpreter's threads. --------------------------------------------- */

#if PY_MINOR_VERSION <= 10
    field("interpreter_threads_head", offsetof(PyInterpreterState, tstate_head));
#else
    field("interpreter_threads_head", offsetof(PyInterpreterState, threads.head));
#endif
    field("thread_next", offsetof(PyThreadState, next));
    field("thread_pthread", offsetof(PyThreadState, thread_id)); /* pthread_self() */
#if PY_MINOR_VERSION >= 11
    some("thread_native_id", offsetof(PyThreadState, native_thread_id)); /* gettid() */
#else
    none("thread_native_id");
#endif

    /* --- From the thread state to its innermost frame. ------------------------- */

#if PY_MINOR_VERSION <= 10
    field("thread_frame", offsetof(PyThreadState, frame)); /* PyFrameObject * */
    none("cframe_current_frame");
#elif PY_MINOR_VERSION <= 12
    field("thread_frame", offsetof(PyThreadState, cframe)); /* _PyCFrame * */
    some("cframe_current_frame", offsetof(_PyCFrame, current_frame));
#else
    field("thread_frame", offsetof(PyThreadState, current_frame)); /* 3.13 dropped _PyCFrame */
    none("cframe_current_frame");
#endif

    /* --- A frame: its code, its caller, where it is, who owns it. -------------- */

#if PY_MINOR_VERSION <= 10
    field("frame_code", offsetof(PyFrameObject, f_code));
    field("frame_back", offsetof(PyFrameObject, f_back));
    /* An int: the last instruction's offset in bytes (3.9) or in code units (3.10). */
    field("frame_instruction", offsetof(PyFrameObject, f_lasti));
    none("frame_owner");
#else
#if PY_MINOR_VERSION <= 12
    field("frame_code", offsetof(_PyInterpreterFrame, f_code));
#else
    field("frame_code", offsetof(_PyInterpreterFrame, f_executable)); /* code or None */
#endif
    field("frame_back", offsetof(_PyInterpreterFrame, previous));
#if PY_MINOR_VERSION <= 12
    /* A _Py_CODEUNIT *: the code unit before the next instruction. */
    field("frame_instruction", offsetof(_PyInterpreterFrame, prev_instr));
#else
    /* A _Py_CODEUNIT *: the instruction executing or about to. */
    field("frame_instruction", offsetof(_PyInterpreterFrame, instr_ptr));
#endif
#if PY_MINOR_VERSION == 11
    /* A bool: the frame is the first one its _PyEval_EvalFrameDefault call pushed
       (returning from it returns from that C call). 3.11's `owner` has no
       C-stack value, so it is not the one read. */
    some("frame_owner", offsetof(_PyInterpreterFrame, is_entry));
#else
    /* A char of enum _frameowner. */
    some("frame_owner", offsetof(_PyInterpreterFrame, owner));
#endif
#endif

    /* --- The code object. -------------------------------------------------------- */

    field("code_filename", offsetof(PyCodeObject, co_filename));
    field("code_name", offsetof(PyCodeObject, co_name));
#if PY_MINOR_VERSION >= 11
    some("code_qualname", offsetof(PyCodeObject, co_qualname));
#else
    none("code_qualname");
#endif
    field("code_firstlineno", offsetof(PyCodeObject, co_firstlineno));
#if PY_MINOR_VERSION == 9
    field("code_linetable", offsetof(PyCodeObject, co_lnotab));
#else
    field("code_linetable", offsetof(PyCodeObject, co_linetable));
#endif
#if PY_MINOR_VERSION >= 11
    /* The bytecode itself, inline at the end of the object (instruction pointers point
       into it). */
    some("code_adaptive", offsetof(PyCodeObject, co_code_adaptive));
#else
    none("code_adaptive");
#endif

    /* --- str and bytes, to read names and line tables. ------------------------- */

    /* A compact ASCII str's characters follow the PyASCIIObject; a compact non-ASCII
       one's follow the PyCompactUnicodeObject. */
    field("unicode_ascii_size", sizeof(PyASCIIObject));
    field("unicode_compact_size", sizeof(PyCompactUnicodeObject));
    field("unicode_state", offsetof(PyASCIIObject, state));
    field("unicode_length", offsetof(PyASCIIObject, length));
    field("bytes_data", offsetof(PyBytesObject, ob_sval));
    field("var_size", offsetof(PyVarObject, ob_size));

    /* --- Frame-owner values. ------------------------------------------------------ */

#if PY_MINOR_VERSION >= 12
    /* The shim frame an entry into the interpreter pushes below the first Python frame
       (not Python code; its f_code/f_executable is not a function's). */
    some("owner_cstack", FRAME_OWNED_BY_CSTACK);
#else
    none("owner_cstack");
#endif

    if (rust) printf("},\n");
    return 0;
}
