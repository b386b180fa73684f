//! The offsets allocbpf reads a JVM with, taken from its own tables ([`VmStructs`]):
//! where a thread keeps its last Java frame, how the code cache finds the code blob of
//! a pc, how a compiled method records its inlined scopes, and how a method names
//! itself. HotSpot moved a few of these between versions (a blob's code start became
//! an offset, a compiled method's debug data moved out of the code cache, the
//! compressed-integer coding excluded the zero byte); each is told here once, from what
//! the tables hold.

use allocbpf_common::java::JavaWalk;

use crate::{vmstructs::VmStructs, JvmError};

/// The VM types whose fields and sizes are read.
pub const TYPES: &[&str] = &[
    "JavaThread",
    "JavaFrameAnchor",
    "Thread",
    "ThreadLocalAllocBuffer",
    "Klass",
    "Symbol",
    "Method",
    "ConstMethod",
    "ConstantPool",
    "CodeCache",
    "CodeHeap",
    "HeapBlock",
    "HeapBlock::Header",
    "VirtualSpace",
    "CodeBlob",
    "CompiledMethod",
    "nmethod",
    "PcDesc",
    "AbstractInterpreter",
    "StubQueue",
    "GrowableArrayBase",
    "GrowableArray<int>",
    "Abstract_VM_Version",
];

/// The integer constants read.
pub const CONSTANTS: &[&str] = &[
    "ConstMethod::_has_linenumber_table",
    "ConstMethodFlags::_misc_has_linenumber_table",
];

/// Where a compiled frame's pc's code starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CodeStart {
    /// `CodeBlob::_code_begin`: a pointer (JDK 17).
    Pointer(u64),
    /// `CodeBlob::_code_offset`: bytes from the blob (JDK 23 on).
    Offset(u64),
}

/// Where a compiled method keeps its scopes and metadata.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DebugData {
    /// In the blob itself (JDK 17): scopes data from a pointer, pc descriptors and
    /// metadata at offsets from the blob.
    InBlob {
        /// `CompiledMethod::_scopes_data_begin` (a pointer).
        scopes_data_begin: u64,
        /// `nmethod::_scopes_pcs_offset`.
        scopes_pcs_offset: u64,
        /// `nmethod::_dependencies_offset` (where the pc descriptors end).
        dependencies_offset: u64,
        /// `nmethod::_metadata_offset`.
        metadata_offset: u64,
    },
    /// In separate immutable and mutable data (JDK 24 on).
    Separate {
        /// `nmethod::_immutable_data` (a pointer).
        immutable_data: u64,
        /// `nmethod::_scopes_pcs_offset` (from the immutable data).
        scopes_pcs_offset: u64,
        /// `nmethod::_scopes_data_offset` (from the immutable data; where the pc
        /// descriptors end).
        scopes_data_offset: u64,
        /// `nmethod::_immutable_data_size`.
        immutable_data_size: u64,
        /// `CodeBlob::_mutable_data` (a pointer).
        mutable_data: u64,
        /// `CodeBlob::_relocation_size` (the metadata follows the relocations).
        relocation_size: u64,
        /// `CodeBlob::_mutable_data_size`.
        mutable_data_size: u64,
    },
}

/// One JVM version's offsets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// The JDK's feature version (17, 25), from `Abstract_VM_Version::_vm_major_version`.
    pub major: u32,
    /// What the eBPF program reads at a sample.
    pub walk: JavaWalk,
    /// `Klass::_name`.
    pub klass_name: u64,
    /// `Symbol::_length` (u16) and `Symbol::_body`.
    pub symbol_length: u64,
    /// `Symbol::_body`.
    pub symbol_body: u64,
    /// `Method::_constMethod`.
    pub method_const: u64,
    /// `ConstMethod::_constants`.
    pub const_constants: u64,
    /// `ConstMethod::_flags` (or `_flags._flags`), and its width in bytes.
    pub const_flags: (u64, usize),
    /// The flag that says a method has a line number table.
    pub has_line_numbers: u32,
    /// `ConstMethod::_code_size` (u16).
    pub const_code_size: u64,
    /// `ConstMethod::_name_index` (u16).
    pub const_name_index: u64,
    /// `ConstMethod::_signature_index` (u16).
    pub const_signature_index: u64,
    /// `sizeof(ConstMethod)`: its bytecodes follow it.
    pub const_method_size: u64,
    /// `ConstantPool::_pool_holder`.
    pub pool_holder: u64,
    /// `ConstantPool::_source_file_name_index` (u16).
    pub pool_source_file: u64,
    /// `ConstantPool::_length` (int): its slots.
    pub pool_length: u64,
    /// `sizeof(ConstantPool)`: its slots follow it.
    pub pool_size: u64,
    /// Address of `CodeCache::_heaps` (a `GrowableArray<CodeHeap*>*`).
    pub code_heaps: u64,
    /// `GrowableArrayBase::_len` and `GrowableArray<int>::_data`.
    pub array_len: u64,
    /// `GrowableArray<int>::_data`.
    pub array_data: u64,
    /// `CodeHeap::_memory` (a `VirtualSpace`).
    pub heap_memory: u64,
    /// `CodeHeap::_segmap` (a `VirtualSpace`).
    pub heap_segmap: u64,
    /// `CodeHeap::_log2_segment_size` (int).
    pub heap_log2_segment: u64,
    /// `sizeof(HeapBlock)`: a blob follows its block header.
    pub heap_block_size: u64,
    /// `HeapBlock::Header::_used` (bool): the block holds a blob, not free space.
    pub heap_block_used: u64,
    /// `VirtualSpace::_low_boundary`: where a heap's reserved range starts (constant,
    /// where the committed top grows as the heap expands).
    pub space_low: u64,
    /// `VirtualSpace::_high_boundary`: where it ends.
    pub space_high: u64,
    /// `CodeBlob::_name` (a C string).
    pub blob_name: u64,
    /// `CodeBlob::_frame_size` (int, in words).
    pub blob_frame_size: u64,
    /// `CodeBlob::_size` (int).
    pub blob_size: u64,
    /// Where a blob's code starts.
    pub code_start: CodeStart,
    /// `nmethod::_method` (`CompiledMethod::_method` in JDK 17).
    pub nmethod_method: u64,
    /// Where compiled methods keep their scopes.
    pub debug_data: DebugData,
    /// `sizeof(PcDesc)`, and `PcDesc::_pc_offset` and `_scope_decode_offset`.
    pub pc_desc: (u64, u64, u64),
    /// Address of `AbstractInterpreter::_code` (a `StubQueue*`).
    pub interpreter_code: u64,
    /// `StubQueue::_stub_buffer` and `_buffer_limit` (int).
    pub stub_buffer: (u64, u64),
    /// Compressed integers exclude the zero byte (HotSpot's `UNSIGNED5`, JDK 20 on).
    pub unsigned5_excludes_zero: bool,
}

/// Words below an interpreted frame's `fp` where it keeps its `Method*` and bytecode
/// pointer (x86-64's `frame::interpreter_frame_method_offset` and `_bcp_offset`, the
/// same from JDK 9 on and not in the tables).
pub const INTERPRETER_METHOD_SLOT: i64 = -3;
/// See [`INTERPRETER_METHOD_SLOT`].
pub const INTERPRETER_BCP_SLOT: i64 = -8;
/// An interpreted frame's caller's stack pointer before any adapter extended it.
pub const INTERPRETER_SENDER_SP_SLOT: i64 = -1;

/// The oldest JDK whose structures allocbpf reads.
pub const OLDEST_MAJOR: u32 = 11;

impl Layout {
    /// The layout of the JVM whose tables are `vm`; `major` is read by the caller from
    /// `Abstract_VM_Version::_vm_major_version`.
    pub fn from_tables(vm: &VmStructs, major: u32) -> Result<Layout, JvmError> {
        if major < OLDEST_MAJOR {
            return Err(JvmError::TooOld(major));
        }
        let anchor = vm.offset("JavaThread", "_anchor")?;
        let tlab = vm.offset("Thread", "_tlab")?;
        let narrow = |value: u64| u32::try_from(value).map_err(|_| JvmError::Forged("an offset"));
        let walk = JavaWalk {
            anchor: narrow(anchor)?,
            last_sp: narrow(vm.offset("JavaFrameAnchor", "_last_Java_sp")?)?,
            last_pc: narrow(vm.offset("JavaFrameAnchor", "_last_Java_pc")?)?,
            last_fp: narrow(vm.offset("JavaFrameAnchor", "_last_Java_fp")?)?,
            tlab_start: narrow(tlab.wrapping_add(vm.offset("ThreadLocalAllocBuffer", "_start")?))?,
            tlab_top: narrow(tlab.wrapping_add(vm.offset("ThreadLocalAllocBuffer", "_top")?))?,
            stack_base: narrow(vm.offset("JavaThread", "_stack_base")?)?,
        };
        let (const_flags, has_line_numbers) = match vm.offset("ConstMethod", "_flags._flags") {
            Ok(offset) => (
                (offset, 4),
                vm.int("ConstMethodFlags::_misc_has_linenumber_table")
                    .unwrap_or(1),
            ),
            Err(_) => (
                (vm.offset("ConstMethod", "_flags")?, 2),
                vm.int("ConstMethod::_has_linenumber_table").unwrap_or(1),
            ),
        };
        let code_start = match vm.offset("CodeBlob", "_code_begin") {
            Ok(offset) => CodeStart::Pointer(offset),
            Err(_) => CodeStart::Offset(vm.offset("CodeBlob", "_code_offset")?),
        };
        let debug_data = match vm.offset("nmethod", "_immutable_data") {
            Ok(immutable_data) => DebugData::Separate {
                immutable_data,
                scopes_pcs_offset: vm.offset("nmethod", "_scopes_pcs_offset")?,
                scopes_data_offset: vm.offset("nmethod", "_scopes_data_offset")?,
                immutable_data_size: vm.offset("nmethod", "_immutable_data_size")?,
                mutable_data: vm.offset("CodeBlob", "_mutable_data")?,
                relocation_size: vm.offset("CodeBlob", "_relocation_size")?,
                mutable_data_size: vm.offset("CodeBlob", "_mutable_data_size")?,
            },
            Err(_) => DebugData::InBlob {
                scopes_data_begin: vm.offset("CompiledMethod", "_scopes_data_begin")?,
                scopes_pcs_offset: vm.offset("nmethod", "_scopes_pcs_offset")?,
                dependencies_offset: vm.offset("nmethod", "_dependencies_offset")?,
                metadata_offset: vm.offset("nmethod", "_metadata_offset")?,
            },
        };
        let nmethod_method = (vm.offset("nmethod", "_method"))
            .or_else(|_| vm.offset("CompiledMethod", "_method"))?;
        Ok(Layout {
            major,
            walk,
            klass_name: vm.offset("Klass", "_name")?,
            symbol_length: vm.offset("Symbol", "_length")?,
            symbol_body: vm.offset("Symbol", "_body")?,
            method_const: vm.offset("Method", "_constMethod")?,
            const_constants: vm.offset("ConstMethod", "_constants")?,
            const_flags,
            has_line_numbers: has_line_numbers as u32,
            const_code_size: vm.offset("ConstMethod", "_code_size")?,
            const_name_index: vm.offset("ConstMethod", "_name_index")?,
            const_signature_index: vm.offset("ConstMethod", "_signature_index")?,
            const_method_size: vm.size("ConstMethod")?,
            pool_holder: vm.offset("ConstantPool", "_pool_holder")?,
            pool_source_file: vm.offset("ConstantPool", "_source_file_name_index")?,
            pool_length: vm.offset("ConstantPool", "_length")?,
            pool_size: vm.size("ConstantPool")?,
            code_heaps: vm.address("CodeCache", "_heaps")?,
            // Not in every version's tables; the same layout throughout.
            array_len: vm.offset("GrowableArrayBase", "_len").unwrap_or(0),
            array_data: vm.offset("GrowableArray<int>", "_data").unwrap_or(8),
            heap_memory: vm.offset("CodeHeap", "_memory")?,
            heap_segmap: vm.offset("CodeHeap", "_segmap")?,
            heap_log2_segment: vm.offset("CodeHeap", "_log2_segment_size")?,
            heap_block_size: vm.size("HeapBlock")?,
            heap_block_used: (vm.offset("HeapBlock", "_header")?)
                .wrapping_add(vm.offset("HeapBlock::Header", "_used")?),
            space_low: vm.offset("VirtualSpace", "_low_boundary")?,
            space_high: vm.offset("VirtualSpace", "_high_boundary")?,
            blob_name: vm.offset("CodeBlob", "_name")?,
            blob_frame_size: vm.offset("CodeBlob", "_frame_size")?,
            blob_size: vm.offset("CodeBlob", "_size")?,
            code_start,
            nmethod_method,
            debug_data,
            pc_desc: (
                vm.size("PcDesc")?,
                vm.offset("PcDesc", "_pc_offset")?,
                vm.offset("PcDesc", "_scope_decode_offset")?,
            ),
            interpreter_code: vm.address("AbstractInterpreter", "_code")?,
            stub_buffer: (
                vm.offset("StubQueue", "_stub_buffer")?,
                vm.offset("StubQueue", "_buffer_limit")?,
            ),
            unsigned5_excludes_zero: major >= 20,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vmstructs::Field;

    #[test]
    fn old_jdks_and_missing_fields_are_refused_saying_why() {
        let vm = VmStructs::from_parts(&[("JavaThread", "_anchor", Field::Member(656))], &[], &[]);
        assert!(matches!(
            Layout::from_tables(&vm, 8),
            Err(JvmError::TooOld(8))
        ));
        let error = Layout::from_tables(&vm, 17).unwrap_err().to_string();
        assert!(error.contains("Thread::_tlab"), "{error}");
    }
}
