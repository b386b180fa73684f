//! The attach cookie: what a probe must know about the instruction it sits on.
//!
//! A probe is placed at the first instruction of an entry that the kernel emulates
//! (userspace's `images/src/image/point.rs`), which may lie a few instructions after the entry.
//! By then the arguments may have moved to other registers (`mov %rdi,%rbx`), or two
//! of them may have been multiplied already (`reallocarray`'s `mul`); the stack pointer
//! has not moved (a probe is never placed after a stack-pointer move: a return probe
//! at that point would take a local slot for the return address). The cookie tells the
//! program where each input is and where the entry's first byte is, so one program per
//! [`Shape`] serves every image of the host. 64 bits, read with `bpf_get_attach_cookie`:
//!
//! | bits | field |
//! |---|---|
//! | 0..20 | code size of the entry (the range a forwarded call returns into); for a nesting wrapper (bit 36), the half-width of the span its nested calls return into, in [`NEST_SPAN_UNIT`]s; for an inlined small-object site ([`Shape::SmallObject`]), what its input is multiplied by (1, or the constant size) |
//! | 20..24 | window shift: inside an observation window the mean sampling interval is divided by `2^shift` |
//! | 24..32 | bytes from the entry's first byte to the probed instruction |
//! | 32 | the inputs are in their argument registers (the program reads them directly) |
//! | 33 | the entry may forward by a tail jump (its return address must be kept) |
//! | 34 | the entry's tail jumps happen only for a null block |
//! | 35 | the probed instruction is single-stepped |
//! | 36 | the entry reaches its forwards through code of its own image that is not its own (function pointers): any probed call beneath it while its return address is in place is its nested call |
//! | 37 | a nesting wrapper whose span is wide (a stripped interpreter's whole text): a nested call also needs the wrapper's return address still at its stack pointer |
//! | 38..50 | three 4-bit [`Reg`] codes: where input 0, 1 and 2 are |
//! | 50 | the inputs' product overflowed if the CPU's overflow flag is set |
//! | 51 | the entry may call another probed entry (its nested call is not counted) |
//! | 52..58 | the [`AllocFn`] discriminant |
//! | 58..64 | a wrapper whose forward is the first code it calls: the forward's stack pointer at its entry is this many 8-byte slots below the wrapper's (0: not known) |
//!
//! [`Shape`]: crate::Shape
//! [`Shape::SmallObject`]: crate::Shape::SmallObject
//! [`AllocFn`]: crate::AllocFn

/// Inputs a probe reads at most.
pub const MAX_INPUTS: usize = 3;

/// Largest code size a cookie can carry; larger entries are clamped (the code range
/// is only used to recognise calls that return into the entry, which lie near it).
pub const MAX_CODE_SIZE: u64 = (1 << 20) - 1;

/// A nesting wrapper's code size field is the half-width of the span around its entry
/// that its nested calls return into, in these units (up to 16 MiB: a stripped
/// interpreter's whole text).
pub const NEST_SPAN_UNIT: u64 = 16;

/// Largest [`ProbeCookie::window_shift`] a cookie can carry.
pub const MAX_WINDOW_SHIFT: u8 = 7;

/// A general-purpose register, or the constant 1, as a 4-bit cookie code. The order is
/// the program's `match`, not the hardware encoding.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reg {
    /// `rdi`: the first integer argument at entry.
    Rdi = 0,
    /// `rsi`: the second.
    Rsi = 1,
    /// `rdx`: the third.
    Rdx = 2,
    /// `rcx`: the fourth.
    Rcx = 3,
    /// `r8`: the fifth.
    R8 = 4,
    /// `r9`: the sixth.
    R9 = 5,
    /// `rax`
    Rax = 6,
    /// `rbx`
    Rbx = 7,
    /// `rbp`
    Rbp = 8,
    /// `r10`
    R10 = 9,
    /// `r11`
    R11 = 10,
    /// `r12`
    R12 = 11,
    /// `r13`
    R13 = 12,
    /// `r14`
    R14 = 13,
    /// `r15`
    R15 = 14,
    /// Not a register: the value 1. A product already computed into one register is
    /// passed as that register times `One`.
    One = 15,
}

impl Reg {
    /// The registers that carry integer arguments at entry, in argument order.
    pub const ARGUMENTS: [Reg; 6] = [Reg::Rdi, Reg::Rsi, Reg::Rdx, Reg::Rcx, Reg::R8, Reg::R9];
}

/// The decoded cookie.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeCookie {
    /// Code size of the entry in bytes (clamped to [`MAX_CODE_SIZE`]).
    pub code_size: u64,
    /// Bytes from the entry's first byte to the probed instruction.
    pub probe_offset: u8,
    /// [`Reg`] codes of the inputs, in the shape's order.
    pub inputs: [u8; MAX_INPUTS],
    /// The product of inputs 0 and 1 (or 1 and 2) overflowed if the overflow flag is set.
    pub overflow_check: bool,
    /// The entry may call another probed entry.
    pub wrapper: bool,
    /// The inputs are in the argument registers the shape names at entry (`rdi`,
    /// `rsi`, `rdx` in order): read directly, without the register file.
    pub abi_inputs: bool,
    /// The entry may forward by a tail jump, after which only its return address
    /// (kept at entry) tells the forwarded call from a new one.
    pub tail_forward: bool,
    /// The entry resizes a block and its tail jumps land only in entries that do
    /// not: a resize of a real block must still copy and release it after
    /// allocating, so only a resize of no block (`realloc(NULL, n)`) can end in such
    /// a jump, and only then is the return address worth reading.
    pub tail_only_if_null: bool,
    /// The probed instruction is single-stepped by the kernel (no emulated one was
    /// found): its hits cost ~30x more, which the overhead budget must know.
    pub stepped: bool,
    /// [`crate::AllocFn`] discriminant.
    pub function: u8,
    /// A wrapper whose code runs straight to a call of its forward: the forward's stack
    /// pointer at its entry is this many 8-byte slots below the wrapper's, so the nested
    /// call is recognised by its stack pointer alone (0: not known; see
    /// [`forward_call_slots`]).
    pub forward_call_slots: u8,
    /// The entry reaches other probed entries through other functions (CPython's
    /// allocators call each other through function pointers): every probed call made
    /// beneath it while it runs is its nested call, recognised by the wrapper's return
    /// address still being at its stack pointer.
    pub nests: bool,
    /// A nesting wrapper whose span is wide (the image names none of its allocator's
    /// own functions): its return address is kept at entry, and a call beneath it is
    /// nested only while that address is still at its stack pointer.
    pub nests_checked: bool,
    /// Under time sampling, how much denser the probe samples than the configured rate:
    /// its countdowns have mean `rate >> window_shift` (0 when probed full time).
    pub window_shift: u8,
    /// The probe belongs to one process's own links (a light process probed full time
    /// on an image the overhead budget probes part time for everyone else): its runs
    /// count only for a process whose gate says so (`GateState::OwnLinks`), and the
    /// shared links' runs of the same trap then do not.
    pub own_link: bool,
}

/// Largest [`ProbeCookie::forward_call_slots`].
pub const MAX_FORWARD_CALL_SLOTS: u8 = 63;

/// The cookie's [`ProbeCookie::forward_call_slots`] for a forward whose stack pointer is
/// `depth` bytes below the wrapper's: 0 (not known) unless `depth` is a whole number of
/// slots that fits.
pub const fn forward_call_slots(depth: u32) -> u8 {
    if depth & 7 != 0 || depth / 8 > MAX_FORWARD_CALL_SLOTS as u32 {
        0
    } else {
        (depth / 8) as u8
    }
}

const OFFSET_SHIFT: u32 = 24;
const WINDOW_SHIFT: u32 = 20;
const OWN_LINK_BIT: u32 = 23;
const INPUT_SHIFT: u32 = 38;
const ABI_BIT: u32 = 32;
const TAIL_BIT: u32 = 33;
const TAIL_IF_NULL_BIT: u32 = 34;
const STEPPED_BIT: u32 = 35;
const NESTS_BIT: u32 = 36;
const NESTS_CHECKED_BIT: u32 = 37;
const OVERFLOW_BIT: u32 = 50;
const WRAPPER_BIT: u32 = 51;
const FUNCTION_SHIFT: u32 = 52;
const FORWARD_CALL_SHIFT: u32 = 58;

impl ProbeCookie {
    /// Packs the cookie into the 64 bits the kernel hands back to the program.
    pub const fn encode(&self) -> u64 {
        let size = if self.code_size > MAX_CODE_SIZE {
            MAX_CODE_SIZE
        } else {
            self.code_size
        };
        let window = if self.window_shift > MAX_WINDOW_SHIFT {
            MAX_WINDOW_SHIFT
        } else {
            self.window_shift
        };
        size | (window as u64) << WINDOW_SHIFT
            | (self.own_link as u64) << OWN_LINK_BIT
            | (self.probe_offset as u64) << OFFSET_SHIFT
            | ((self.inputs[0] & 0xf) as u64) << INPUT_SHIFT
            | ((self.inputs[1] & 0xf) as u64) << (INPUT_SHIFT + 4)
            | ((self.inputs[2] & 0xf) as u64) << (INPUT_SHIFT + 8)
            | (self.overflow_check as u64) << OVERFLOW_BIT
            | (self.wrapper as u64) << WRAPPER_BIT
            | (self.abi_inputs as u64) << ABI_BIT
            | (self.tail_forward as u64) << TAIL_BIT
            | (self.tail_only_if_null as u64) << TAIL_IF_NULL_BIT
            | (self.stepped as u64) << STEPPED_BIT
            | (self.nests as u64) << NESTS_BIT
            | (self.nests_checked as u64) << NESTS_CHECKED_BIT
            | ((self.function & 0x3f) as u64) << FUNCTION_SHIFT
            | ((self.forward_call_slots & 0x3f) as u64) << FORWARD_CALL_SHIFT
    }

    /// Unpacks a cookie written by [`ProbeCookie::encode`].
    #[inline(always)]
    pub const fn decode(cookie: u64) -> ProbeCookie {
        ProbeCookie {
            code_size: cookie & MAX_CODE_SIZE,
            probe_offset: (cookie >> OFFSET_SHIFT) as u8,
            inputs: [
                ((cookie >> INPUT_SHIFT) & 0xf) as u8,
                ((cookie >> (INPUT_SHIFT + 4)) & 0xf) as u8,
                ((cookie >> (INPUT_SHIFT + 8)) & 0xf) as u8,
            ],
            overflow_check: (cookie >> OVERFLOW_BIT) & 1 == 1,
            wrapper: (cookie >> WRAPPER_BIT) & 1 == 1,
            abi_inputs: (cookie >> ABI_BIT) & 1 == 1,
            tail_forward: (cookie >> TAIL_BIT) & 1 == 1,
            tail_only_if_null: (cookie >> TAIL_IF_NULL_BIT) & 1 == 1,
            stepped: (cookie >> STEPPED_BIT) & 1 == 1,
            nests: (cookie >> NESTS_BIT) & 1 == 1,
            nests_checked: (cookie >> NESTS_CHECKED_BIT) & 1 == 1,
            function: ((cookie >> FUNCTION_SHIFT) & 0x3f) as u8,
            forward_call_slots: ((cookie >> FORWARD_CALL_SHIFT) & 0x3f) as u8,
            window_shift: ((cookie >> WINDOW_SHIFT) & 0x7) as u8,
            own_link: (cookie >> OWN_LINK_BIT) & 1 == 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_field_survives_a_round_trip() {
        let cookie = ProbeCookie {
            code_size: 0x9_3456,
            probe_offset: 200,
            inputs: [Reg::Rdi as u8, Reg::R15 as u8, Reg::One as u8],
            overflow_check: true,
            wrapper: true,
            abi_inputs: true,
            tail_forward: true,
            tail_only_if_null: true,
            stepped: true,
            function: 16,
            forward_call_slots: 63,
            nests: true,
            nests_checked: true,
            window_shift: 7,
            own_link: true,
        };
        assert_eq!(ProbeCookie::decode(cookie.encode()), cookie);
        let plain = ProbeCookie {
            code_size: 10,
            probe_offset: 0,
            inputs: [0; MAX_INPUTS],
            overflow_check: false,
            wrapper: false,
            abi_inputs: false,
            tail_forward: false,
            tail_only_if_null: false,
            stepped: false,
            function: 0,
            forward_call_slots: 0,
            nests: false,
            nests_checked: false,
            window_shift: 0,
            own_link: false,
        };
        assert_eq!(plain.encode(), 10);
        assert_eq!(ProbeCookie::decode(plain.encode()), plain);
    }

    #[test]
    fn oversized_fields_are_clamped_not_spilled() {
        let cookie = ProbeCookie {
            code_size: u64::MAX,
            probe_offset: 0,
            inputs: [0; MAX_INPUTS],
            overflow_check: false,
            wrapper: false,
            abi_inputs: false,
            tail_forward: false,
            tail_only_if_null: false,
            stepped: false,
            function: 0,
            forward_call_slots: 0,
            nests: false,
            nests_checked: false,
            window_shift: 0,
            own_link: false,
        };
        let back = ProbeCookie::decode(cookie.encode());
        assert_eq!(back.code_size, MAX_CODE_SIZE);
        assert_eq!(back.function, 0);
        assert_eq!(back.inputs, [0; MAX_INPUTS]);
    }

    #[test]
    fn forward_call_depths_that_do_not_fit_are_unknown() {
        assert_eq!(forward_call_slots(32), 4);
        assert_eq!(forward_call_slots(8 * 63), 63);
        assert_eq!(forward_call_slots(8 * 64), 0);
        assert_eq!(forward_call_slots(12), 0);
    }
}
