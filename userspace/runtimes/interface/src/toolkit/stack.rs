//! A stack the eBPF program copied at a sample: words read from the copy, never from
//! the process (the copy is what the stack was at the probe; the process has moved on).

/// A copied stack: `bytes` as they were from `base` up.
#[derive(Clone, Copy, Debug)]
pub struct StackCopy<'a> {
    /// The address of `bytes[0]`.
    pub base: u64,
    /// The bytes.
    pub bytes: &'a [u8],
}

impl StackCopy<'_> {
    /// The little-endian word at `address`, if the copy holds all of it.
    pub fn word(&self, address: u64) -> Option<u64> {
        let at = usize::try_from(address.checked_sub(self.base)?).ok()?;
        let bytes = self.bytes.get(at..at.checked_add(8)?)?;
        Some(u64::from_le_bytes(bytes.try_into().ok()?))
    }

    /// True if `address` lies in the copy.
    pub fn holds(&self, address: u64) -> bool {
        address
            .checked_sub(self.base)
            .is_some_and(|at| at < self.bytes.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_read_only_inside_the_copy() {
        let bytes: Vec<u8> = (0..24).collect();
        let copy = StackCopy {
            base: 0x7000,
            bytes: &bytes,
        };
        assert_eq!(
            copy.word(0x7000),
            Some(u64::from_le_bytes([0, 1, 2, 3, 4, 5, 6, 7]))
        );
        assert_eq!(
            copy.word(0x7010),
            Some(u64::from_le_bytes([16, 17, 18, 19, 20, 21, 22, 23]))
        );
        assert_eq!(copy.word(0x7011), None, "its last byte is past the copy");
        assert_eq!(copy.word(0x6ff8), None, "below the copy");
        assert_eq!(copy.word(u64::MAX), None);
        assert!(copy.holds(0x7017) && !copy.holds(0x7018) && !copy.holds(0x6fff));
    }
}
