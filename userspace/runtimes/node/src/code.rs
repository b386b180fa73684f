//! Which code object a return address is in. A frame of optimized code usually runs
//! its function's current code (`JSFunction::code`), but not always: a loop entered
//! by on-stack replacement runs code the function does not point to, and code the
//! function replaced may still have frames. Such an address is found in the heap page
//! of generated code it lies in: the `InstructionStream` that holds it starts on a
//! code-aligned address below it with that type's map, and names its `Code`, whose
//! instruction range must hold the address (so a word of machine code that merely
//! looks like the map is never believed).

use std::mem::size_of;

use allocbpf_runtime::toolkit::{cache::ENTRY_OVERHEAD, ByteCache, RemoteMemory};

use crate::heap::Heap;

/// Bytes below a return address searched for its code's start at most.
const MAX_SEARCH: u64 = 64 << 10;

/// V8's heap pages are aligned to this: the search never crosses one's start.
const PAGE: u64 = 256 << 10;

/// The memory's page size: what is mapped or not.
const SMALL_PAGE: u64 = 4096;

/// Machine code starts on addresses aligned to this at least (V8's code alignment is
/// 32 or 64 bytes on x86-64).
const CODE_ALIGNMENT: u64 = 32;

/// The return addresses a process's cache was sized for when it counted entries: the
/// cache is bounded in bytes from it.
const MAX_CACHED: usize = 1 << 16;

/// What one return address's entry holds besides its overhead: what was found there.
const ENTRY_BYTES: usize = size_of::<Option<CodeRange>>();

/// Bytes the return addresses' code holds: every entry is the same size (an address
/// and what was found there, if anything), so this keeps [`MAX_CACHED`] of them, as
/// when entries were counted.
const MAX_CACHED_BYTES: usize = MAX_CACHED * (ENTRY_OVERHEAD + ENTRY_BYTES);

/// A code object and its instructions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CodeRange {
    /// The `Code` (tagged).
    pub code: u64,
    /// Its first instruction's address.
    pub start: u64,
    /// Bytes of its instructions.
    pub size: u64,
    /// Its kind (`CodeKind`).
    pub kind: u32,
}

impl CodeRange {
    /// True when `pc`, a return address, is in these instructions.
    pub fn holds(&self, pc: u64) -> bool {
        pc > self.start && pc - self.start <= self.size
    }
}

/// Code found by address in one process.
pub struct CodeFinder {
    /// What each return address looked up is in (nothing, for one in no code),
    /// evicting the addresses used least recently.
    by_address: ByteCache<u64, Option<CodeRange>>,
    /// The `InstructionStream` map, once seen.
    stream_map: Option<u64>,
}

impl Default for CodeFinder {
    fn default() -> Self {
        Self {
            by_address: ByteCache::new(MAX_CACHED_BYTES),
            stream_map: None,
        }
    }
}

impl CodeFinder {
    /// Forgets what was found (code is freed and its space reused), the stream map
    /// with it: everything is read again.
    pub fn clear(&mut self) {
        self.by_address.clear();
        self.stream_map = None;
    }

    /// The code holding return address `pc`, trying `hint` (a `Code`, tagged) first.
    pub fn code_at<M: RemoteMemory + ?Sized>(
        &mut self,
        heap: &Heap<'_, M>,
        pc: u64,
        hint: Option<u64>,
    ) -> Option<CodeRange> {
        if let Some(known) = self.by_address.get(&pc) {
            return *known;
        }
        let found = hint
            .and_then(|code| read_range(heap, code))
            .filter(|range| range.holds(pc))
            .or_else(|| self.search(heap, pc));
        self.by_address.insert(pc, found, ENTRY_BYTES);
        found
    }

    /// Searches the page below `pc` for the instruction stream holding it.
    fn search<M: RemoteMemory + ?Sized>(
        &mut self,
        heap: &Heap<'_, M>,
        pc: u64,
    ) -> Option<CodeRange> {
        let layout = heap.layout;
        let header = layout.fields.stream_header as u64;
        // The readable pages below `pc`, down to its heap page's start (whose header
        // pages may not be mapped) or the search's bound.
        let floor = (pc & !(PAGE - 1)).max(pc.saturating_sub(MAX_SEARCH));
        let mut low = pc & !(SMALL_PAGE - 1);
        let mut word = [0u8; 8];
        // Target-supplied `pc` and header size: every sum is checked (a wrap near the
        // top of the address space would turn these bounds into an endless search).
        while floor
            .checked_add(SMALL_PAGE)
            .is_some_and(|bound| low >= bound)
            && heap.memory.read(low - SMALL_PAGE, &mut word).is_ok()
        {
            low -= SMALL_PAGE;
        }
        let low = low.max(floor);
        let mut window = vec![0u8; (pc - low) as usize];
        heap.memory.read(low, &mut window).ok()?;
        let word_at = |address: u64| -> Option<u64> {
            let at = usize::try_from(address.checked_sub(low)?).ok()?;
            Some(u64::from_le_bytes(window.get(at..at + 8)?.try_into().ok()?))
        };
        let mut start = pc.checked_sub(1)? & !(CODE_ALIGNMENT - 1);
        let lowest_start = low.checked_add(header)?;
        while start >= lowest_start {
            let stream = start - header;
            if let (Some(map), Some(code)) = (word_at(stream), word_at(stream.checked_add(8)?)) {
                let is_stream_map = match self.stream_map {
                    Some(known) => map == known,
                    None => {
                        crate::heap::is_object(map)
                            && heap.instance_type(stream + 1)
                                == Some(layout.types.instruction_stream)
                    }
                };
                if is_stream_map {
                    if let Some(range) = read_range(heap, code).filter(|r| r.start == start) {
                        self.stream_map = Some(map);
                        // The innermost stream below `pc` is the one: it holds `pc`
                        // or `pc` is in no code.
                        return range.holds(pc).then_some(range);
                    }
                }
            }
            let Some(below) = start.checked_sub(CODE_ALIGNMENT) else {
                break;
            };
            start = below;
        }
        None
    }
}

/// What the `Code` `code` (tagged) says of its instructions.
fn read_range<M: RemoteMemory + ?Sized>(heap: &Heap<'_, M>, code: u64) -> Option<CodeRange> {
    let fields = &heap.layout.fields;
    heap.typed(code, heap.layout.types.code)?;
    let start = heap.field(code, fields.code_start)?;
    let kind = (heap.field(code, fields.code_flags)? as u32) & fields.code_kind_mask;
    let size = heap.field(code, fields.code_size)? & 0xffff_ffff;
    Some(CodeRange {
        code,
        start,
        size,
        kind,
    })
}

#[cfg(test)]
mod tests;
