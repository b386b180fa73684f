//! What to probe in a process, found by reading its files: the static analysis of
//! allocator images.
//!
//! Data flow: a process's maps ([`procfs`], read as hostile input through
//! `/proc/PID/map_files`) → its allocator images ([`discover`], [`image`]: which
//! entries, at which instruction; [`allocators`]: the catalogue of families) → what the
//! sampler attaches (`allocbpf-probe`). [`target`] resolves one process's images;
//! [`sealed_copy`] makes the bounded, sealed copies of mapped files that symbolization
//! reads; [`elf_ranges`] says which byte ranges of an ELF file those copies need;
//! [`memory`] reads another process's memory (bounded; what comes back is hostile).
//!
//! Nothing here touches the kernel's BPF side: it reads files and process maps, and
//! decodes instructions. Errors are typed ([`target::TargetError`],
//! [`procfs::MappedFileError`], ...).
#![deny(missing_docs)]

pub mod allocators;
pub mod discover;
mod elf_header;
pub mod elf_ranges;
pub mod examined;
pub mod image;
pub mod memory;
pub mod procfs;
pub mod sealed_copy;
pub mod target;
