//! Where a Go binary keeps its heap profile's variables, found without a symbol table:
//! read from the code of the runtime functions that use them, which the function table
//! names in every build (`-s -w` removes symbols, never `.gopclntab`).
//!
//! - `runtime.mbuckets` (the head of the bucket list): the first pc-relative 8-byte
//!   load of `runtime.mProf_FlushLocked` (Go 1.19 to 1.26; present even where the
//!   linker disabled profiling, since the collector calls it);
//! - `runtime.MemProfileRate`: the second pc-relative 8-byte load of
//!   `runtime.profilealloc` (the first is `mcache0`);
//! - `runtime.mProfCycle` (which of the three pending cycles the reader folds in): the
//!   first pc-relative 4-byte load of `runtime.mProf_Flush`.
//!
//! Each must land in a writable data section of the file (`.data`, `.noptrdata`,
//! `.bss`, `.noptrbss`); anything else is not believed.

use iced_x86::{Code, Decoder, DecoderOptions, Register};
use object::{Object, ObjectSection, SectionKind};

use crate::pclntab::Pclntab;

/// Bytes of a runtime function decoded at most for the load.
const MAX_DECODED_BYTES: u64 = 512;

/// The profiling variables' addresses in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProfileVariables {
    /// `runtime.mbuckets`: a pointer to the newest bucket.
    pub mbuckets: u64,
    /// `runtime.MemProfileRate`: an int, 0 when profiling is off.
    pub rate: u64,
    /// `runtime.mProfCycle`: a u32, the cycle number shifted left by one.
    pub cycle: Option<u64>,
}

/// Why the variables were not found.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LocateError {
    /// A runtime function the search reads is not in the function table.
    #[error("no {0} in the function table")]
    NoFunction(&'static str),
    /// Its code does not load the variable the way the versions read here do.
    #[error("{0} does not load {1} the way Go 1.19 to 1.26 do")]
    NoLoad(&'static str, &'static str),
}

/// Finds the profiling variables of `file`, whose function table is `table`.
pub fn locate(file: &object::File, table: &Pclntab) -> Result<ProfileVariables, LocateError> {
    let load = |function: &'static str, variable: &'static str, nth: usize, code: Code| {
        let func = table
            .find(function)
            .ok_or(LocateError::NoFunction(function))?;
        let size = table.size(&func).unwrap_or(MAX_DECODED_BYTES);
        loads(file, func.entry, size.min(MAX_DECODED_BYTES), code)
            .nth(nth)
            .filter(|&address| is_data(file, address))
            .ok_or(LocateError::NoLoad(function, variable))
    };
    Ok(ProfileVariables {
        mbuckets: load(
            "runtime.mProf_FlushLocked",
            "runtime.mbuckets",
            0,
            Code::Mov_r64_rm64,
        )?,
        rate: rate_of(file, table).map_or_else(
            || {
                load(
                    "runtime.profilealloc",
                    "runtime.MemProfileRate",
                    1,
                    Code::Mov_r64_rm64,
                )
            },
            Ok,
        )?,
        cycle: load(
            "runtime.mProf_Flush",
            "runtime.mProfCycle",
            0,
            Code::Mov_r32_rm32,
        )
        .ok(),
    })
}

/// `runtime.MemProfileRate` where the file says so itself: the load of
/// `runtime.profilealloc` whose target holds the default rate (`512 * 1024`) in the
/// file's initialized data (Go 1.20 on; 1.19 initializes it at run time).
fn rate_of(file: &object::File, table: &Pclntab) -> Option<u64> {
    const DEFAULT_RATE: u64 = 512 * 1024;
    let func = table.find("runtime.profilealloc")?;
    let size = table.size(&func).unwrap_or(MAX_DECODED_BYTES);
    let mut targets = loads(
        file,
        func.entry,
        size.min(MAX_DECODED_BYTES),
        Code::Mov_r64_rm64,
    );
    targets.find(|&address| {
        file.sections().any(|s| {
            matches!(s.name(), Ok(".data" | ".noptrdata"))
                && s.data_range(address, 8)
                    .ok()
                    .flatten()
                    .is_some_and(|b| b == DEFAULT_RATE.to_le_bytes())
        })
    })
}

/// The addresses that the pc-relative loads of instruction `code` in the `size` bytes
/// at `entry` read, in order.
fn loads<'a>(
    file: &object::File<'a>,
    entry: u64,
    size: u64,
    code: Code,
) -> impl Iterator<Item = u64> + 'a {
    let bytes = file
        .sections()
        .filter(|s| s.kind() == SectionKind::Text)
        .find_map(|s| {
            let start = s.address();
            let data = s.data().ok()?;
            let offset = entry.checked_sub(start)? as usize;
            data.get(offset..offset.checked_add(size as usize)?.min(data.len()))
        })
        .unwrap_or_default();
    let mut decoder = Decoder::with_ip(64, bytes, entry, DecoderOptions::NONE);
    std::iter::from_fn(move || {
        while decoder.can_decode() {
            let instruction = decoder.decode();
            if instruction.is_invalid() {
                return None;
            }
            if instruction.code() == code
                && instruction.memory_base() == Register::RIP
                && instruction.memory_index() == Register::None
            {
                return Some(instruction.ip_rel_memory_address());
            }
        }
        None
    })
}

/// True if `address` is in a writable data section of `file`.
fn is_data(file: &object::File, address: u64) -> bool {
    file.sections().any(|s| {
        matches!(s.name(), Ok(".data" | ".noptrdata" | ".bss" | ".noptrbss"))
            && (s.address()..s.address() + s.size()).contains(&address)
    })
}
