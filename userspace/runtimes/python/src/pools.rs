//! Where a process's pymalloc keeps its used pools (`usedpools`): what `--live` reads,
//! at an inlined small-object site, to know the block the site is about to be handed.
//!
//! The file says where the array is (`allocbpf_images::image::inlined::usedpools`): at
//! an address of the file, or behind the interpreter's allocator-state pointer (3.13).
//! The process's memory must then look like it: each size class's pair of pointers is
//! either its empty list's head (the pair's own address less the pool header's two
//! leading words) twice, or two pool-aligned pools. Anything else is not believed, and
//! the inlined sites' samples are then not tracked.

use allocbpf_images::image::inlined::Usedpools;
use allocbpf_runtime::toolkit::RemoteMemory;

/// pymalloc's small size classes on 64-bit builds (512 bytes in steps of 16).
const SIZE_CLASSES: usize = 32;

/// Bytes of `usedpools` read and checked (a pair of pointers per size class).
const USEDPOOLS_BYTES: usize = SIZE_CLASSES * 16;

/// The smallest pool alignment (4 KiB pools; 16 KiB from 3.10).
const POOL_ALIGNMENT: u64 = 4096;

/// The address of `usedpools` in the process whose memory is `memory`, for a file
/// loaded at `bias` whose main interpreter is at `interpreter`; 0 when the file has
/// none or the process's memory does not hold one there.
pub fn usedpools_address(
    memory: &dyn RemoteMemory,
    table: Option<Usedpools>,
    bias: u64,
    interpreter: u64,
) -> u64 {
    let address = match table {
        None => return 0,
        Some(Usedpools::At(address)) => bias.wrapping_add(address),
        Some(Usedpools::InState { state, usedpools }) => {
            match memory.u64(interpreter.wrapping_add(state)) {
                Ok(state) if state != 0 => state.wrapping_add(usedpools),
                _ => return 0,
            }
        }
    };
    let mut bytes = [0u8; USEDPOOLS_BYTES];
    match memory.read(address, &mut bytes) {
        Ok(()) if looks_like_usedpools(address, &bytes) => address,
        _ => 0,
    }
}

/// True if `bytes`, read at `address`, hold a pair of list pointers per size class:
/// the empty list's head twice, or two pool-aligned pools.
fn looks_like_usedpools(address: u64, bytes: &[u8; USEDPOOLS_BYTES]) -> bool {
    bytes.chunks_exact(16).enumerate().all(|(class, pair)| {
        let word = |i: usize| u64::from_le_bytes(pair[i..i + 8].try_into().unwrap_or_default());
        let (first, last) = (word(0), word(8));
        let head = address.wrapping_add(16 * class as u64).wrapping_sub(16);
        let pool = |p: u64| p != 0 && p != head && p.is_multiple_of(POOL_ALIGNMENT);
        (first == head && last == head) || (pool(first) && pool(last))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `usedpools` at `address` with every class empty except `used` (pool 0x7f0000004000).
    fn table(address: u64, used: &[usize]) -> [u8; USEDPOOLS_BYTES] {
        let mut bytes = [0u8; USEDPOOLS_BYTES];
        for (class, pair) in bytes.chunks_exact_mut(16).enumerate() {
            let value = match used.contains(&class) {
                true => 0x7f00_0000_4000,
                false => address + 16 * class as u64 - 16,
            };
            pair[..8].copy_from_slice(&value.to_le_bytes());
            pair[8..].copy_from_slice(&value.to_le_bytes());
        }
        bytes
    }

    #[test]
    fn usedpools_are_found_in_forged_memory_where_the_file_says() {
        use allocbpf_runtime::toolkit::FakeMemory;

        const BIAS: u64 = 0x5500_0000_0000;
        const INTERPRETER: u64 = 0x60_0000;
        const STATE: u64 = 0x70_0000;
        let (at, in_state) = (0x959d20, 0x20);
        let mut memory = FakeMemory::new();
        memory
            .map(BIAS + at, table(BIAS + at, &[3]).to_vec())
            .map(INTERPRETER, vec![0u8; 64])
            .write_u64(INTERPRETER + 8, STATE)
            .map(STATE + in_state, table(STATE + in_state, &[]).to_vec());
        let state = |state| Usedpools::InState {
            state,
            usedpools: in_state,
        };
        let address = |table| usedpools_address(&memory, table, BIAS, INTERPRETER);
        assert_eq!(address(Some(Usedpools::At(at))), BIAS + at);
        assert_eq!(address(Some(state(8))), STATE + in_state);
        assert_eq!(address(None), 0);
        // A null state, a state pointer to nothing mapped, a table elsewhere.
        assert_eq!(address(Some(state(16))), 0);
        assert_eq!(address(Some(state(u64::MAX))), 0);
        assert_eq!(address(Some(Usedpools::At(at + 16))), 0);
    }

    #[test]
    fn empty_and_used_lists_are_believed() {
        assert!(looks_like_usedpools(0x959d20, &table(0x959d20, &[])));
        assert!(looks_like_usedpools(
            0x959d20,
            &table(0x959d20, &[0, 2, 31])
        ));
    }

    #[test]
    fn anything_else_is_not() {
        // Read elsewhere than the heads say.
        assert!(!looks_like_usedpools(0x959d30, &table(0x959d20, &[])));
        // A misaligned pool, a null one, one list empty at one end only.
        let mut bytes = table(0x959d20, &[1]);
        bytes[16..24].copy_from_slice(&0x7f00_0000_4010u64.to_le_bytes());
        assert!(!looks_like_usedpools(0x959d20, &bytes));
        let mut bytes = table(0x959d20, &[1]);
        bytes[16..24].copy_from_slice(&0u64.to_le_bytes());
        assert!(!looks_like_usedpools(0x959d20, &bytes));
        let mut bytes = table(0x959d20, &[]);
        bytes[16..24].copy_from_slice(&0x7f00_0000_4000u64.to_le_bytes());
        assert!(!looks_like_usedpools(0x959d20, &bytes));
        assert!(!looks_like_usedpools(0, &[0u8; USEDPOOLS_BYTES]));
    }
}
