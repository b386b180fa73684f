//! Is a process Node.js, and what does its binary say? Found from the mapped file
//! whose name says node (`node`, `nodejs`, `libnode.so.*`) and that exports V8's debug
//! constants; its V8 version, the range of its embedded builtins and the offsets its
//! allocation-observer step reads come from the same file.
//!
//! Files are read through the kernel's link to the very file mapped
//! (`allocbpf_images::procfs::open_mapped`: checked, size-capped), once per file.

use std::ops::Range;

use allocbpf_common::node::V8Heap;
use allocbpf_images::{allocators::V8_LAB_STEP_NAMES, examined::ExaminedFiles, procfs::MapsEntry};
use object::{Object, ObjectSegment, ObjectSymbol};

use crate::{
    observer,
    v8dbg::{Constants, Layout},
    NodeError,
};

/// The version symbols (`v8::internal::Version::major_` ...), in the binary's data.
const VERSION_SYMBOLS: [&str; 3] = [
    "_ZN2v88internal7Version6major_E",
    "_ZN2v88internal7Version6minor_E",
    "_ZN2v88internal7Version6build_E",
];

/// What a node binary says, whichever process maps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeFile {
    /// Its V8 layout, or why none.
    pub layout: Result<Layout, NodeError>,
    /// V8's version: major, minor, build.
    pub version: [u32; 3],
    /// The addresses (in the file) of its embedded builtins, code V8 runs JavaScript
    /// frames in.
    pub builtins: Option<Range<u64>>,
    /// What the allocation-observer step reads, or why it cannot be probed.
    pub heap: Result<V8Heap, NodeError>,
    /// The lowest address of its loadable segments (mapped at file offset 0).
    pub first_address: u64,
}

/// A Node.js process as found in its maps.
#[derive(Clone, Debug)]
pub struct Found {
    /// Its binary.
    pub file: NodeFile,
    /// Where the binary is mapped less where it wants to be (0 for an executable not
    /// built position-independent).
    pub bias: u64,
    /// The binary's path.
    pub path: std::path::PathBuf,
}

/// Node files examined.
#[derive(Default)]
pub struct NodeFiles {
    files: ExaminedFiles<NodeFile>,
}

/// True for a file name that says node.
fn named_node(name: &std::ffi::OsStr) -> bool {
    let name = name.as_encoded_bytes();
    name == b"node" || name == b"nodejs" || name.starts_with(b"libnode.so")
}

impl NodeFiles {
    /// The node binary in `pid`'s mappings: `None` when it maps none that exports V8's
    /// constants.
    pub fn discover(&mut self, pid: u32, maps: &[MapsEntry]) -> Option<Found> {
        let (mapping, path, file) = self.files.find(pid, maps, named_node, read_file)?;
        Some(Found {
            bias: mapping.range.start.wrapping_sub(file.first_address),
            file: file.clone(),
            path: path.to_path_buf(),
        })
    }

    /// Opens that failed for want of descriptors so far.
    pub fn descriptor_errors(&self) -> u64 {
        self.files.descriptor_errors
    }
}

/// What a parsed node binary says; `None` for a file that exports no V8 constant.
pub fn read_file(elf: &object::File<'_>) -> Option<NodeFile> {
    let constants = Constants::read(elf);
    if constants.is_empty() {
        return None;
    }
    let first_address = elf.segments().map(|s| s.address()).min().unwrap_or(0);
    let mut version_at = [None; 3];
    let mut builtins: Option<Range<u64>> = None;
    let mut step = None;
    for symbol in elf.symbols().chain(elf.dynamic_symbols()) {
        let Ok(name) = symbol.name() else { continue };
        if !symbol.is_definition() {
            continue;
        }
        if let Some(i) = VERSION_SYMBOLS.iter().position(|&v| v == name) {
            version_at[i] = Some(symbol.address());
        } else if name.starts_with("Builtins_") && symbol.size() > 0 {
            let end = symbol.address().saturating_add(symbol.size());
            builtins = Some(match builtins {
                Some(range) => range.start.min(symbol.address())..range.end.max(end),
                None => symbol.address()..end,
            });
        } else if step.is_none() && V8_LAB_STEP_NAMES.contains(&name) {
            step = Some((symbol.address(), symbol.size()));
        }
    }
    let read_u32 = |address: u64| -> Option<u32> {
        let bytes = bytes_at(elf, address, 4)?;
        Some(u32::from_le_bytes(bytes.try_into().ok()?))
    };
    let mut version = [0u32; 3];
    for (slot, at) in version.iter_mut().zip(version_at) {
        *slot = at.and_then(read_u32).unwrap_or(0);
    }
    let layout = match version_at[0] {
        None => Err(NodeError::MissingConstant("V8 version")),
        Some(_) => Layout::new(&constants, (version[0], version[1])),
    };
    let heap = match step {
        // V8 12's allocator does not step on every refill: its chunks would be counted
        // in part, biased; its large objects are counted.
        _ if version[0] >= 12 => Ok(V8Heap::default()),
        Some((address, size)) => bytes_at(elf, address, size.min(256))
            .ok_or(NodeError::UnknownStep("AdvanceAllocationObservers"))
            .and_then(|code| observer::offsets(code, address)),
        None => Err(NodeError::MissingConstant(
            "AdvanceAllocationObservers symbol",
        )),
    };
    Some(NodeFile {
        layout,
        version,
        builtins,
        heap,
        first_address,
    })
}

/// `length` bytes at `address` of `elf`'s sections with file data.
fn bytes_at<'d>(elf: &object::File<'d>, address: u64, length: u64) -> Option<&'d [u8]> {
    let (data, at) = crate::v8dbg::section_at(elf, address, length)?;
    data.get(at..at.checked_add(length as usize)?)
}
