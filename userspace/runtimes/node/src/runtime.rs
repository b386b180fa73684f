//! Node.js as a [`Runtime`]: a node process whose binary allocbpf can read has its JS
//! heap sampled at V8's allocation-observer step and large-object spaces (the probes
//! count only processes with a `NODE` entry, written here), and every sample's stack,
//! native or JS heap, has its JavaScript frames named as `function (file.js:line)` in
//! place of the generated code or interpreter builtin they ran in.

use std::{
    collections::HashSet,
    mem::size_of,
    ops::Range,
    time::{Duration, Instant},
};

use allocbpf_common::{
    runtime_entry::{Plain, NODE_MAP},
    AllocFn,
};
use allocbpf_images::memory::ProcessMemory;
use allocbpf_profile::frame::{Frame, LocationStyle, SourceLocation, SourceLocations};
use allocbpf_runtime::{
    mark_runtime_frames,
    toolkit::{ByteCache, ProcessStates, RetryPolicy, StackCopy},
    Departure, Found, ProcessView, Runtime, RuntimeMaps, SampleStack,
};

use crate::{
    heap::Heap,
    names::{CodeOffset, Names},
    process::NodeFiles,
    v8dbg::Layout,
    walk::{walk, Origin},
};

/// This runtime's [`Runtime::name`].
pub const NAME: &str = "node";

/// A node process's constants are read once: what its binary says does not change
/// while it runs, so a look that refused them is final (one that found no node binary
/// records nothing, and a later look may find one).
const NO_RETRY: RetryPolicy = RetryPolicy {
    every: Duration::ZERO,
    times: 0,
};

/// The functions at places a process's cache was sized for when it counted entries:
/// the cache is bounded in bytes from it.
const MAX_CACHED_FRAMES: usize = 1 << 16;

/// Bytes the frames named hold per process: a function at a place is named as one
/// frame, or a few where optimized code inlined others, in a vector, about 128 bytes
/// with its key and entry, so this keeps about [`MAX_CACHED_FRAMES`] of them.
const MAX_FRAME_BYTES: usize = MAX_CACHED_FRAMES * 128;

/// V8's tagged word: what a JS heap chunk's sample stands for (an object of that size).
const JS_HEAP_WORD: u64 = 8;

/// JavaScript frames merged into one sample's stack at most.
const MAX_MERGED_FRAMES: usize = 512;

/// How long names read from a process are believed: the collector moves objects.
const REFRESH_EVERY: Duration = Duration::from_secs(10);

/// A node process allocbpf reads.
struct NodeProcess {
    memory: ProcessMemory,
    layout: Layout,
    names: Names,
    /// The frames each function at each place was named as (interned).
    frames: ByteCache<(u64, CodeOffset), Vec<Frame>>,
    /// Its embedded builtins, where mapped.
    builtins: Option<Range<u64>>,
    refreshed: Instant,
}

/// The node processes of a session and the naming of their frames.
pub struct NodeRuntime {
    /// Each process looked at: Node.js, read (boxed: most processes are not node and
    /// keep a small state), or not Node.js or one allocbpf cannot read (the reason was
    /// said once). A node process's entry in [`NODE_MAP`] goes when it execs or its
    /// pid is reused.
    processes: ProcessStates<Box<NodeProcess>>,
    files: NodeFiles,
}

impl Default for NodeRuntime {
    fn default() -> Self {
        Self {
            processes: ProcessStates::new(NO_RETRY, Some(NODE_MAP)),
            files: NodeFiles::default(),
        }
    }
}

impl Runtime for NodeRuntime {
    fn name(&self) -> &'static str {
        NAME
    }

    fn look_at(&mut self, process: &ProcessView<'_>, maps: &mut dyn RuntimeMaps) -> Option<Found> {
        let pid = process.pid;
        if self.processes.knows(pid) {
            return None;
        }
        let found = self.files.discover(pid, process.maps)?;
        let [major, minor, build] = found.file.version;
        let version = format!("{major}.{minor}.{build}");
        let path = found.path.display();
        let layout = match found.file.layout {
            Ok(layout) => layout,
            Err(error) => {
                tracing::warn!(
                    "pid {pid}: {path} exports V8 constants but is profiled as native code \
                     only: {error}"
                );
                self.processes.set_other(pid);
                return None;
            }
        };
        match found.file.heap {
            Ok(heap) => match maps.set_entry(NODE_MAP, pid, heap.as_bytes()) {
                Ok(()) if heap.lab == 0 => tracing::warn!(
                    "pid {pid}: Node.js on V8 {version} ({path}): its JavaScript frames are \
                     named and its JS heap's large objects sampled, not its small ones (V8 \
                     12's allocator does not step its observers at every refill)"
                ),
                Ok(()) => tracing::info!(
                    "pid {pid}: Node.js on V8 {version} ({path}): its JS heap is sampled, its \
                     JavaScript frames named"
                ),
                Err(error) => tracing::warn!("pid {pid}: its JS heap is not sampled: {error}"),
            },
            Err(error) => tracing::warn!(
                "pid {pid}: Node.js on V8 {version} ({path}): its JS heap is not sampled \
                 ({error}); its JavaScript frames are named"
            ),
        }
        let builtins = (found.file.builtins.as_ref())
            .map(|r| r.start.wrapping_add(found.bias)..r.end.wrapping_add(found.bias));
        self.processes.insert(
            pid,
            Box::new(NodeProcess {
                memory: ProcessMemory::new(pid),
                layout,
                names: Names::default(),
                frames: ByteCache::new(MAX_FRAME_BYTES),
                builtins,
                refreshed: Instant::now(),
            }),
        );
        Some(Found {
            runtime: NAME,
            labels: vec![("v8_version", version)],
            source: None,
        })
    }

    fn merge_frames(
        &mut self,
        sample: &SampleStack<'_>,
        mut native: Vec<Frame>,
        locations: &mut SourceLocations,
    ) -> Vec<Frame> {
        let (Some(node), Some(copied)) = (self.processes.get_mut(sample.pid), sample.native) else {
            return native;
        };
        if node.refreshed.elapsed() >= REFRESH_EVERY {
            node.names.clear();
            node.frames.clear();
            node.refreshed = Instant::now();
        }
        // Generated code is in no file: its frames are the ones no module covered.
        let generated: HashSet<u64> = (sample.addresses.iter().zip(&native))
            .filter(|(_, frame)| matches!(frame, Frame::Unknown(_)))
            .map(|(&address, _)| address)
            .collect();
        let builtins = node.builtins.clone();
        let origin = |pc: u64| match builtins.as_ref().is_some_and(|r| r.contains(&pc)) {
            true => Origin::Builtins,
            false if generated.contains(&pc) => Origin::Generated,
            false => Origin::Native,
        };
        let heap = Heap {
            memory: &node.memory,
            layout: &node.layout,
        };
        let [_, sp, bp] = copied.regs;
        let copy = StackCopy {
            base: sp,
            bytes: copied.stack,
        };
        // Each JavaScript frame replaces the native frame of its code's address (which
        // names a builtin or nothing), with the functions inlined there before it;
        // every frame in V8's code keeps the place among the native frames.
        let mut cursor = 0;
        let mut replaced: Vec<(usize, Vec<Frame>)> = Vec::new();
        let mut merged = 0usize;
        for (pc, js) in walk(&heap, &mut node.names, &copy, bp, &origin) {
            let Some(index) = (sample.addresses.iter().skip(cursor)).position(|&a| a == pc) else {
                continue;
            };
            let index = cursor + index;
            cursor = index + 1;
            let Some(js) = js else { continue };
            if merged >= MAX_MERGED_FRAMES {
                break;
            }
            let frames = match node.frames.get(&(js.function, js.at)) {
                Some(known) => known.clone(),
                None => {
                    let named = node.names.frames(&heap, js.function, js.at);
                    let frames: Vec<Frame> = (named.into_iter())
                        .map(|named| {
                            Frame::Runtime(locations.intern(SourceLocation {
                                function: named.function,
                                file: named.file,
                                line: named.line,
                                style: LocationStyle::WithFile,
                            }))
                        })
                        .collect();
                    let bytes = size_of::<Vec<Frame>>() + frames.len() * size_of::<Frame>();
                    node.frames
                        .insert((js.function, js.at), frames.clone(), bytes);
                    frames
                }
            };
            merged += frames.len();
            replaced.push((index, frames));
        }
        for (index, frames) in replaced.into_iter().rev() {
            if index < native.len() {
                native.splice(index..=index, frames);
            }
        }
        native
    }

    /// A LAB chunk's sample stands for one tagged word of the allocation that ended
    /// it: the probe sees the chunk's bytes, never its objects, so a JS heap site's
    /// objects are counted in words (docs/statistics.md, "Node.js").
    fn held_locations(&self, mark: &mut dyn FnMut(u32)) {
        let cached = (self.processes.states()).flat_map(|process| process.frames.values());
        mark_runtime_frames(cached, mark);
    }

    fn attributed_object(&self, sample: &SampleStack<'_>) -> Option<u64> {
        (sample.function == Some(AllocFn::JsHeapChunk)).then_some(JS_HEAP_WORD)
    }

    fn forget(&mut self, pid: u32, why: Departure, maps: &mut dyn RuntimeMaps) {
        self.processes.forget(pid, why, maps);
    }

    fn descriptor_errors(&self) -> u64 {
        self.files.descriptor_errors()
    }
}
