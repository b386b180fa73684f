//! Whether a function has its own unwind table entry.
//!
//! An entry that calls its forward (musl's `calloc` calls `malloc`) and is not probed
//! leaves a frame of its own between the probed function and the program: the caller
//! that matters (the program's allocation site) is found only by unwinding through
//! that frame, which needs the entry's call frame information. Debian's mimalloc and
//! tcmalloc have it; Debian's musl `libc.so` has almost none (132 bytes of
//! `.eh_frame`), so there such entries stay probed.
//!
//! The check looks the entry's address up in `.eh_frame_hdr`'s sorted search table,
//! which every linker writes in one encoding (initial locations as 4-byte signed
//! offsets from the section); any other encoding, or no table, answers "no".

use object::{Object, ObjectSection};

/// `DW_EH_PE_udata4`
const UDATA4: u8 = 0x03;
/// `DW_EH_PE_datarel | DW_EH_PE_sdata4`
const DATAREL_SDATA4: u8 = 0x3b;

/// True if an FDE of `file`'s `.eh_frame_hdr` table starts exactly at `address`.
pub fn has_fde_at(file: &object::File, address: u64) -> bool {
    let Some(section) = file.section_by_name(".eh_frame_hdr") else {
        return false;
    };
    let Ok(data) = section.data() else {
        return false;
    };
    fde_starts_at(data, section.address(), address)
}

/// [`has_fde_at`] on the section's bytes `hdr`, loaded at `hdr_address`.
fn fde_starts_at(hdr: &[u8], hdr_address: u64, address: u64) -> bool {
    let [1, _, count_encoding, table_encoding, ..] = *hdr else {
        return false;
    };
    if count_encoding != UDATA4 || table_encoding != DATAREL_SDATA4 {
        return false;
    }
    let word = |at: usize| -> Option<i32> {
        Some(i32::from_le_bytes(hdr.get(at..at + 4)?.try_into().ok()?))
    };
    // version, 3 encodings, eh_frame_ptr (4 bytes: every encoding in use is 4 wide).
    let Some(count) = word(8) else { return false };
    let table = 12;
    let location = |index: usize| -> Option<u64> {
        word(table + index * 8).map(|offset| hdr_address.wrapping_add_signed(offset as i64))
    };
    let (mut lo, mut hi) = (0usize, count as u32 as usize);
    // The table is sorted by initial location.
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        match location(mid) {
            None => return false,
            Some(at) if at == address => return true,
            Some(at) if at < address => lo = mid + 1,
            Some(_) => hi = mid,
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use object::{Object, ObjectSymbol};

    use super::*;

    fn check(path: &str, symbol: &str) -> bool {
        let data = std::fs::read(path).unwrap();
        let file = object::File::parse(&*data).unwrap();
        let address = file
            .dynamic_symbols()
            .find(|s| s.name() == Ok(symbol))
            .unwrap()
            .address();
        has_fde_at(&file, address)
    }

    #[test]
    fn glibc_has_unwind_tables_and_debians_musl_does_not() {
        assert!(check("/lib/x86_64-linux-gnu/libc.so.6", "posix_memalign"));
        assert!(check("/lib/x86_64-linux-gnu/libc.so.6", "malloc"));
        assert!(!check("/usr/lib/x86_64-linux-musl/libc.so", "calloc"));
    }

    #[test]
    fn a_table_in_another_encoding_or_truncated_answers_no() {
        // version 1, pcrel sdata4, udata4 count, datarel sdata4 table; 1 entry at +0x10.
        let mut hdr = vec![1, 0x1b, UDATA4, DATAREL_SDATA4, 0, 0, 0, 0, 1, 0, 0, 0];
        hdr.extend_from_slice(&0x10i32.to_le_bytes());
        hdr.extend_from_slice(&0x20i32.to_le_bytes());
        assert!(fde_starts_at(&hdr, 0x1000, 0x1010));
        assert!(!fde_starts_at(&hdr, 0x1000, 0x1011));
        assert!(!fde_starts_at(&hdr[..14], 0x1000, 0x1010));
        hdr[3] = 0x1b;
        assert!(!fde_starts_at(&hdr, 0x1000, 0x1010));
    }
}
