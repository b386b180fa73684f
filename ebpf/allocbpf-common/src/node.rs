//! The V8 heap of a Node.js process: where the eBPF program finds, at a probed call of
//! V8's allocation-observer step, how many bytes the space's linear allocation buffer
//! (LAB) handed out since the previous step. The offsets differ from build to build and
//! are read by userspace from the very function probed (its first instructions load
//! them), then written to the process's [`V8Heap`] entry of the `NODE` map; a process
//! without an entry is never sampled at those probes.

/// Most processes whose V8 heap is sampled at once (`NODE` map).
pub const MAX_NODE_PROCESSES: u32 = 4096;

/// Largest chunk a LAB step can report: a V8 page (256 KiB) many times over. A larger
/// difference of the LAB's top and start is not a chunk of a V8 heap (a forged or torn
/// read) and is not counted.
pub const MAX_LAB_CHUNK: u64 = 64 << 20;

/// Bound on a large-object space allocation's size (V8 refuses more than about 1 GiB in
/// one object; a C `int` this large or larger is negative): anything at or above it
/// read from the call is not counted.
pub const MAX_LARGE_OBJECT: u64 = 1 << 31;

/// Byte offsets, in one process's V8 build, of what the LAB step reads (keyed by pid
/// in the `NODE` map).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct V8Heap {
    /// In the space (or allocator) the step is called on: the pointer to its
    /// `LinearAllocationArea` (`start`, then `top`, words 0 and 1). 0: the process's
    /// LAB steps are not counted (a build whose step is not on every refill's path),
    /// its large objects are.
    pub lab: u32,
    /// In the same object: the pointer to its `Heap`.
    pub heap: u32,
    /// In the `Heap`: the 32-bit depth of the pause of its allocation observers; while
    /// it is not zero the bytes are the collector's own (objects it moves), not the
    /// program's, and are not counted.
    pub pause: u32,
    /// In the space or allocator: a byte that is zero when this allocator does not
    /// report to observers at all (V8 12's background allocators); 0 when the build
    /// has no such byte.
    pub gate: u32,
}
