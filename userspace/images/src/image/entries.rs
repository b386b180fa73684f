//! Which allocation entries a file defines, and how each is probed: at which
//! instruction, as a wrapper or not, or not at all (an entry that only forwards to
//! another probed entry is counted where it lands).
//!
//! In four steps over the file's symbols: the candidates (catalogue entries the file
//! defines), what each forwards to ([`calls`]), which are skipped (forward-only stubs,
//! or entries proven forward-only by [`purity`] whose frame can be unwound), then the
//! probe point of each entry kept ([`point`]).

use std::collections::HashMap;

use allocbpf_common::{cookie::NEST_SPAN_UNIT, Shape};
use object::{Object, ObjectSegment, ObjectSymbol};

use super::{
    addresses::file_offset_of, calls, cfi, frame, indirect, point, purity, CallFrame, Lookup,
    ProbedEntry, SkippedEntry,
};
use crate::allocators::{self, EntrySpec};

/// What [`resolve_entries`] finds in a file.
#[derive(Clone, Debug, Default)]
pub struct ResolvedEntries {
    /// Family names.
    pub families: Vec<&'static str>,
    /// Allocation entries to probe.
    pub entries: Vec<ProbedEntry>,
    /// Deallocation entries (probed when live blocks are tracked).
    pub frees: Vec<ProbedEntry>,
    /// Entries not probed.
    pub skipped: Vec<SkippedEntry>,
    /// The frames of unprobed entries at their calls to probed ones, for unwinding
    /// stacks sampled in the callee (`frame`).
    pub call_frames: Vec<CallFrame>,
}

/// A defined entry before the probe decision.
struct Candidate {
    symbol: String,
    spec: EntrySpec,
    address: u64,
    size: u64,
    file_offset: u64,
}

/// Finds the allocation entries in a parsed file (`data` is its bytes) and decides how
/// each is probed. Fails, saying why, when there is no allocation entry to probe.
pub fn resolve_entries(
    file: &object::File,
    data: &[u8],
    lookup: &Lookup,
) -> Result<ResolvedEntries, String> {
    let prefixes = lookup.prefixes.as_slice();
    let by_name = defined_text_symbols(file);
    let catalogue = allocators::symbols(prefixes);
    let candidates = candidates(file, &by_name, &catalogue);
    if !candidates.iter().any(|c| c.spec.shape != Shape::Free) {
        return Err("it defines no allocation entry".to_string());
    }
    let resolution = Resolution::new(file, data, lookup, &catalogue, candidates);
    let mut out = ResolvedEntries {
        families: allocators::families(|name| by_name.contains_key(name)),
        ..ResolvedEntries::default()
    };
    let skipped = resolution.skipped(&mut out.call_frames);
    for (i, skip) in skipped.into_iter().enumerate() {
        let (candidate, forwards) = (&resolution.candidates[i], &resolution.forwards[i]);
        if skip {
            out.skipped.push(SkippedEntry {
                symbol: candidate.symbol.clone(),
                reason: format!("forwards to {}", forwards.targets.join(", ")),
            });
            continue;
        }
        let mut entry = resolution.probed_entry(i);
        if entry.nests {
            entry.nest_span = allocator_span(file, &by_name, entry.address);
        }
        if entry.shape == Shape::Free {
            out.frees.push(entry);
        } else {
            out.entries.push(entry);
        }
    }
    out.frees = indirect::follow_frees(file, std::mem::take(&mut out.frees));
    if out.entries.is_empty() {
        return Err(format!(
            "its allocation entries all forward to other files ({})",
            out.skipped
                .iter()
                .map(|s| s.symbol.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    Ok(out)
}

/// How far from `entry`, either way, a call nested in a CPython allocator returns
/// (`ProbeCookie::nests`), rounded up to whole [`NEST_SPAN_UNIT`]s.
///
/// Where the symbol table names obmalloc's own functions (`_PyObject_Malloc`,
/// `pymalloc_alloc`...: builds that keep it, pyenv's), the span covers them and the
/// exported `PyObject_*`/`PyMem_*` entries: a few KiB. A stripped interpreter (Debian's)
/// reaches its allocators through static functions nothing names, anywhere in its text:
/// the span is then the executable segment holding the entry, so a call from the
/// interpreter's own code that follows a returned wrapper whose stack slot was not
/// overwritten yet could be taken for nested (docs/design.md, "Python").
fn allocator_span(file: &object::File, by_name: &HashMap<&str, (u64, u64)>, entry: u64) -> u64 {
    const STATIC_ALLOCATORS: &[&str] = &[
        "_PyObject_Malloc",
        "_PyObject_Calloc",
        "_PyObject_Realloc",
        "_PyObject_Free",
        "_PyMem_RawMalloc",
        "_PyMem_RawCalloc",
        "_PyMem_RawRealloc",
        "pymalloc_alloc",
    ];
    // The allocating functions of Objects/obmalloc.c, by name or prefix. Not every
    // `PyMem_` or `_PyMem_` function is one: tracemalloc's `_PyMem_DumpTraceback` and
    // the `.cold` part of `_PyMem_SetupAllocators` lie a megabyte away in pyenv's
    // 3.12, and a span reaching them held the bytes object's code, whose calls of
    // `PyObject_Calloc` were then taken for a stale wrapper's nested calls.
    const ALLOCATORS: &[&str] = &[
        "PyObject_Malloc",
        "PyObject_Calloc",
        "PyObject_Realloc",
        "PyObject_Free",
        "PyMem_Malloc",
        "PyMem_Calloc",
        "PyMem_Realloc",
        "PyMem_Free",
        "PyMem_Raw",
        "_PyMem_Raw",
        "_PyMem_Debug",
        "_PyObject_Malloc",
        "_PyObject_Calloc",
        "_PyObject_Realloc",
        "_PyObject_Free",
        "pymalloc_",
        "allocate_from_new_pool",
    ];
    let reach = |start: u64, end: u64| entry.abs_diff(start).max(entry.abs_diff(end));
    let named = STATIC_ALLOCATORS
        .iter()
        .any(|name| by_name.contains_key(name));
    let span = if named {
        by_name
            .iter()
            .filter(|(name, _)| {
                // A compiler's split-off cold part lies elsewhere.
                !name.contains(".cold") && ALLOCATORS.iter().any(|prefix| name.starts_with(prefix))
            })
            .map(|(_, &(address, size))| reach(address, address + size.max(1)))
            .max()
            .unwrap_or(0)
    } else {
        file.segments()
            .map(|segment| (segment.address(), segment.address() + segment.size()))
            .find(|&(start, end)| (start..end).contains(&entry))
            .map_or(0, |(start, end)| reach(start, end))
    };
    span.div_ceil(NEST_SPAN_UNIT)
        .min(allocbpf_common::cookie::MAX_CODE_SIZE)
}

/// Defined function symbols by name (dynamic first): (address, size).
fn defined_text_symbols<'data>(file: &object::File<'data>) -> HashMap<&'data str, (u64, u64)> {
    let mut by_name = HashMap::new();
    for symbol in file.dynamic_symbols().chain(file.symbols()) {
        if !symbol.is_definition() || symbol.kind() != object::SymbolKind::Text {
            continue;
        }
        if let Ok(name) = symbol.name() {
            by_name
                .entry(name)
                .or_insert((symbol.address(), symbol.size()));
        }
    }
    by_name
}

/// The catalogue's entries the file defines, one per address.
fn candidates(
    file: &object::File,
    by_name: &HashMap<&str, (u64, u64)>,
    catalogue: &[(String, EntrySpec)],
) -> Vec<Candidate> {
    let mut candidates: Vec<Candidate> = Vec::new();
    for (symbol, spec) in catalogue {
        let Some(&(address, size)) = by_name.get(symbol.as_str()) else {
            continue;
        };
        if candidates.iter().any(|c| c.address == address) {
            // An alias of an entry already found (glibc: aligned_alloc == memalign).
            continue;
        }
        let Some(file_offset) = file_offset_of(file, address) else {
            continue;
        };
        candidates.push(Candidate {
            symbol: symbol.clone(),
            spec: *spec,
            address,
            size,
            file_offset,
        });
    }
    candidates
}

/// The candidates of one file with what each forwards to: the state of the decisions.
struct Resolution<'a> {
    file: &'a object::File<'a>,
    data: &'a [u8],
    lookup: &'a Lookup,
    /// The catalogue's (symbol, spec) pairs under the lookup's prefixes.
    catalogue: &'a [(String, EntrySpec)],
    candidates: Vec<Candidate>,
    forwards: Vec<calls::Forwards>,
    resolver: calls::CallResolver<'a, 'a>,
    addresses: Vec<u64>,
}

impl<'a> Resolution<'a> {
    fn new(
        file: &'a object::File<'a>,
        data: &'a [u8],
        lookup: &'a Lookup,
        catalogue: &'a [(String, EntrySpec)],
        candidates: Vec<Candidate>,
    ) -> Self {
        let mut resolution = Resolution {
            file,
            data,
            lookup,
            catalogue,
            resolver: calls::CallResolver::new(file),
            addresses: candidates.iter().map(|c| c.address).collect(),
            candidates,
            forwards: Vec::new(),
        };
        resolution.forwards = resolution
            .candidates
            .iter()
            .map(|c| {
                resolution.resolver.forwards(
                    resolution.code_of(c, usize::MAX),
                    c.address,
                    &resolution.addresses,
                    |name| resolution.is_allocation(name),
                )
            })
            .collect();
        resolution
    }

    fn is_allocation(&self, name: &str) -> bool {
        allocators::is_allocation_symbol(name, &self.lookup.prefixes)
    }

    /// The first bytes of a candidate's code (at least 16, at most `max`).
    fn code_of(&self, c: &Candidate, max: usize) -> &'a [u8] {
        let start = c.file_offset as usize;
        let len = (c.size as usize).max(16).min(max);
        let data = self.data;
        data.get(start..data.len().min(start + len)).unwrap_or(&[])
    }

    /// Which candidates are skipped; the frames of those skipped that call their
    /// forward go to `call_frames`.
    fn skipped(&self, call_frames: &mut Vec<CallFrame>) -> Vec<bool> {
        // An image whose every allocation entry forwards (a C++ runtime's operator new
        // calling malloc) allocates nothing itself: its entries are counted where they
        // land.
        let allocates_itself = self
            .candidates
            .iter()
            .zip(&self.forwards)
            .any(|(c, f)| c.spec.shape != Shape::Free && f.targets.is_empty());
        // Which entries are skipped, and which of those because they are forward-only
        // and *call* their forward.
        let mut skipped: Vec<bool> = Vec::new();
        let mut calling_forwarder: Vec<bool> = Vec::new();
        let mut frames_of: Vec<Vec<CallFrame>> = Vec::new();
        for (candidate, forwards) in self.candidates.iter().zip(&self.forwards) {
            let stub = !forwards.targets.is_empty() && (forwards.tail_stub || !allocates_itself);
            let proof = (!stub && !forwards.targets.is_empty())
                .then(|| {
                    purity::Purity::new(&self.resolver, &self.addresses, |name| {
                        self.is_allocation(name)
                    })
                    .forward_only(
                        candidate.address..candidate.address + candidate.size,
                        candidate.spec.shape == Shape::PosixMemalign,
                    )
                })
                .flatten();
            // A forward-only entry that calls its forward leaves its own frame on the
            // stack: skipped only if that frame can be unwound (see `Lookup`), from its
            // unwind table entry or from the frame derived from its code.
            let frames = proof.as_ref().and_then(|p| p.call_frames.as_ref());
            let frame_unwinds = !forwards.calls
                || (self.lookup.unwind_tables
                    && (cfi::has_fde_at(self.file, candidate.address) || frames.is_some()));
            let forward_only = proof.is_some() && frame_unwinds;
            frames_of.push(match forward_only && forwards.calls {
                true => frames.into_iter().flatten().copied().collect(),
                false => Vec::new(),
            });
            skipped.push(stub || forward_only);
            calling_forwarder.push(forward_only && forwards.calls);
        }
        // The frames are kept in candidate order, whatever is kept probed below (as
        // before this step existed).
        call_frames.extend(frames_of.into_iter().flatten());
        self.keep_reached_wrappers(&mut skipped, &mut calling_forwarder);
        skipped
    }

    /// A probed wrapper recognises its nested call by a return address inside its own
    /// code: a call through an unprobed entry that calls would not be recognised and
    /// would count twice. So an entry a probed wrapper reaches stays probed (as a
    /// wrapper itself), until no such entry is left.
    fn keep_reached_wrappers(&self, skipped: &mut [bool], calling_forwarder: &mut [bool]) {
        loop {
            let reached = |i: usize| {
                let c = &self.candidates[i];
                let by_address = format!("{:#x}", c.address);
                (0..self.candidates.len()).any(|j| {
                    !skipped[j]
                        && self.forwards[j]
                            .targets
                            .iter()
                            .any(|t| *t == by_address || *t == c.symbol)
                })
            };
            let Some(i) = (0..self.candidates.len())
                .find(|&i| skipped[i] && calling_forwarder[i] && reached(i))
            else {
                break;
            };
            skipped[i] = false;
            calling_forwarder[i] = false;
        }
    }

    /// The shape of a forward target: a same-image entry by address, or a symbol.
    fn shape_of(&self, target: &str) -> Option<Shape> {
        match target.strip_prefix("0x") {
            Some(hex) => {
                let address = u64::from_str_radix(hex, 16).ok()?;
                self.candidates
                    .iter()
                    .find(|c| c.address == address)
                    .map(|c| c.spec.shape)
            }
            None => self
                .catalogue
                .iter()
                .find(|(n, _)| n == target)
                .map(|(_, s)| s.shape),
        }
    }

    /// How candidate `i`, kept, is probed.
    fn probed_entry(&self, i: usize) -> ProbedEntry {
        let (candidate, forwards) = (&self.candidates[i], &self.forwards[i]);
        let resizes =
            |shape: Shape| matches!(shape, Shape::Resize | Shape::ResizeArray | Shape::InPlace);
        let prologue = self.code_of(candidate, point::MAX_PROLOGUE_BYTES);
        ProbedEntry {
            symbol: candidate.symbol.clone(),
            function: candidate.spec.function,
            shape: candidate.spec.shape,
            file_offset: candidate.file_offset,
            address: candidate.address,
            size: candidate.size,
            point: point::choose_for_run(prologue, candidate.address, candidate.spec.inputs),
            wrapper: !forwards.targets.is_empty() || candidate.spec.nests,
            nests: candidate.spec.nests,
            nest_span: 0,
            nests_checked: false,
            forward_call_depth: (!forwards.targets.is_empty())
                .then(|| {
                    frame::straight_call_depth(prologue, candidate.address, |call| {
                        self.resolver
                            .forward_target(call, candidate.address, &self.addresses, |name| {
                                self.is_allocation(name)
                            })
                            .is_some()
                    })
                })
                .flatten(),
            tail_forward: forwards.tail,
            tail_only_if_null: resizes(candidate.spec.shape)
                && forwards
                    .tail_targets
                    .iter()
                    .all(|t| self.shape_of(t).is_some_and(|shape| !resizes(shape))),
        }
    }
}
