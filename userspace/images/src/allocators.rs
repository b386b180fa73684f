//! The catalogue of allocator families: which symbols are allocation entry points,
//! what they mean, and how a probe reads their arguments.
//!
//! A file is an allocator image when it defines any of these symbols, whatever its
//! name or path: glibc's and musl's libc, jemalloc (unprefixed as Debian ships it, `je_`
//! when built with a prefix, `_rjem_` as Rust's tikv-jemallocator links it), tcmalloc
//! (gperftools, with its `tc_` aliases), mimalloc (unprefixed overrides and its own
//! `mi_` API), a static executable's own malloc, and any library that defines C++
//! `operator new`/`delete`. Extra prefixes (a renamed custom allocator's) can be added
//! for the C API. HotSpot's `libjvm.so` is one too: its allocation tracer is told of
//! every TLAB a Java thread takes and every object allocated outside one, so the Java
//! heap is counted and sampled in TLAB-sized chunks (docs/design.md, "The JVM").

use allocbpf_common::{AllocFn, Shape};

use crate::image::point::Input;

/// One allocation (or deallocation) entry point, by its unprefixed symbol name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntrySpec {
    /// The symbol, without prefix (`malloc`, `_Znwm`).
    pub name: &'static str,
    /// What it is, for events and reports.
    pub function: AllocFn,
    /// How the probe reads it.
    pub shape: Shape,
    /// Which arguments the shape's inputs are, in order.
    pub inputs: &'static [Input],
    /// It reaches other entries through function pointers and functions of its own
    /// (CPython's allocators): probed as a wrapper whose every nested call is its own.
    pub nests: bool,
}

const fn entry(
    name: &'static str,
    function: AllocFn,
    shape: Shape,
    inputs: &'static [Input],
) -> EntrySpec {
    EntrySpec {
        name,
        function,
        shape,
        inputs,
        nests: false,
    }
}

/// A CPython allocator entry: see [`EntrySpec::nests`].
const fn python(
    name: &'static str,
    function: AllocFn,
    shape: Shape,
    inputs: &'static [Input],
) -> EntrySpec {
    EntrySpec {
        nests: true,
        ..entry(name, function, shape, inputs)
    }
}

const ARG0: &[Input] = &[Input::Arg(0)];
const ARG1: &[Input] = &[Input::Arg(1)];
const ARG0_ARG1: &[Input] = &[Input::Arg(0), Input::Arg(1)];
const ARG0_ARG2: &[Input] = &[Input::Arg(0), Input::Arg(2)];
const PRODUCT01: &[Input] = &[Input::Product(0, 1)];
/// `send_allocation_in_new_tlab(klass, obj, tlab_bytes, object_bytes, thread)`: the
/// bytes, the class, the thread.
const JAVA_TLAB: &[Input] = &[Input::Arg(2), Input::Arg(0), Input::Arg(4)];
/// `send_allocation_outside_tlab(klass, obj, object_bytes, thread)`.
const JAVA_OUTSIDE: &[Input] = &[Input::Arg(2), Input::Arg(0), Input::Arg(3)];
const ARG0_PRODUCT12: &[Input] = &[Input::Arg(0), Input::Product(1, 2)];
const ARG2: &[Input] = &[Input::Arg(2)];

use AllocFn as F;
use Shape as S;

/// The C allocation API: searched under every prefix of [`PREFIXES`] and the user's.
pub const C_API: &[EntrySpec] = &[
    entry("malloc", F::Malloc, S::Size, ARG0),
    entry("calloc", F::Calloc, S::Array, PRODUCT01),
    entry("realloc", F::Realloc, S::Resize, ARG0_ARG1),
    entry(
        "reallocarray",
        F::Reallocarray,
        S::ResizeArray,
        ARG0_PRODUCT12,
    ),
    entry(
        "posix_memalign",
        F::PosixMemalign,
        S::PosixMemalign,
        ARG0_ARG2,
    ),
    entry("aligned_alloc", F::AlignedAlloc, S::Size, ARG1),
    entry("memalign", F::Memalign, S::Size, ARG1),
    entry("valloc", F::Valloc, S::Size, ARG0),
    entry("pvalloc", F::Pvalloc, S::Pvalloc, ARG0),
    entry("free", F::Free, S::Free, ARG0),
    entry("cfree", F::Free, S::Free, ARG0),
    // C23 sized deallocation.
    entry("free_sized", F::Free, S::Free, ARG0),
    entry("free_aligned_sized", F::Free, S::Free, ARG0),
    // jemalloc's non-standard API (flags carry alignment and zeroing; the requested
    // size is the size argument either way).
    entry("mallocx", F::Mallocx, S::Size, ARG0),
    entry("rallocx", F::Rallocx, S::Resize, ARG0_ARG1),
    entry("xallocx", F::Xallocx, S::InPlace, ARG1),
    entry("sdallocx", F::Free, S::Free, ARG0),
    entry("dallocx", F::Free, S::Free, ARG0),
];

/// Prefixes the C API is searched under without any flag: none, jemalloc's `je_`,
/// tikv-jemallocator's `_rjem_`, gperftools' `tc_`, mimalloc's `mi_`, and glibc's
/// `__libc_` aliases (a program's own malloc that calls `__libc_malloc` forwards).
pub const PREFIXES: &[&str] = &["", "je_", "_rjem_", "tc_", "mi_", "__libc_"];

/// Entries only known under their full names: C++ operators, gperftools' and
/// mimalloc's own APIs.
pub const NAMED: &[EntrySpec] = &[
    // operator new / new[] (size_t), nothrow, align_val_t, both.
    entry("_Znwm", F::New, S::Size, ARG0),
    entry("_ZnwmRKSt9nothrow_t", F::New, S::Size, ARG0),
    entry("_ZnwmSt11align_val_t", F::New, S::Size, ARG0),
    entry("_ZnwmSt11align_val_tRKSt9nothrow_t", F::New, S::Size, ARG0),
    entry("_Znam", F::NewArray, S::Size, ARG0),
    entry("_ZnamRKSt9nothrow_t", F::NewArray, S::Size, ARG0),
    entry("_ZnamSt11align_val_t", F::NewArray, S::Size, ARG0),
    entry(
        "_ZnamSt11align_val_tRKSt9nothrow_t",
        F::NewArray,
        S::Size,
        ARG0,
    ),
    // operator delete / delete[]: plain, sized, aligned, both, nothrow.
    entry("_ZdlPv", F::Free, S::Free, ARG0),
    entry("_ZdlPvm", F::Free, S::Free, ARG0),
    entry("_ZdlPvSt11align_val_t", F::Free, S::Free, ARG0),
    entry("_ZdlPvmSt11align_val_t", F::Free, S::Free, ARG0),
    entry("_ZdlPvRKSt9nothrow_t", F::Free, S::Free, ARG0),
    entry(
        "_ZdlPvSt11align_val_tRKSt9nothrow_t",
        F::Free,
        S::Free,
        ARG0,
    ),
    entry("_ZdaPv", F::Free, S::Free, ARG0),
    entry("_ZdaPvm", F::Free, S::Free, ARG0),
    entry("_ZdaPvSt11align_val_t", F::Free, S::Free, ARG0),
    entry("_ZdaPvmSt11align_val_t", F::Free, S::Free, ARG0),
    entry("_ZdaPvRKSt9nothrow_t", F::Free, S::Free, ARG0),
    entry(
        "_ZdaPvSt11align_val_tRKSt9nothrow_t",
        F::Free,
        S::Free,
        ARG0,
    ),
    // gperftools' tc_ names for the C++ operators (aliases of the above there).
    entry("tc_new", F::New, S::Size, ARG0),
    entry("tc_new_nothrow", F::New, S::Size, ARG0),
    entry("tc_newarray", F::NewArray, S::Size, ARG0),
    entry("tc_newarray_nothrow", F::NewArray, S::Size, ARG0),
    entry("tc_delete", F::Free, S::Free, ARG0),
    entry("tc_deletearray", F::Free, S::Free, ARG0),
    entry("tc_delete_sized", F::Free, S::Free, ARG0),
    entry("tc_deletearray_sized", F::Free, S::Free, ARG0),
    // mimalloc's own API (what the Rust `mimalloc` crate calls).
    entry("mi_zalloc", F::SizedVariant, S::Size, ARG0),
    entry("mi_malloc_small", F::SizedVariant, S::Size, ARG0),
    entry("mi_zalloc_small", F::SizedVariant, S::Size, ARG0),
    entry("mi_malloc_aligned", F::SizedVariant, S::Size, ARG0),
    entry("mi_zalloc_aligned", F::SizedVariant, S::Size, ARG0),
    entry("mi_malloc_aligned_at", F::SizedVariant, S::Size, ARG0),
    entry("mi_calloc_aligned", F::Calloc, S::Array, PRODUCT01),
    entry("mi_mallocn", F::Calloc, S::Array, PRODUCT01),
    entry("mi_realloc_aligned", F::ResizeVariant, S::Resize, ARG0_ARG1),
    entry("mi_rezalloc", F::ResizeVariant, S::Resize, ARG0_ARG1),
    entry(
        "mi_rezalloc_aligned",
        F::ResizeVariant,
        S::Resize,
        ARG0_ARG1,
    ),
    entry("mi_reallocf", F::ResizeVariant, S::Resize, ARG0_ARG1),
    entry(
        "mi_reallocn",
        F::Reallocarray,
        S::ResizeArray,
        ARG0_PRODUCT12,
    ),
    entry("mi_new", F::New, S::Size, ARG0),
    entry("mi_new_nothrow", F::New, S::Size, ARG0),
    entry("mi_new_aligned", F::New, S::Size, ARG0),
    entry("mi_new_aligned_nothrow", F::New, S::Size, ARG0),
    entry("mi_new_n", F::NewArray, S::Array, PRODUCT01),
    entry("mi_free_size", F::Free, S::Free, ARG0),
    entry("mi_free_aligned", F::Free, S::Free, ARG0),
    entry("mi_free_size_aligned", F::Free, S::Free, ARG0),
    // CPython's object and memory allocators (pymalloc serves requests up to 512 bytes
    // from its own arenas, never reaching malloc; larger ones forward to it and are
    // counted there once). In the executable or in libpython3.x.so. `PyMem_Raw*` are
    // not probed: they call malloc, calloc, realloc and free one for one, which count
    // every such call with the same size and caller.
    python("PyObject_Malloc", F::Malloc, S::Size, ARG0),
    python("PyObject_Calloc", F::Calloc, S::Array, PRODUCT01),
    python("PyObject_Realloc", F::Realloc, S::Resize, ARG0_ARG1),
    python("PyObject_Free", F::Free, S::Free, ARG0),
    python("PyMem_Malloc", F::Malloc, S::Size, ARG0),
    python("PyMem_Calloc", F::Calloc, S::Array, PRODUCT01),
    python("PyMem_Realloc", F::Realloc, S::Resize, ARG0_ARG1),
    python("PyMem_Free", F::Free, S::Free, ARG0),
    // HotSpot's allocation tracer (libjvm.so, JDK 11 on; local symbols of its .symtab,
    // which Debian's and Temurin's builds keep).
    entry(JVM_NEW_TLAB, F::JavaTlab, S::JavaHeap, JAVA_TLAB),
    entry(
        JVM_OUTSIDE_TLAB,
        F::JavaOutsideTlab,
        S::JavaHeap,
        JAVA_OUTSIDE,
    ),
    // JDK 11 to 15 declare them with `HeapWord*` and `Thread*` (the same registers).
    entry(JVM_NEW_TLAB_OLD, F::JavaTlab, S::JavaHeap, JAVA_TLAB),
    entry(
        JVM_OUTSIDE_TLAB_OLD,
        F::JavaOutsideTlab,
        S::JavaHeap,
        JAVA_OUTSIDE,
    ), // V8's allocation-observer step and its large-object spaces (a Node.js binary's
    // .symtab): counted only in processes the Node.js runtime registered (the probe
    // programs read the offsets it found in the process's build).
    entry(V8_LAB_STEP_11, F::JsHeapChunk, S::V8Lab, ARG0),
    entry(V8_LAB_STEP_12, F::JsHeapChunk, S::V8Lab, ARG0),
    // V8 11: `AllocateRaw(int)`; V8 12: `AllocateRaw(LocalHeap*, int)`. The variants
    // with an `Executability` are what these call (and code space's), not probed.
    entry(
        "_ZN2v88internal19NewLargeObjectSpace11AllocateRawEi",
        F::JsLargeObject,
        S::V8Large,
        ARG1,
    ),
    entry(
        "_ZN2v88internal19OldLargeObjectSpace11AllocateRawEi",
        F::JsLargeObject,
        S::V8Large,
        ARG1,
    ),
    entry(
        "_ZN2v88internal19NewLargeObjectSpace11AllocateRawEPNS0_9LocalHeapEi",
        F::JsLargeObject,
        S::V8Large,
        ARG2,
    ),
    entry(
        "_ZN2v88internal19OldLargeObjectSpace11AllocateRawEPNS0_9LocalHeapEi",
        F::JsLargeObject,
        S::V8Large,
        ARG2,
    ),
];

/// `v8::internal::SpaceWithLinearArea::AdvanceAllocationObservers()` (V8 11: Node.js 20).
pub const V8_LAB_STEP_11: &str =
    "_ZN2v88internal19SpaceWithLinearArea26AdvanceAllocationObserversEv";

/// `v8::internal::MainAllocator::AdvanceAllocationObservers()` (V8 12: Node.js 22).
pub const V8_LAB_STEP_12: &str = "_ZN2v88internal13MainAllocator26AdvanceAllocationObserversEv";

/// V8's allocation-observer step under every name it has had.
pub const V8_LAB_STEP_NAMES: [&str; 2] = [V8_LAB_STEP_11, V8_LAB_STEP_12];

/// The allocation tracer's new-TLAB entry under every name it has had: a libjvm that
/// defines none is one whose Java heap cannot be probed (a stripped build).
pub const JVM_NEW_TLAB_NAMES: [&str; 2] = [JVM_NEW_TLAB, JVM_NEW_TLAB_OLD];

/// `AllocTracer::send_allocation_in_new_tlab(Klass*, HeapWord*, size_t, size_t,
/// Thread*)` (JDK 11 to 15).
pub const JVM_NEW_TLAB_OLD: &str =
    "_ZN11AllocTracer27send_allocation_in_new_tlabEP5KlassP8HeapWordmmP6Thread";

/// `AllocTracer::send_allocation_outside_tlab(Klass*, HeapWord*, size_t, Thread*)`
/// (JDK 11 to 15).
pub const JVM_OUTSIDE_TLAB_OLD: &str =
    "_ZN11AllocTracer28send_allocation_outside_tlabEP5KlassP8HeapWordmP6Thread";

/// `AllocTracer::send_allocation_in_new_tlab(Klass*, HeapWord*, size_t, size_t,
/// JavaThread*)`.
pub const JVM_NEW_TLAB: &str =
    "_ZN11AllocTracer27send_allocation_in_new_tlabEP5KlassPP12HeapWordImplmmP10JavaThread";

/// `AllocTracer::send_allocation_outside_tlab(Klass*, HeapWord*, size_t, JavaThread*)`.
pub const JVM_OUTSIDE_TLAB: &str =
    "_ZN11AllocTracer28send_allocation_outside_tlabEP5KlassPP12HeapWordImplmP10JavaThread";

/// Every (symbol, entry) pair searched in a file, given the user's extra prefixes.
pub fn symbols(extra_prefixes: &[String]) -> Vec<(String, EntrySpec)> {
    let mut out = Vec::new();
    let prefixes = extra_prefixes
        .iter()
        .map(String::as_str)
        .chain(PREFIXES.iter().copied());
    for prefix in prefixes {
        for spec in C_API {
            let name = format!("{prefix}{}", spec.name);
            if !out.iter().any(|(n, _)| *n == name) {
                out.push((name, *spec));
            }
        }
    }
    out.extend(NAMED.iter().map(|spec| (spec.name.to_string(), *spec)));
    out
}

/// True for a symbol name some image could bind an allocation call to: what makes a
/// PLT call from an entry a forwarded allocation.
pub fn is_allocation_symbol(name: &str, extra_prefixes: &[String]) -> bool {
    let strip = |prefix: &str| name.strip_prefix(prefix);
    NAMED.iter().any(|spec| spec.name == name)
        || extra_prefixes
            .iter()
            .map(String::as_str)
            .chain(PREFIXES.iter().copied())
            .filter_map(strip)
            .any(|rest| C_API.iter().any(|spec| spec.name == rest))
}

/// Names the allocator families a file's defined symbols reveal, for the start-up
/// line and `-v` (`jemalloc`, `glibc`...). `defines` answers whether the file defines
/// a symbol.
pub fn families(defines: impl Fn(&str) -> bool) -> Vec<&'static str> {
    let mut out = Vec::new();
    let any = |names: &[&str]| names.iter().any(|n| defines(n));
    if defines("gnu_get_libc_version") {
        out.push("glibc");
    } else if defines("__libc_start_main") && defines("malloc") {
        out.push("musl");
    }
    if any(&["mallocx", "je_mallocx", "_rjem_mallocx"]) {
        out.push("jemalloc");
    }
    if any(&["tc_malloc", "MallocExtension_GetAllocatedSize"]) {
        out.push("tcmalloc");
    }
    if any(&["mi_malloc", "mi_version"]) {
        out.push("mimalloc");
    }
    if out.is_empty() && any(&["malloc", "calloc"]) {
        out.push("own malloc");
    }
    if any(&["_Znwm", "_Znam"]) {
        out.push("C++ operator new");
    }
    if any(&[
        JVM_NEW_TLAB,
        JVM_OUTSIDE_TLAB,
        JVM_NEW_TLAB_OLD,
        JVM_OUTSIDE_TLAB_OLD,
    ]) {
        out.push("HotSpot Java heap");
    }
    if any(&V8_LAB_STEP_NAMES) {
        out.push("V8 JS heap");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_fit_the_shapes() {
        for spec in C_API.iter().chain(NAMED) {
            let slots: usize = spec.inputs.iter().map(|i| i.slots()).sum();
            assert_eq!(slots, spec.shape.inputs(), "{}", spec.name);
        }
    }

    #[test]
    fn prefixed_names_are_searched_once_each() {
        let all = symbols(&["my_".to_string(), "je_".to_string()]);
        let names: Vec<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
        for expected in [
            "malloc",
            "je_malloc",
            "_rjem_mallocx",
            "mi_free",
            "tc_calloc",
            "my_malloc",
            "_Znwm",
        ] {
            assert!(names.contains(&expected), "{expected}");
        }
        let mut sorted = names.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len());
    }

    #[test]
    fn allocation_symbols_are_recognised_under_prefixes() {
        assert!(is_allocation_symbol("malloc", &[]));
        assert!(is_allocation_symbol("je_free", &[]));
        assert!(is_allocation_symbol("_ZdlPv", &[]));
        assert!(is_allocation_symbol("my_calloc", &["my_".to_string()]));
        assert!(!is_allocation_symbol("my_calloc", &[]));
        assert!(!is_allocation_symbol("memcpy", &[]));
    }

    #[test]
    fn families_are_named_from_their_marker_symbols() {
        let jemalloc = ["malloc", "mallocx", "_Znwm"];
        assert_eq!(
            families(|n| jemalloc.contains(&n)),
            ["jemalloc", "C++ operator new"]
        );
        assert_eq!(families(|n| n == "malloc"), ["own malloc"]);
        let glibc = ["malloc", "gnu_get_libc_version", "__libc_start_main"];
        assert_eq!(families(|n| glibc.contains(&n)), ["glibc"]);
    }
}
