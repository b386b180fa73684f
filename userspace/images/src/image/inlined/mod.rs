//! CPython's small-object allocator where the compiler inlined it into its callers.
//!
//! A link-time optimised interpreter (Debian's `python3.x`) inlines `PyObject_Malloc`
//! into many of its own functions (`_PyLong_New`, the tuple and list constructors...):
//! those allocations pass through no probed function. Each inlined copy starts the same
//! way: the domain's allocator function pointer (`_PyObject.malloc`) is compared with
//! the default allocator (`_PyObject_Malloc`), and a conditional branch takes the
//! inlined pymalloc fast path when they match (a hook such as tracemalloc's takes the
//! indirect call instead, and calls the default allocator itself, which is not probed).
//! That branch is a relative jump, which the kernel emulates: the site is probed there.
//!
//! What the site allocates is read from the first instruction of its inlined path:
//! - `lea -1(%R), ...` or `cmp $0x200, %R` (the size-class computation or the small
//!   request check): the size is in register `R` at the branch;
//! - a load of `usedpools[2 * class]` at a constant address: the compiler folded a
//!   constant size into the site. The request is the constant the other path (the
//!   hooked allocator's call) passes in `%rsi`, when found and in the class; else the
//!   class's `16 * (class + 1)` bytes stand for it (the block pymalloc gives it; the
//!   request was at most that and more than 16 bytes less).
//!
//! The default allocator's address and `usedpools` come from the exported
//! `PyObject_Malloc`, which holds the same comparison and the same indexed load. An
//! interpreter whose `PyObject_Malloc` has no such comparison (one built without
//! link-time optimisation: every allocation calls the exported function) has no sites.
//! Everything else is skipped and counted; the sites are bounded
//! ([`MAX_INLINED_SITES`]) since the file is another user's input.
//!
//! `PyObject_Free` is inlined the same way, compared with `_PyObject_Free`: its sites
//! ([`free`]) retire tracked blocks under `--live`. A site's block, which it has no
//! return to give, is predicted at the branch from `usedpools` ([`Usedpools`], which
//! the process's Python registration resolves to an address).

use allocbpf_common::{cookie::Reg, AllocFn, Shape};
use iced_x86::{
    Code, Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfoFactory, Mnemonic,
    OpKind, Register,
};
use object::{Object, ObjectSection, ObjectSymbol, SectionKind};

use super::{
    addresses::{code_at, file_offset_of},
    point, ProbePoint, ProbedEntry,
};

mod free;
mod size;

use size::{constant_request, in_class, size_of_path};

/// Most inlined sites probed in one image: a hostile file could repeat the pattern
/// without end, and each site is a uprobe.
pub const MAX_INLINED_SITES: usize = 1024;

/// Most comparisons with the default allocator left unrecognised before the search
/// gives up on the image.
const MAX_UNRECOGNISED: usize = 1024;

/// Most bytes of code decoded in one image (an interpreter has a few megabytes).
const MAX_DECODED_BYTES: usize = 64 << 20;

/// Bytes of `PyObject_Malloc` decoded at most for its comparison and `usedpools`.
const MAX_ENTRY_BYTES: usize = 512;

/// `usedpools`' span: two pointers per size class, 64 classes at most.
const USEDPOOLS_BYTES: u64 = 64 * 16;

/// pymalloc's size-class granularity on 64-bit builds (`ALIGNMENT`).
const SIZE_CLASS_BYTES: u64 = 16;

/// What [`find`] found in one image.
#[derive(Clone, Debug, Default)]
pub struct InlinedSites {
    /// The allocation sites to probe.
    pub sites: Vec<ProbedEntry>,
    /// The deallocation sites, probed with live tracking (inlined `PyObject_Free`).
    pub frees: Vec<ProbedEntry>,
    /// Comparisons with the default allocator or deallocator whose inlined path did
    /// not start in a way this module reads (left unprobed).
    pub unrecognised: usize,
    /// Those of them with the default deallocator.
    pub unrecognised_frees: usize,
    /// `_PyObject_Free`'s address, when found.
    pub default_free: Option<u64>,
    /// Where `usedpools` is, when found.
    pub usedpools: Option<Usedpools>,
    /// Every text section was searched (no cap was reached).
    pub searched_all: bool,
}

impl InlinedSites {
    /// True if `--live` can predict the blocks of the inlined allocation sites: every
    /// place a block dies is probed (each inlined deallocation site understood, and
    /// `_PyObject_Free` known), so a predicted block is never left live by a free
    /// nothing saw.
    pub fn predictable(&self) -> bool {
        self.searched_all
            && self.default_free.is_some()
            && self.unrecognised_frees == 0
            && self.usedpools.is_some()
    }
}

/// How `PyObject_Malloc` recognises its default allocator, read from its code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Markers {
    /// `_PyObject_Malloc`'s address, which every inlined copy compares with.
    default_allocator: u64,
    /// Where `usedpools` is.
    usedpools: Usedpools,
}

/// Where pymalloc's `usedpools` array is: a pair of pool pointers per size class, the
/// first of which is the pool a small allocation of that class is served from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Usedpools {
    /// At a fixed address of the file (up to 3.11: a static array; 3.12 keeps it inside
    /// the interpreter, which is not read here).
    At(u64),
    /// At offset `usedpools` of the allocator state whose pointer is at offset `state`
    /// of the interpreter (3.13: `PyInterpreterState.obmalloc`).
    InState {
        /// Offset of the state's pointer in the interpreter.
        state: u64,
        /// Offset of `usedpools` in the state.
        usedpools: u64,
    },
}

/// Where `usedpools` is in `file`, when `--live` can predict the blocks of its inlined
/// allocation sites from it ([`InlinedSites::predictable`]; a file whose allocator is
/// not inlined needs no prediction).
pub fn usedpools(file: &object::File) -> Option<Usedpools> {
    let found = search(file, &[], &[]);
    if found.usedpools.is_some() && !found.predictable() {
        tracing::info!(
            "inlined small-object sites: {} deallocation sites not understood, \
             _PyObject_Free {}: --live does not track their blocks",
            found.unrecognised_frees,
            if found.default_free.is_some() {
                "found"
            } else {
                "not found"
            }
        );
    }
    found.predictable().then_some(found.usedpools?)
}

/// The address of the function `name` that `file` exports, and its code (at most
/// `limit` bytes).
fn exported_code<'a>(file: &'a object::File, name: &str, limit: usize) -> Option<(u64, &'a [u8])> {
    let symbol = file
        .dynamic_symbols()
        .find(|s| s.name() == Ok(name) && s.is_definition())?;
    let code = code_at(
        file,
        symbol.address(),
        (symbol.size() as usize).clamp(1, limit),
    )?;
    Some((symbol.address(), code))
}

/// Finds the inlined copies of `PyObject_Malloc` and `PyObject_Free` in `file`, whose
/// probed entries are `entries` and `frees` (a file that does not probe
/// `PyObject_Malloc` has none).
pub fn find(file: &object::File, entries: &[ProbedEntry], frees: &[ProbedEntry]) -> InlinedSites {
    if !entries.iter().any(|e| e.symbol == "PyObject_Malloc") {
        return InlinedSites::default();
    }
    search(file, entries, frees)
}

/// [`find`]'s search, outside the spans of `entries` and `frees`.
fn search(file: &object::File, entries: &[ProbedEntry], frees: &[ProbedEntry]) -> InlinedSites {
    let mut found = InlinedSites::default();
    let Some((address, code)) = exported_code(file, "PyObject_Malloc", MAX_ENTRY_BYTES) else {
        return found;
    };
    let Some(markers) = markers(code, address) else {
        return found;
    };
    // The default allocator is code of this image: `_PyObject_Malloc` itself where the
    // symbol table names it.
    let named = file
        .symbols()
        .find(|symbol| symbol.name() == Ok("_PyObject_Malloc"))
        .map(|symbol| symbol.address());
    if code_at(file, markers.default_allocator, 1).is_none()
        || named.is_some_and(|address| address != markers.default_allocator)
    {
        return found;
    }
    let span = |e: &ProbedEntry| (e.address, e.address + e.size.max(1));
    let targets = Targets {
        markers,
        default_free: free::default_free(file),
        probed: entries.iter().map(span).collect(),
        probed_frees: frees.iter().map(span).collect(),
    };
    found.default_free = targets.default_free;
    found.usedpools = Some(markers.usedpools);
    found.searched_all = true;
    let mut budget = MAX_DECODED_BYTES;
    for section in file.sections() {
        if section.kind() != SectionKind::Text {
            continue;
        }
        let Ok(data) = section.data() else {
            continue;
        };
        let data = &data[..data.len().min(budget)];
        budget -= data.len();
        scan(file, data, section.address(), &targets, &mut found);
        if found.sites.len() + found.frees.len() >= MAX_INLINED_SITES
            || found.unrecognised >= MAX_UNRECOGNISED
            || budget == 0
        {
            found.searched_all = false;
            break;
        }
    }
    if let Some(entry) = targets
        .default_free
        .and_then(|default| free::default_free_entry(file, default, frees))
    {
        found.frees.push(entry);
    }
    found
}

/// The default allocator and `usedpools` as `PyObject_Malloc` (`code` at `ip`) uses
/// them, on its straight-line path: the first comparison of a register with a constant
/// address (or with one a `lea` of the code's own position loaded) that a `jne`/`je`
/// follows, and the first load indexed by 8 from a constant address (or from such a
/// register, or from a register loaded from another plus an offset: the state).
fn markers(code: &[u8], ip: u64) -> Option<Markers> {
    let (default_allocator, usedpools) = entry_facts(code, ip, true);
    Some(Markers {
        default_allocator: default_allocator?,
        usedpools: usedpools?,
    })
}

/// The default function an entry (`code` at `ip`) compares its domain's pointer with,
/// as [`markers`] finds it.
fn compared_default(code: &[u8], ip: u64) -> Option<u64> {
    entry_facts(code, ip, false).0
}

/// [`markers`]' search: the compared default, and `usedpools` if `with_usedpools`.
fn entry_facts(code: &[u8], ip: u64, with_usedpools: bool) -> (Option<u64>, Option<Usedpools>) {
    let mut decoder = Decoder::with_ip(64, code, ip, DecoderOptions::NONE);
    let mut info = InstructionInfoFactory::new();
    // Registers holding a `lea`'s address, and registers loaded from a register plus
    // an offset (with that offset), until written again.
    let mut addresses: Vec<(Register, u64)> = Vec::new();
    let mut loaded_from: Vec<(Register, u64)> = Vec::new();
    let value = |known: &[(Register, u64)], register: Register| {
        known
            .iter()
            .find(|(r, _)| *r == register.full_register())
            .map(|(_, v)| *v)
    };
    let (mut default_allocator, mut usedpools) = (None, None);
    let mut compared: Option<u64> = None;
    while decoder.can_decode()
        && (default_allocator.is_none() || (with_usedpools && usedpools.is_none()))
    {
        let instruction = decoder.decode();
        if instruction.is_invalid() {
            break;
        }
        // A comparison counts only if a `jne`/`je` takes its result.
        if let Some(address) = compared.take() {
            if default_allocator.is_none()
                && matches!(instruction.mnemonic(), Mnemonic::Jne | Mnemonic::Je)
            {
                default_allocator = Some(address);
            }
        }
        if instruction.mnemonic() == Mnemonic::Cmp && instruction.op0_kind() == OpKind::Register {
            compared = match instruction.op1_kind() {
                OpKind::Immediate32to64 => Some(instruction.immediate32to64() as u64),
                OpKind::Register => value(&addresses, instruction.op0_register())
                    .or(value(&addresses, instruction.op1_register())),
                _ => None,
            };
        }
        if with_usedpools
            && usedpools.is_none()
            && has_memory_operand(&instruction)
            && instruction.memory_index() != Register::None
            && instruction.memory_index_scale() == 8
        {
            let displacement = instruction.memory_displacement64();
            let base = instruction.memory_base();
            usedpools = match (value(&addresses, base), value(&loaded_from, base)) {
                _ if base == Register::None => Some(Usedpools::At(displacement)),
                (Some(address), _) => Some(Usedpools::At(address.wrapping_add(displacement))),
                (None, Some(state)) => Some(Usedpools::InState {
                    state,
                    usedpools: displacement,
                }),
                (None, None) => None,
            };
        }
        match instruction.flow_control() {
            FlowControl::Next | FlowControl::ConditionalBranch => {}
            FlowControl::Call | FlowControl::IndirectCall => {
                addresses.clear();
                loaded_from.clear();
                continue;
            }
            _ => break,
        }
        let written = point::written_registers(&mut info, &instruction);
        addresses.retain(|(r, _)| !written.contains(r));
        loaded_from.retain(|(r, _)| !written.contains(r));
        let destination = instruction.op0_register().full_register();
        if instruction.mnemonic() == Mnemonic::Lea && instruction.is_ip_rel_memory_operand() {
            addresses.push((destination, instruction.ip_rel_memory_address()));
        } else if let Some(offset) = load_offset(&instruction) {
            loaded_from.push((destination, offset));
        }
    }
    (
        default_allocator.filter(|&a| a != 0),
        usedpools.filter(|&u| u != Usedpools::At(0)),
    )
}

/// For `mov offset(%reg), %r64` (a load from a register plus an offset, not the code's
/// own position): the offset.
fn load_offset(instruction: &Instruction) -> Option<u64> {
    (instruction.code() == Code::Mov_r64_rm64
        && instruction.op1_kind() == OpKind::Memory
        && instruction.memory_index() == Register::None
        && instruction.memory_base().is_gpr64())
    .then(|| instruction.memory_displacement64())
}

/// True if one of the instruction's operands is in memory.
fn has_memory_operand(instruction: &Instruction) -> bool {
    (0..instruction.op_count()).any(|i| instruction.op_kind(i) == OpKind::Memory)
}

/// What [`scan`] looks for: the comparisons with the default allocator and
/// deallocator, outside the entries probed anyway.
struct Targets {
    markers: Markers,
    /// `_PyObject_Free`'s address, as the exported `PyObject_Free` compares with it.
    default_free: Option<u64>,
    /// The probed allocation entries' spans.
    probed: Vec<(u64, u64)>,
    /// The probed deallocation entries' spans.
    probed_frees: Vec<(u64, u64)>,
}

/// Decodes the text section `data` at `base` and adds every inlined site in it, until
/// [`MAX_INLINED_SITES`] sites or [`MAX_UNRECOGNISED`] unrecognised comparisons.
fn scan(file: &object::File, data: &[u8], base: u64, targets: &Targets, found: &mut InlinedSites) {
    let defaults = [
        Some(targets.markers.default_allocator),
        targets.default_free,
    ];
    let inside = |spans: &[(u64, u64)], ip: u64| spans.iter().any(|&(s, e)| (s..e).contains(&ip));
    let mut decoder = Decoder::with_ip(64, data, base, DecoderOptions::NONE);
    let mut info = InstructionInfoFactory::new();
    let mut previous = Instruction::default();
    // Registers a `lea` of a default's address loaded (position-independent code
    // compares with a register, not a constant), until written again or a branch.
    let mut holding: Vec<(Register, u64)> = Vec::new();
    let mut instruction = Instruction::default();
    while decoder.can_decode() {
        decoder.decode_out(&mut instruction);
        if instruction.is_invalid() {
            holding.clear();
            previous = Instruction::default();
            continue;
        }
        let compared = (instruction.is_jcc_short_or_near()
            && matches!(instruction.mnemonic(), Mnemonic::Jne | Mnemonic::Je))
        .then(|| compared_with(&previous, &defaults, &holding))
        .flatten();
        let ip = instruction.ip();
        let site = match compared {
            Some(a) if a == targets.markers.default_allocator && !inside(&targets.probed, ip) => {
                Some(site(file, data, base, &instruction, targets.markers).map(|s| (s, false)))
            }
            Some(a) if Some(a) == targets.default_free && !inside(&targets.probed_frees, ip) => {
                match free::site(file, data, base, &instruction) {
                    free::Freed::Site(site) => Some(Some((site, true))),
                    free::Freed::Nothing => None,
                    free::Freed::Unknown => {
                        found.unrecognised_frees += 1;
                        Some(None)
                    }
                }
            }
            _ => None,
        };
        match site {
            Some(Some((site, false))) => found.sites.push(site),
            Some(Some((site, true))) => found.frees.push(site),
            Some(None) => found.unrecognised += 1,
            None => {}
        }
        if found.sites.len() + found.frees.len() >= MAX_INLINED_SITES
            || found.unrecognised >= MAX_UNRECOGNISED
        {
            return;
        }
        if instruction.flow_control() != FlowControl::Next {
            holding.clear();
        } else {
            if !holding.is_empty() {
                let written = point::written_registers(&mut info, &instruction);
                holding.retain(|(r, _)| !written.contains(r));
            }
            if instruction.mnemonic() == Mnemonic::Lea && instruction.is_ip_rel_memory_operand() {
                let address = instruction.ip_rel_memory_address();
                if defaults.contains(&Some(address)) {
                    holding.push((instruction.op0_register().full_register(), address));
                }
            }
        }
        previous = instruction;
    }
}

/// The default among `defaults` that `instruction` compares a register with (an
/// immediate, or a register in `holding`, which holds it).
fn compared_with(
    instruction: &Instruction,
    defaults: &[Option<u64>],
    holding: &[(Register, u64)],
) -> Option<u64> {
    if instruction.mnemonic() != Mnemonic::Cmp || instruction.op0_kind() != OpKind::Register {
        return None;
    }
    let address = match instruction.op1_kind() {
        OpKind::Immediate32to64 => instruction.immediate32to64() as u64,
        OpKind::Register => [instruction.op0_register(), instruction.op1_register()]
            .iter()
            .find_map(|r| {
                holding
                    .iter()
                    .find(|(h, _)| *h == r.full_register())
                    .map(|(_, a)| *a)
            })?,
        _ => return None,
    };
    defaults.contains(&Some(address)).then_some(address)
}

/// The probed site of the branch `jump`, if its inlined path starts in a way that
/// tells the size.
fn site(
    file: &object::File,
    data: &[u8],
    base: u64,
    jump: &Instruction,
    markers: Markers,
) -> Option<ProbedEntry> {
    // `jne` falls through into the inlined path; `je` jumps to it.
    let path = match jump.mnemonic() {
        Mnemonic::Jne => jump.next_ip(),
        _ => jump.near_branch_target(),
    };
    let (register, mut multiplier) = size_of_path(data, base, path, markers.usedpools)?;
    if register == Reg::One {
        // A constant size: the class's bytes, or the request itself where the hooked
        // path passes it.
        let hooked = match jump.mnemonic() {
            Mnemonic::Jne => jump.near_branch_target(),
            _ => jump.next_ip(),
        };
        let request = hooked
            .checked_sub(base)
            .and_then(|start| data.get(start as usize..))
            .and_then(|code| constant_request(code, hooked, data, base));
        if let Some(request) = request.filter(|&r| in_class(r, multiplier)) {
            multiplier = request;
        }
    }
    let site = Site {
        symbol: "PyObject_Malloc",
        function: AllocFn::Malloc,
        shape: Shape::SmallObject,
        register,
        size: multiplier,
    };
    site.at(file, data, base, jump)
}

/// What a site at a branch probes: the entry's name, function and shape, the register
/// of its input, and its cookie's size field.
struct Site {
    symbol: &'static str,
    function: AllocFn,
    shape: Shape,
    register: Reg,
    size: u64,
}

impl Site {
    /// The probed entry at the branch `jump` of the text section `data` at `base`.
    fn at(
        self,
        file: &object::File,
        data: &[u8],
        base: u64,
        jump: &Instruction,
    ) -> Option<ProbedEntry> {
        let at = (jump.ip() - base) as usize;
        let bytes = data.get(at..at + jump.len())?;
        let point = ProbePoint {
            offset: 0,
            registers: [self.register, Reg::One, Reg::One],
            overflow_check: false,
            instruction: jump.to_string(),
            emulated: point::is_emulated(jump, bytes),
        };
        let symbol = format!("{} (inlined, {:#x})", self.symbol, jump.ip());
        self.entry(file, symbol, jump.ip(), point)
    }

    /// The probed entry named `symbol` at `address`, probed at `point`.
    fn entry(
        self,
        file: &object::File,
        symbol: String,
        address: u64,
        point: ProbePoint,
    ) -> Option<ProbedEntry> {
        Some(ProbedEntry {
            symbol,
            function: self.function,
            shape: self.shape,
            file_offset: file_offset_of(file, address)?,
            address,
            size: self.size,
            point,
            wrapper: false,
            nests: false,
            nest_span: 0,
            nests_checked: false,
            forward_call_depth: None,
            tail_forward: false,
            tail_only_if_null: false,
        })
    }
}

/// True if `register` is a general-purpose register other than `rsp` that no
/// instruction read so far (`written`) wrote: it still holds its value at the path's
/// start.
fn untouched(register: Register, written: &[Register]) -> bool {
    register.is_gpr64() && register != Register::RSP && !written.contains(&register)
}

#[cfg(test)]
mod tests;
