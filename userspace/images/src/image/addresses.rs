//! Virtual addresses of an ELF file: the code at one, and its file offset. Shared by
//! the entry resolution (`entries.rs`), the trampolines (`indirect.rs`) and the inlined
//! sites (`inlined/`).

use object::{Object, ObjectSection, ObjectSegment, SectionKind};

/// Up to `len` bytes of code at virtual address `address`: `None` unless a text
/// section holds it.
pub(super) fn code_at<'a>(file: &'a object::File, address: u64, len: usize) -> Option<&'a [u8]> {
    file.sections().find_map(|section| {
        let (start, size) = (section.address(), section.size());
        if section.kind() != SectionKind::Text || !(start..start + size).contains(&address) {
            return None;
        }
        let data = section.data().ok()?;
        let from = (address - start) as usize;
        data.get(from..(from + len).min(data.len()))
    })
}

/// The file offset of virtual address `address`, through the loadable segments.
pub(super) fn file_offset_of(file: &object::File, address: u64) -> Option<u64> {
    file.segments().find_map(|segment| {
        let (start, end) = (segment.address(), segment.address() + segment.size());
        (start..end)
            .contains(&address)
            .then(|| address - start + segment.file_range().0)
    })
}
