//! HotSpot's compressed integers (`CompressedReadStream`), in which compiled methods
//! keep their scopes and methods their line number tables: a byte under `L` is a whole
//! value, a larger one starts a value of up to five bytes, six more bits each. From
//! JDK 20 the coding (`UNSIGNED5`) excludes the zero byte (`X = 1`, `L = 191`); before,
//! `X = 0`, `L = 192`.

/// Bytes one value takes at most.
pub const MAX_LENGTH: usize = 5;

/// Reads values from a byte slice; a read past its end is `None`.
pub struct CompressedReader<'a> {
    bytes: &'a [u8],
    position: usize,
    excluded: u32,
}

impl<'a> CompressedReader<'a> {
    /// A reader of `bytes` from `position`; `excludes_zero`: the `UNSIGNED5` coding.
    pub fn new(bytes: &'a [u8], position: usize, excludes_zero: bool) -> Self {
        Self {
            bytes,
            position,
            excluded: u32::from(excludes_zero),
        }
    }

    /// The next byte.
    pub fn byte(&mut self) -> Option<u8> {
        let byte = *self.bytes.get(self.position)?;
        self.position += 1;
        Some(byte)
    }

    /// The next unsigned value.
    pub fn uint(&mut self) -> Option<u32> {
        const LG_H: u32 = 6;
        let low = 256 - self.excluded - (1 << LG_H);
        let b0 = u32::from(self.byte()?);
        let mut sum = b0.checked_sub(self.excluded)?;
        if sum < low {
            return Some(sum);
        }
        let mut shift = LG_H;
        for i in 1..MAX_LENGTH {
            let b = u32::from(self.byte()?).checked_sub(self.excluded)?;
            sum = sum.wrapping_add(b.wrapping_shl(shift));
            if b < low || i == MAX_LENGTH - 1 {
                return Some(sum);
            }
            shift += LG_H;
        }
        Some(sum)
    }

    /// The next signed value (zigzag-coded).
    pub fn int(&mut self) -> Option<i32> {
        let value = self.uint()?;
        Some(((value >> 1) as i32) ^ -((value & 1) as i32))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// HotSpot's writer, for both codings.
    fn encode(mut value: u32, excluded: u32) -> Vec<u8> {
        let low = 256 - excluded - 64;
        let mut out = Vec::new();
        for i in 0..MAX_LENGTH {
            if value < low || i == MAX_LENGTH - 1 {
                out.push((value + excluded) as u8);
                return out;
            }
            value -= low;
            out.push((low + (value % 64) + excluded) as u8);
            value >>= 6;
        }
        out
    }

    #[test]
    fn values_read_back_in_both_codings() {
        for excluded in [0, 1] {
            for value in [
                0,
                1,
                190,
                191,
                192,
                193,
                5000,
                70_000,
                1 << 24,
                u32::MAX / 2,
            ] {
                let bytes = encode(value, excluded);
                let mut reader = CompressedReader::new(&bytes, 0, excluded == 1);
                assert_eq!(reader.uint(), Some(value), "{value} X={excluded}");
                assert_eq!(reader.byte(), None);
            }
        }
    }

    #[test]
    fn a_cut_value_is_none_and_zero_is_refused_when_excluded() {
        let bytes = encode(70_000, 1);
        let mut reader = CompressedReader::new(&bytes[..1], 0, true);
        assert_eq!(reader.uint(), None);
        assert_eq!(CompressedReader::new(&[0], 0, true).uint(), None);
        assert_eq!(CompressedReader::new(&[3], 0, false).int(), Some(-2));
    }
}
