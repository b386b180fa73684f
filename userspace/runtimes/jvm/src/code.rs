//! A JVM's code from outside: which pc is the interpreter's, which code blob holds a
//! compiled pc (through the code heaps' segment maps, as `CodeHeap::find_blob` does),
//! a blob's frame size, and a compiled method's scopes at a pc: the method and bytecode
//! index of the frame and of every frame inlined into it, innermost first.
//!
//! Every read is bounded and every answer checked (a blob must lie in its heap, a pc
//! descriptor table must fit its blob's data, a scope chain ends within
//! [`MAX_INLINE_DEPTH`]); a forged or moving code cache yields fewer frames, never a
//! hang. What is read is remembered in caches bounded in bytes, which evict the blobs
//! and pcs used least recently when full.

use std::mem::size_of;

use allocbpf_runtime::toolkit::{cache::ENTRY_OVERHEAD, ByteCache, RemoteMemory};

use crate::{
    layout::{CodeStart, DebugData, Layout},
    stream::CompressedReader,
    vmstructs::read_c_string,
};

/// Most code heaps read (HotSpot has up to three).
const MAX_HEAPS: u64 = 8;

/// Most segment-map steps back to a blob's start.
const MAX_SEGMAP_STEPS: usize = 4096;

/// Most pc descriptors read from one compiled method.
const MAX_PC_DESCS: u64 = 65_536;

/// Largest `sizeof(PcDesc)` believed (HotSpot's is 16).
const MAX_PC_DESC_BYTES: u64 = 64;

/// Most scopes in one pc's chain (HotSpot inlines up to `MaxInlineLevel`, 15).
pub const MAX_INLINE_DEPTH: usize = 32;

/// The blobs (and pcs' blob starts) a process's cache was sized for when it counted
/// entries: the caches below are bounded in bytes from it.
const MAX_BLOBS: usize = 16_384;

/// Bytes the pcs' blob starts hold: every entry is the same size, so this keeps
/// [`MAX_BLOBS`] of them, as when entries were counted.
const MAX_START_BYTES: usize = MAX_BLOBS * (ENTRY_OVERHEAD + size_of::<Option<u64>>());

/// Bytes the blobs read hold, mostly their pc descriptors (8 bytes each). When entries
/// were counted the bound was [`MAX_BLOBS`] blobs and 2 Mi descriptors between them; a
/// compiled method has some dozens of descriptors, about a kibibyte a blob with its
/// fields and entry, so this keeps about as many blobs and never more descriptors.
const MAX_BLOB_BYTES: usize = 16 << 20;

/// Bytes the scopes read at pcs hold. Each blob used to remember up to 1,024 pcs, a
/// bound on nothing in bytes; a pc's scopes are a few 16-byte scopes in a vector,
/// about 128 bytes with its entry, and a process's walks meet some tens of thousands
/// of call sites: this keeps 65,536 of them.
const MAX_SCOPE_BYTES: usize = 65_536 * 128;

/// One code heap: its reserved range and its segment map.
#[derive(Clone, Copy, Debug)]
struct Heap {
    low: u64,
    high: u64,
    segmap: u64,
    log2_segment: u32,
}

/// A code blob as a walk needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blob {
    /// Its address.
    pub address: u64,
    /// Its frame size in bytes (0: a frame the walk cannot step over).
    pub frame_bytes: u64,
    /// The first byte of its code.
    pub code_begin: u64,
    /// The `Method*` of a compiled Java method; `None` for stubs and adapters.
    pub method: Option<u64>,
    /// A compiled method's pc descriptors, `(pc offset, scope decode offset)`, sorted.
    pc_descs: Vec<(i32, i32)>,
    /// A compiled method's scopes data and metadata (`Method*` table) addresses.
    scopes: (u64, u64),
    metadata: (u64, u64),
}

/// A frame a compiled pc stands for: a method and a bytecode index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scope {
    /// `Method*`.
    pub method: u64,
    /// Bytecode index (-1: the method's entry).
    pub bci: i32,
}

/// A process's code: the interpreter's range, its code heaps and the blobs seen.
pub struct CodeCache {
    interpreter: (u64, u64),
    heaps: Vec<Heap>,
    /// The blobs read, by address (`None`: not a blob that reads back sensibly).
    blobs: ByteCache<u64, Option<Blob>>,
    /// The blob start of each pc looked up (a walk meets the same return addresses
    /// again and again).
    starts: ByteCache<u64, Option<u64>>,
    /// The scopes read at each compiled pc (a method has a few call sites).
    scopes: ByteCache<u64, Vec<Scope>>,
}

impl CodeCache {
    /// Reads where `memory`'s interpreter and code heaps are.
    pub fn read(memory: &dyn RemoteMemory, layout: &Layout) -> Option<CodeCache> {
        let queue = memory.u64(layout.interpreter_code).ok()?;
        let buffer = memory.u64(queue.wrapping_add(layout.stub_buffer.0)).ok()?;
        let limit = memory.i32(queue.wrapping_add(layout.stub_buffer.1)).ok()?;
        let limit = u64::try_from(limit).ok().filter(|&l| l > 0)?;
        let array = memory.u64(layout.code_heaps).ok()?;
        let len = memory.i32(array.wrapping_add(layout.array_len)).ok()?;
        let data = memory.u64(array.wrapping_add(layout.array_data)).ok()?;
        let mut heaps = Vec::new();
        for index in 0..u64::try_from(len).ok()?.min(MAX_HEAPS) {
            let heap = memory.u64(data.wrapping_add(index * 8)).ok()?;
            let field = |offset: u64| heap.wrapping_add(offset);
            let space = |space: u64, offset: u64| field(space.wrapping_add(offset));
            let low = memory
                .u64(space(layout.heap_memory, layout.space_low))
                .ok()?;
            let high = memory
                .u64(space(layout.heap_memory, layout.space_high))
                .ok()?;
            let segmap = memory
                .u64(space(layout.heap_segmap, layout.space_low))
                .ok()?;
            let log2 = memory.i32(field(layout.heap_log2_segment)).ok()?;
            if low < high && (4..=16).contains(&log2) {
                heaps.push(Heap {
                    low,
                    high,
                    segmap,
                    log2_segment: log2 as u32,
                });
            }
        }
        Some(CodeCache {
            interpreter: (buffer, buffer.saturating_add(limit)),
            heaps,
            blobs: ByteCache::new(MAX_BLOB_BYTES),
            starts: ByteCache::new(MAX_START_BYTES),
            scopes: ByteCache::new(MAX_SCOPE_BYTES),
        })
    }

    /// True for a pc in the template interpreter.
    pub fn is_interpreted(&self, pc: u64) -> bool {
        (self.interpreter.0..self.interpreter.1).contains(&pc)
    }

    /// The blob holding `pc`, if any (remembered by its address).
    pub fn blob_at(
        &mut self,
        memory: &dyn RemoteMemory,
        pc: u64,
        layout: &Layout,
    ) -> Option<&Blob> {
        let start = match self.starts.get(&pc).copied() {
            Some(start) => start,
            None => {
                let start = self.blob_start(memory, pc, layout);
                self.starts.insert(pc, start, size_of::<Option<u64>>());
                start
            }
        }?;
        if !self.blobs.contains_key(&start) {
            // Its heap's end bounds its size; a start no heap holds (a block header at
            // a heap's very end) leaves it no room, and any size is refused.
            let heap_end = (self.heaps.iter())
                .find(|h| (h.low..h.high).contains(&start))
                .map_or(start, |h| h.high);
            let blob = read_blob(memory, start, heap_end, layout);
            let bytes = size_of::<Option<Blob>>()
                + blob.as_ref().map_or(0, |b| b.pc_descs.len()) * size_of::<(i32, i32)>();
            self.blobs.insert(start, blob, bytes);
        }
        self.blobs.get(&start)?.as_ref()
    }

    /// The scopes at compiled `pc`, innermost first (remembered by pc): the method
    /// and bytecode index of its frame and of every frame inlined into it; just the
    /// method when its debug data does not say, nothing when no compiled method
    /// holds `pc`.
    pub fn scopes_at(&mut self, memory: &dyn RemoteMemory, pc: u64, layout: &Layout) -> Vec<Scope> {
        if let Some(scopes) = self.scopes.get(&pc) {
            return scopes.clone();
        }
        let Some(blob) = self.blob_at(memory, pc, layout) else {
            return Vec::new();
        };
        let scopes = blob.read_scopes_at(memory, pc, layout);
        let bytes = size_of::<Vec<Scope>>() + scopes.len() * size_of::<Scope>();
        self.scopes.insert(pc, scopes.clone(), bytes);
        scopes
    }

    /// Forgets the blobs read (a compiled method may have been freed and its space
    /// reused).
    pub fn forget_blobs(&mut self) {
        self.blobs.clear();
        self.starts.clear();
        self.scopes.clear();
    }

    /// The start of the blob at `pc`: its heap's segment map, followed back to the
    /// block's first segment, which must be in use (`CodeHeap::find_block_for`).
    fn blob_start(&self, memory: &dyn RemoteMemory, pc: u64, layout: &Layout) -> Option<u64> {
        let heap = *self.heaps.iter().find(|h| (h.low..h.high).contains(&pc))?;
        let mut segment = (pc - heap.low) >> heap.log2_segment;
        let mut byte = [0u8; 1];
        for _ in 0..MAX_SEGMAP_STEPS {
            memory
                .read(heap.segmap.wrapping_add(segment), &mut byte)
                .ok()?;
            match byte[0] {
                0xff => return None,
                0 => {
                    let block = heap.low.wrapping_add(segment << heap.log2_segment);
                    let mut used = [0u8; 1];
                    (memory.read(block.wrapping_add(layout.heap_block_used), &mut used)).ok()?;
                    return (used[0] != 0).then(|| block.wrapping_add(layout.heap_block_size));
                }
                back => segment = segment.checked_sub(u64::from(back))?,
            }
        }
        None
    }
}

/// Reads the blob at `address`, in a heap that ends at `heap_end`.
fn read_blob(
    memory: &dyn RemoteMemory,
    address: u64,
    heap_end: u64,
    layout: &Layout,
) -> Option<Blob> {
    let at = |offset: u64| address.wrapping_add(offset);
    let name_pointer = memory.u64(at(layout.blob_name)).ok()?;
    let name = read_c_string(memory, name_pointer, 64).ok()?;
    let frame_words = memory.i32(at(layout.blob_frame_size)).ok()?;
    let size = u64::try_from(memory.i32(at(layout.blob_size)).ok()?).ok()?;
    let code_begin = match layout.code_start {
        CodeStart::Pointer(field) => memory.u64(at(field)).ok()?,
        CodeStart::Offset(field) => at(u64::try_from(memory.i32(at(field)).ok()?).ok()?),
    };
    // A blob lies in its heap: a larger size is forged, and would let a code start
    // far past the blob pass for its own.
    let end = address.checked_add(size).filter(|&end| end <= heap_end)?;
    if !(address..end).contains(&code_begin) {
        return None;
    }
    let mut blob = Blob {
        address,
        frame_bytes: u64::try_from(frame_words).ok()?.min(1 << 16) * 8,
        code_begin,
        method: None,
        pc_descs: Vec::new(),
        scopes: (0, 0),
        metadata: (0, 0),
    };
    if name == "nmethod" {
        let method = memory.u64(at(layout.nmethod_method)).ok()?;
        blob.method = (method != 0).then_some(method);
        read_debug_data(memory, &mut blob, layout);
    }
    Some(blob)
}

/// Fills a compiled method's pc descriptors, scopes and metadata ranges; leaves them
/// empty when they do not read back sensibly (the frame is then named by its method
/// alone).
fn read_debug_data(memory: &dyn RemoteMemory, blob: &mut Blob, layout: &Layout) -> Option<()> {
    let at = |offset: u64| blob.address.wrapping_add(offset);
    let int = |field: u64| -> Option<u64> { u64::try_from(memory.i32(at(field)).ok()?).ok() };
    let (pcs, scopes, metadata) = match layout.debug_data {
        DebugData::InBlob {
            scopes_data_begin,
            scopes_pcs_offset,
            dependencies_offset,
            metadata_offset,
        } => {
            let scopes_begin = memory.u64(at(scopes_data_begin)).ok()?;
            let pcs = (at(int(scopes_pcs_offset)?), at(int(dependencies_offset)?));
            (
                pcs,
                (scopes_begin, pcs.0),
                (at(int(metadata_offset)?), scopes_begin),
            )
        }
        DebugData::Separate {
            immutable_data,
            scopes_pcs_offset,
            scopes_data_offset,
            immutable_data_size,
            mutable_data,
            relocation_size,
            mutable_data_size,
        } => {
            let immutable = memory.u64(at(immutable_data)).ok()?;
            let mutable = memory.u64(at(mutable_data)).ok()?;
            let in_immutable = |field: u64| Some(immutable.wrapping_add(int(field)?));
            let in_mutable = |field: u64| Some(mutable.wrapping_add(int(field)?));
            let pcs = (
                in_immutable(scopes_pcs_offset)?,
                in_immutable(scopes_data_offset)?,
            );
            let scopes = (pcs.1, in_immutable(immutable_data_size)?);
            let metadata = (in_mutable(relocation_size)?, in_mutable(mutable_data_size)?);
            (pcs, scopes, metadata)
        }
    };
    let (desc_size, pc_field, scope_field) = layout.pc_desc;
    let sane_size = (8..=MAX_PC_DESC_BYTES).contains(&desc_size);
    if pcs.1 < pcs.0 || scopes.1 < scopes.0 || metadata.1 < metadata.0 || !sane_size {
        return None;
    }
    let count = (pcs.1 - pcs.0) / desc_size;
    if count > MAX_PC_DESCS {
        return None;
    }
    let mut table = vec![0u8; (count * desc_size) as usize];
    memory.read(pcs.0, &mut table).ok()?;
    let field = |entry: &[u8], at: u64| -> Option<i32> {
        let at = usize::try_from(at).ok()?;
        Some(i32::from_le_bytes(
            entry.get(at..at.checked_add(4)?)?.try_into().ok()?,
        ))
    };
    blob.pc_descs = (table.chunks_exact(desc_size as usize))
        .map(|entry| Some((field(entry, pc_field)?, field(entry, scope_field)?)))
        .collect::<Option<Vec<(i32, i32)>>>()?;
    blob.scopes = scopes;
    blob.metadata = metadata;
    Some(())
}

impl Blob {
    /// The scopes at `pc` in this compiled method, innermost first, read from the
    /// process; just the method itself when its debug data does not say.
    pub fn read_scopes_at(
        &self,
        memory: &dyn RemoteMemory,
        pc: u64,
        layout: &Layout,
    ) -> Vec<Scope> {
        let fallback = || {
            (self.method.into_iter())
                .map(|method| Scope { method, bci: -1 })
                .collect()
        };
        let Some(offset) = pc
            .checked_sub(self.code_begin)
            .and_then(|o| i32::try_from(o).ok())
        else {
            return fallback();
        };
        // A return address has its descriptor exactly (`find_pc_desc`, not approximate).
        let index = self
            .pc_descs
            .partition_point(|&(pc_offset, _)| pc_offset < offset);
        let decode_offset = match self.pc_descs.get(index) {
            // Offset 0 is the recorder's null scope.
            Some(&(pc_offset, decode_offset)) if pc_offset == offset && decode_offset > 0 => {
                decode_offset
            }
            _ => return fallback(),
        };
        match self.decode_scopes(memory, decode_offset, layout) {
            Some(scopes) if !scopes.is_empty() => scopes,
            _ => fallback(),
        }
    }

    /// Follows the scope chain from `decode_offset`: each scope is its caller's
    /// decode offset, its method's metadata index and its bytecode index.
    fn decode_scopes(
        &self,
        memory: &dyn RemoteMemory,
        mut decode_offset: i32,
        layout: &Layout,
    ) -> Option<Vec<Scope>> {
        let scopes_len = self.scopes.1 - self.scopes.0;
        let metadata_len = (self.metadata.1 - self.metadata.0) / 8;
        let mut out = Vec::new();
        for _ in 0..MAX_INLINE_DEPTH {
            let at = u64::try_from(decode_offset)
                .ok()
                .filter(|&at| at < scopes_len)?;
            let mut bytes = [0u8; 3 * crate::stream::MAX_LENGTH];
            let len = (bytes.len() as u64).min(scopes_len - at) as usize;
            memory
                .read(self.scopes.0.wrapping_add(at), &mut bytes[..len])
                .ok()?;
            let mut reader =
                CompressedReader::new(&bytes[..len], 0, layout.unsigned5_excludes_zero);
            let sender = reader.uint()?;
            let index = u64::from(reader.uint()?);
            let bci = (reader.uint()? as i32).wrapping_sub(1);
            if index == 0 || index > metadata_len {
                return None;
            }
            let method = memory
                .u64(self.metadata.0.wrapping_add((index - 1) * 8))
                .ok()?;
            out.push(Scope { method, bci });
            if sender == 0 {
                return Some(out);
            }
            decode_offset = i32::try_from(sender).ok()?;
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests;
