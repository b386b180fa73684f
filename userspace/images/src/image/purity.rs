//! Whether a forwarding entry can allocate by itself.
//!
//! musl's `calloc` checks for overflow, calls `malloc`, and clears the block with
//! `memset`; tcmalloc's `posix_memalign` calls `tc_memalign` and stores the result
//! through its first argument. Such an entry makes no allocation of its own: every
//! block it returns came from a probed entry it called, where the allocation is
//! counted. Probing it as well would only add a trap and, to recognise the nested
//! call, a user-memory read to every call.
//!
//! An entry is proven *forward-only* by walking every instruction reachable from its
//! first byte (jumps followed, calls analysed) and finding nothing that could update
//! allocator state: allocating means writing the allocator's own memory, so
//! - every memory write must go to the stack, be a constant stored to TLS through
//!   `%fs` or to `errno` through the pointer `__errno_location` just returned (errno
//!   codes are constants; thread caches are updated from registers), or, for
//!   `posix_memalign`, through its unchanged first argument (the caller's out
//!   pointer);
//! - every call or jump leaving the entry must go to an allocation entry (a forward),
//!   to a function known to allocate nothing (`memset`, `__errno_location`...), or to
//!   a local function that passes the same test (depth-limited), and never through a
//!   register or an unknown slot;
//! - no system call (`mmap` allocates);
//! - one more kind of write is allowed: storing the page size (a value
//!   `getpagesize` just returned) to a global, as tcmalloc's `valloc` caches it. Such a
//!   store is idempotent: every call writes the same value, so it cannot be the state
//!   change an allocation needs (each allocation must leave different state behind to
//!   return a different block).
//!
//! Register facts (which register holds `errno`'s address or the out pointer) are
//! tracked along every path and met at joins, so a write is allowed only if the fact
//! holds on every path to it. Anything unknown, or more code than the budget, fails
//! the proof: the entry is then probed as a wrapper, which is always correct.

use std::collections::HashMap;
use std::ops::Range;

use iced_x86::{
    Decoder, DecoderOptions, FlowControl, Instruction, InstructionInfo, InstructionInfoFactory,
    Mnemonic, OpAccess, OpKind, Register, UsedMemory,
};

use super::calls::{Branch, CallResolver};
use super::frame::{writes, CallFrame, FrameState};

/// Instructions examined at most for one entry, callees included.
const BUDGET: usize = 4096;

/// Nested local calls followed at most.
const MAX_DEPTH: u32 = 2;

/// Registers a call preserves (System V x86-64).
const CALLEE_SAVED: [Register; 6] = [
    Register::RBX,
    Register::RBP,
    Register::R12,
    Register::R13,
    Register::R14,
    Register::R15,
];

/// What is known at one instruction, on every path reaching it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Facts {
    /// `rax` holds what `__errno_location` returned.
    errno_in_rax: bool,
    /// Bit `i` set: general register `i` (iced's 64-bit numbering) holds the entry's
    /// first argument, unchanged.
    out_pointer: u32,
    /// Bit `i` set: general register `i` holds the page size (`getpagesize`'s result,
    /// possibly sign-extended).
    page_size: u32,
    /// The entry's stack frame (its own code only; a local callee's is not followed).
    frame: FrameState,
}

impl Facts {
    fn meet(self, other: Facts) -> Facts {
        Facts {
            errno_in_rax: self.errno_in_rax && other.errno_in_rax,
            out_pointer: self.out_pointer & other.out_pointer,
            page_size: self.page_size & other.page_size,
            frame: self.frame.meet(other.frame),
        }
    }
}

/// Bit of a general-purpose register in [`Facts::out_pointer`], if it is one.
fn bit(register: Register) -> Option<u32> {
    let full = register.full_register();
    (full.is_gpr64()).then(|| 1 << (full as u32 - Register::RAX as u32))
}

/// What the proof found about a forward-only entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForwardOnly {
    /// The entry's frame at each of its calls to an allocation entry (none if it only
    /// tail-jumps), or `None` if some call's frame could not be derived.
    pub call_frames: Option<Vec<CallFrame>>,
}

/// The forward-only proof for one entry.
pub struct Purity<'a, 'data, 'file, F: Fn(&str) -> bool> {
    resolver: &'a CallResolver<'data, 'file>,
    /// The image's allocation entry addresses.
    entries: &'a [u64],
    is_allocation: F,
    budget: usize,
    info: InstructionInfoFactory,
    /// The frames at the entry's calls to allocation entries.
    call_frames: Vec<CallFrame>,
    /// Some such call's frame could not be derived.
    unknown_frame: bool,
    /// Code placed at an address of no section (tests of hand-assembled code).
    #[cfg(test)]
    extra: Option<(u64, &'a [u8])>,
}

impl<'a, 'data, 'file, F: Fn(&str) -> bool> Purity<'a, 'data, 'file, F> {
    /// A prover for entries of the file `resolver` reads.
    pub fn new(
        resolver: &'a CallResolver<'data, 'file>,
        entries: &'a [u64],
        is_allocation: F,
    ) -> Self {
        Purity {
            resolver,
            entries,
            is_allocation,
            budget: BUDGET,
            info: InstructionInfoFactory::new(),
            call_frames: Vec::new(),
            unknown_frame: false,
            #[cfg(test)]
            extra: None,
        }
    }

    /// `Some` if the entry whose code spans `code` cannot allocate by itself and
    /// reaches at least one allocation entry. `out_pointer`: its first argument is
    /// an out pointer it may write through (`posix_memalign`).
    pub fn forward_only(mut self, code: Range<u64>, out_pointer: bool) -> Option<ForwardOnly> {
        let start = code.start;
        let facts = Facts {
            errno_in_rax: false,
            out_pointer: if out_pointer {
                bit(Register::RDI).unwrap_or(0)
            } else {
                0
            },
            page_size: 0,
            frame: FrameState::ENTRY,
        };
        match self.walk(start, Some(code), facts, 0)? {
            true => Some(ForwardOnly {
                call_frames: (!self.unknown_frame).then_some(self.call_frames),
            }),
            false => None,
        }
    }

    /// Walks the code reachable from `start`. `None`: it may allocate by itself;
    /// `Some(f)`: it cannot, and `f` says whether it reaches an allocation entry.
    /// `range`: the function's extent, when its symbol gives one; a direct jump out of
    /// it is a tail call.
    fn walk(
        &mut self,
        start: u64,
        range: Option<Range<u64>>,
        facts: Facts,
        depth: u32,
    ) -> Option<bool> {
        let mut seen: HashMap<u64, Facts> = HashMap::new();
        let mut work = vec![(start, facts)];
        let mut forwards = false;
        while let Some((address, incoming)) = work.pop() {
            let facts = match seen.get(&address) {
                Some(&known) if known.meet(incoming) == known => continue,
                Some(&known) => known.meet(incoming),
                None => incoming,
            };
            seen.insert(address, facts);
            self.budget = self.budget.checked_sub(1)?;
            let instruction = self.decode(address)?;
            let after = self.step(&instruction, facts)?;
            let next = instruction.next_ip();
            match instruction.flow_control() {
                FlowControl::Next => work.push((next, after)),
                FlowControl::Return => {}
                FlowControl::Call | FlowControl::IndirectCall => {
                    let allocates = self.call(&instruction, depth)?;
                    if allocates && depth == 0 {
                        match CallFrame::at(next, facts.frame) {
                            Some(frame) => self.call_frames.push(frame),
                            None => self.unknown_frame = true,
                        }
                    }
                    forwards |= allocates;
                    work.push((next, after_call(&instruction, after, self.resolver)));
                }
                FlowControl::UnconditionalBranch | FlowControl::ConditionalBranch => {
                    let to = instruction.near_branch_target();
                    let conditional = instruction.flow_control() == FlowControl::ConditionalBranch;
                    if conditional {
                        work.push((next, after));
                    }
                    let inside = match (&range, self.resolver.classify(&instruction, self.entries))
                    {
                        (_, Branch::Entry(to)) if to != start => false,
                        (Some(range), _) => range.contains(&to),
                        (None, Branch::Local { name, .. }) => {
                            !name.is_some_and(|n| allocates_nothing(&n))
                        }
                        (None, _) => false,
                    };
                    if inside {
                        work.push((to, after));
                    } else {
                        forwards |= self.call(&instruction, depth)?;
                    }
                }
                FlowControl::IndirectBranch => {
                    // A jump through a GOT slot is a tail call; anything else (a
                    // jump table) is code this walk cannot follow.
                    forwards |= self.call(&instruction, depth)?;
                }
                // Interrupts, system calls and anything exceptional.
                _ => return None,
            }
        }
        Some(forwards)
    }

    /// Checks a call (or tail jump) leaving the code being walked. `None`: the callee
    /// may allocate by itself; `Some(true)`: it is an allocation entry.
    fn call(&mut self, instruction: &Instruction, depth: u32) -> Option<bool> {
        match self.resolver.classify(instruction, self.entries) {
            Branch::Entry(_) => Some(true),
            Branch::Bound(name) if (self.is_allocation)(&name) => Some(true),
            Branch::Bound(name) if allocates_nothing(&name) => Some(false),
            Branch::Local {
                name: Some(name), ..
            } if allocates_nothing(&name) => Some(false),
            Branch::Local { to, .. } if depth < MAX_DEPTH => {
                let facts = Facts {
                    errno_in_rax: false,
                    out_pointer: 0,
                    page_size: 0,
                    frame: FrameState::Unknown,
                };
                // A helper that itself forwards would count twice with its caller's
                // own forward; keep the proof simple and refuse it.
                match self.walk(to, None, facts, depth + 1)? {
                    false => Some(false),
                    true => None,
                }
            }
            _ => None,
        }
    }

    /// Checks one instruction's memory writes and returns the facts after it (for a
    /// call, before the callee's effect, which [`after_call`] applies).
    fn step(&mut self, instruction: &Instruction, facts: Facts) -> Option<Facts> {
        if matches!(
            instruction.mnemonic(),
            Mnemonic::Syscall | Mnemonic::Sysenter | Mnemonic::Int | Mnemonic::Int3
        ) {
            return None;
        }
        let info = self.info.info(instruction);
        for memory in info.used_memory() {
            if is_write(memory.access()) && !write_allowed(instruction, memory, facts) {
                return None;
            }
        }
        Some(facts_after(instruction, info, facts))
    }

    /// The instruction at `address`, if the file has code there.
    fn decode(&self, address: u64) -> Option<Instruction> {
        #[cfg(test)]
        if let Some((at, bytes)) = self.extra {
            if let Some(code) = address
                .checked_sub(at)
                .and_then(|o| bytes.get(o as usize..))
            {
                let mut decoder = Decoder::with_ip(64, code, address, DecoderOptions::NONE);
                let instruction = decoder.decode();
                return (!instruction.is_invalid()).then_some(instruction);
            }
        }
        let code = self.resolver.code_at(address)?;
        let mut decoder = Decoder::with_ip(64, code, address, DecoderOptions::NONE);
        let instruction = decoder.decode();
        (!instruction.is_invalid()).then_some(instruction)
    }
}

/// Whether an operand `access` may write it (conditionally or not).
fn is_write(access: OpAccess) -> bool {
    matches!(
        access,
        OpAccess::Write | OpAccess::CondWrite | OpAccess::ReadWrite | OpAccess::ReadCondWrite
    )
}

/// Whether `instruction`'s write to `memory` is one an entry that allocates nothing may
/// make, given the `facts` before it (module docs: the stack, a constant to TLS or
/// errno, the page size to a global, or through the out pointer).
fn write_allowed(instruction: &Instruction, memory: &UsedMemory, facts: Facts) -> bool {
    let plain = memory.index() == Register::None;
    // errno is set to a constant (ENOMEM, EINVAL): a TLS or errno write is
    // allowed only as a store of an immediate. A thread cache's free list or
    // counter in TLS is updated from registers, which this refuses.
    let constant_store =
        instruction.mnemonic() == Mnemonic::Mov && instruction.op_count() == 2 && {
            let source = instruction.op1_kind();
            matches!(
                source,
                OpKind::Immediate8
                    | OpKind::Immediate16
                    | OpKind::Immediate32
                    | OpKind::Immediate8to32
                    | OpKind::Immediate8to64
                    | OpKind::Immediate32to64
            )
        };
    // `mov %reg, global(%rip)` of the page size: idempotent (module docs).
    let page_size_store = instruction.mnemonic() == Mnemonic::Mov
        && instruction.op_count() == 2
        && instruction.op1_kind() == OpKind::Register
        && bit(instruction.op1_register()).is_some_and(|b| facts.page_size & b != 0)
        // iced resolves `rip`-relative operands to absolute addresses.
        && matches!(memory.base(), Register::RIP | Register::None)
        && plain;
    memory.base() == Register::RSP
        || page_size_store
        || (constant_store && memory.segment() == Register::FS)
        || (constant_store
            && plain
            && memory.displacement() == 0
            && facts.errno_in_rax
            && memory.base() == Register::RAX)
        || (plain
            && memory.displacement() == 0
            && bit(memory.base()).is_some_and(|b| facts.out_pointer & b != 0))
}

/// The facts after `instruction` (its register uses in `info`), from `facts` before
/// it: a register written loses what it held, unless the write copies (or sign
/// extends) a register that held the out pointer or the page size.
fn facts_after(instruction: &Instruction, info: &InstructionInfo, facts: Facts) -> Facts {
    let mut after = facts;
    after.frame = facts.frame.step(instruction, |register| {
        writes(info.used_registers(), register)
    });
    let copy = instruction.mnemonic() == Mnemonic::Mov
        && instruction.op0_kind() == OpKind::Register
        && instruction.op1_kind() == OpKind::Register;
    for used in info.used_registers() {
        if !is_write(used.access()) {
            continue;
        }
        let register = used.register().full_register();
        if register == Register::RAX {
            after.errno_in_rax = false;
        }
        if let Some(b) = bit(register) {
            after.out_pointer &= !b;
            after.page_size &= !b;
        }
    }
    if copy && instruction.op0_register().is_gpr64() {
        let source = bit(instruction.op1_register()).unwrap_or(0);
        if facts.out_pointer & source != 0 {
            after.out_pointer |= bit(instruction.op0_register()).unwrap_or(0);
        }
    }
    // A register copy or sign extension (`movslq %eax,%rdi`) keeps the page size.
    let extends = matches!(
        instruction.mnemonic(),
        Mnemonic::Mov | Mnemonic::Movsxd | Mnemonic::Movsx
    ) && instruction.op_count() == 2
        && instruction.op0_kind() == OpKind::Register
        && instruction.op1_kind() == OpKind::Register;
    if extends && bit(instruction.op1_register()).is_some_and(|b| facts.page_size & b != 0) {
        after.page_size |= bit(instruction.op0_register()).unwrap_or(0);
    }
    after
}

/// The facts after a call returns: only callee-saved registers keep theirs; `rax`
/// holds `errno`'s address after `__errno_location` and the page size after
/// `getpagesize`.
fn after_call(instruction: &Instruction, facts: Facts, resolver: &CallResolver) -> Facts {
    let kept: u32 = CALLEE_SAVED.iter().filter_map(|r| bit(*r)).sum();
    let callee = match resolver.classify(instruction, &[]) {
        Branch::Bound(name)
        | Branch::Local {
            name: Some(name), ..
        } => Some(name),
        _ => None,
    };
    let returns = |wanted: &str| callee.as_deref() == Some(wanted);
    let rax = bit(Register::RAX).unwrap_or(0);
    Facts {
        errno_in_rax: returns("__errno_location"),
        out_pointer: facts.out_pointer & kept,
        page_size: (facts.page_size & kept) | if returns("getpagesize") { rax } else { 0 },
        frame: facts.frame,
    }
}

/// Functions other libraries export that allocate nothing: the C library's memory
/// and errno helpers and the page-size queries allocators use.
fn allocates_nothing(name: &str) -> bool {
    matches!(
        name,
        "__errno_location"
            | "memset"
            | "memcpy"
            | "memmove"
            | "bzero"
            | "explicit_bzero"
            | "getpagesize"
    )
}

#[cfg(test)]
mod tests {
    use object::{Object, ObjectSymbol};

    use super::*;
    use crate::allocators::is_allocation_symbol;

    const MUSL: &str = "/usr/lib/x86_64-linux-musl/libc.so";
    const TCMALLOC: &str = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4";

    fn glibc() -> String {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        crate::procfs::parse_maps(&maps)
            .iter()
            .filter_map(|e| e.file_path().map(|p| p.to_string_lossy().into_owned()))
            .find(|p| p.ends_with("/libc.so.6"))
            .expect("tests run on glibc")
    }

    /// The proof for `symbol` of the file at `path`.
    fn forward_only(path: &str, symbol: &str, out_pointer: bool) -> bool {
        proof(path, symbol, out_pointer).is_some()
    }

    /// The proof's result for `symbol` of the file at `path`.
    fn proof(path: &str, symbol: &str, out_pointer: bool) -> Option<ForwardOnly> {
        let data = std::fs::read(path)
            .unwrap_or_else(|e| panic!("{path}: {e} (cargo xtask setup installs it)"));
        let file = object::File::parse(&*data).unwrap();
        let resolver = CallResolver::new(&file);
        let symbol = file
            .dynamic_symbols()
            .find(|s| s.name() == Ok(symbol))
            .unwrap_or_else(|| panic!("{path} defines {symbol}"));
        let entries = [symbol.address()];
        Purity::new(&resolver, &entries, |n| is_allocation_symbol(n, &[])).forward_only(
            symbol.address()..symbol.address() + symbol.size(),
            out_pointer,
        )
    }

    /// The proof for hand-assembled `code` at 0x1000, with an entry at 0x2000.
    fn synthetic(code: &[u8]) -> bool {
        let glibc = std::fs::read(glibc()).unwrap();
        let file = object::File::parse(&*glibc).unwrap();
        let resolver = CallResolver::new(&file);
        let entries = [0x1000, 0x2000];
        let mut purity = Purity::new(&resolver, &entries, |_| true);
        purity.extra = Some((0x1000, code));
        purity
            .forward_only(0x1000..0x1000 + code.len() as u64, false)
            .is_some()
    }

    #[test]
    fn only_stack_writes_and_a_forward_is_forward_only() {
        // push %rax ; jmp 0x2000 (an entry)
        assert!(synthetic(&[0x50, 0xe9, 0xfa, 0x0f, 0x00, 0x00]));
        // test %rdi,%rdi ; je +5 ; jmp 0x2000 ; ret: the other path returns nothing.
        assert!(synthetic(&[
            0x48, 0x85, 0xff, 0x74, 0x05, 0xe9, 0xf6, 0x0f, 0x00, 0x00, 0xc3
        ]));
    }

    #[test]
    fn a_heap_write_a_syscall_or_an_unknown_call_may_allocate() {
        // mov %rdi,(%rax) ; jmp 0x2000
        assert!(!synthetic(&[
            0x48, 0x89, 0x38, 0xe9, 0xf8, 0x0f, 0x00, 0x00
        ]));
        // syscall ; jmp 0x2000
        assert!(!synthetic(&[0x0f, 0x05, 0xe9, 0xf9, 0x0f, 0x00, 0x00]));
        // call *%rax ; jmp 0x2000
        assert!(!synthetic(&[0xff, 0xd0, 0xe9, 0xf9, 0x0f, 0x00, 0x00]));
        // ret only: no forward at all.
        assert!(!synthetic(&[0xc3]));
    }

    #[test]
    fn glibc_reallocarray_is_forward_only_and_realloc_is_not() {
        // mov; mul; mov; jo; jmp realloc@plt; errno = ENOMEM (a TLS write); ret.
        assert!(forward_only(&glibc(), "reallocarray", false));
        // realloc allocates itself (_int_realloc) and calls malloc only sometimes.
        assert!(!forward_only(&glibc(), "realloc", false));
    }

    #[test]
    fn musl_wrappers_are_forward_only() {
        // Overflow check, malloc, an internal helper that only reads, memset.
        assert!(forward_only(MUSL, "calloc", false));
        // Overflow check, errno through __errno_location's pointer, jmp realloc.
        assert!(forward_only(MUSL, "reallocarray", false));
        // Stores the block through its first argument: allowed for that argument only.
        assert!(forward_only(MUSL, "posix_memalign", true));
        assert!(!forward_only(MUSL, "posix_memalign", false));
        // malloc is the allocator.
        assert!(!forward_only(MUSL, "malloc", false));
    }

    #[test]
    fn musl_calloc_call_frame_is_derived() {
        // push %r12 ; push %rbp ; push %rbx ; ... call malloc: 24 bytes, rbp second.
        let frames = proof(MUSL, "calloc", false).unwrap().call_frames.unwrap();
        assert_eq!(frames.len(), 1, "{frames:?}");
        assert_eq!((frames[0].depth, frames[0].rbp_pushed_at), (24, Some(16)));
        // posix_memalign: push %rbx ; call aligned_alloc.
        let frames = proof(MUSL, "posix_memalign", true)
            .unwrap()
            .call_frames
            .unwrap();
        assert_eq!(frames.len(), 1, "{frames:?}");
        assert_eq!((frames[0].depth, frames[0].rbp_pushed_at), (8, None));
        // reallocarray only tail-jumps: no call frame needed.
        assert_eq!(
            proof(MUSL, "reallocarray", false).unwrap().call_frames,
            Some(vec![])
        );
    }

    #[test]
    fn caching_the_page_size_in_a_global_is_forward_only() {
        // tcmalloc's valloc and pvalloc store getpagesize()'s result in a global, then
        // jump to tc_memalign.
        assert!(forward_only(TCMALLOC, "valloc", false));
        assert!(forward_only(TCMALLOC, "pvalloc", false));
        assert!(forward_only(TCMALLOC, "posix_memalign", true));
    }

    #[test]
    fn a_global_write_of_anything_but_the_page_size_may_allocate() {
        // mov %rdi,0x10(%rip) ; jmp 0x2000: a global updated from an argument.
        assert!(!synthetic(&[
            0x48, 0x89, 0x3d, 0x10, 0x00, 0x00, 0x00, 0xe9, 0xf4, 0x0f, 0x00, 0x00
        ]));
        // movq $1,0x10(%rip) ; jmp 0x2000: a constant, but not the page size (a flag
        // or a lock is state, too).
        assert!(!synthetic(&[
            0x48, 0xc7, 0x05, 0x10, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0xe9, 0xf0, 0x0f,
            0x00, 0x00
        ]));
    }
}
