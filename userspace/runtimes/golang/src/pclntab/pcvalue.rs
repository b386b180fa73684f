//! pc-value tables: a run of (value delta, pc delta) pairs of varints from a function's
//! entry, the value starting at -1 (the runtime's `step`).

use crate::buildinfo::uvarint;

/// Most pairs read in one table (a function of a megabyte of code has fewer).
const MAX_STEPS: usize = 1 << 20;

/// The value the table `table` gives `target` in a function starting at `entry`:
/// `None` when `target` is past the table's end or the table is malformed.
pub(super) fn pc_value(table: &[u8], entry: u64, target: u64, quantum: u64) -> Option<i64> {
    let mut value: i64 = -1;
    let mut pc = entry;
    let mut at = 0usize;
    for step in 0..MAX_STEPS {
        let (value_delta, used) = uvarint(table.get(at..)?)?;
        // A zero value delta ends the table, except the first.
        if value_delta == 0 && step > 0 {
            return None;
        }
        at += used;
        let (pc_delta, used) = uvarint(table.get(at..)?)?;
        at += used;
        value = value.wrapping_add(zigzag(value_delta));
        pc = pc.checked_add(pc_delta.checked_mul(quantum)?)?;
        if target < pc {
            return Some(value);
        }
    }
    None
}

/// A zigzag-encoded varint's value.
fn zigzag(value: u64) -> i64 {
    if value & 1 != 0 {
        !((value >> 1) as i64)
    } else {
        (value >> 1) as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_through_a_table() {
        // +2 for 4 bytes (value 1), +4 for 3 bytes (value 3), end.
        let table = [0x04, 0x04, 0x04, 0x03, 0x00];
        assert_eq!(pc_value(&table, 0x100, 0x100, 1), Some(1));
        assert_eq!(pc_value(&table, 0x100, 0x103, 1), Some(1));
        assert_eq!(pc_value(&table, 0x100, 0x104, 1), Some(3));
        assert_eq!(pc_value(&table, 0x100, 0x107, 1), None);
        // A negative delta: -1 -> -2 ... zigzag(3) = -2.
        assert_eq!(pc_value(&[0x03, 0x10, 0x00], 0, 5, 1), Some(-3));
        // Truncated.
        assert_eq!(pc_value(&[0x04], 0, 0, 1), None);
    }
}
