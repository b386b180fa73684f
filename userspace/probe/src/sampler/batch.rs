//! Batched map operations (`BPF_MAP_*_BATCH`, Linux 5.6+), which aya does not offer:
//! one system call for many entries where aya's iteration makes two per entry.

use std::os::fd::{AsFd, AsRawFd};

use aya::{maps::MapData, Pod};

use super::bpf_syscall::bpf;

/// `BPF_MAP_LOOKUP_BATCH` in `enum bpf_cmd`.
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
/// `BPF_MAP_UPDATE_BATCH` in `enum bpf_cmd`.
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Writes `values` to entries `0..values.len()` of the array `map` with one
/// `BPF_MAP_UPDATE_BATCH`.
pub(super) fn update_array(map: &MapData, values: &[u64]) -> std::io::Result<()> {
    let keys: Vec<u32> = (0..values.len() as u32).collect();
    let mut attr = BatchAttr {
        keys: keys.as_ptr() as u64,
        values: values.as_ptr() as u64,
        count: values.len() as u32,
        map_fd: map.fd().as_fd().as_raw_fd() as u32,
        ..BatchAttr::default()
    };
    // SAFETY: `keys` and `values` hold `count` entries of the array's key (u32) and
    // value (u64) sizes.
    unsafe { bpf(BPF_MAP_UPDATE_BATCH, &mut attr)? };
    if attr.count as usize != values.len() {
        return Err(std::io::Error::other(format!(
            "{} of {} entries written",
            attr.count,
            values.len()
        )));
    }
    Ok(())
}

/// Entries read per call at first; more if one hash bucket holds more.
const LOOKUP_CHUNK: usize = 256;

/// Every entry of the per-CPU hash map `map` (keys `K`, values `V`, `cpus` possible
/// CPUs), in a few `BPF_MAP_LOOKUP_BATCH` calls. Entries added or removed meanwhile may
/// be missed or seen, as with iteration.
pub(super) fn lookup_per_cpu_hash<K: Pod + Default, V: Pod + Default>(
    map: &MapData,
    cpus: usize,
) -> std::io::Result<Vec<(K, Vec<V>)>> {
    // The kernel lays per-CPU values out at 8-byte strides.
    assert!(
        std::mem::size_of::<V>().is_multiple_of(8),
        "a per-CPU value padded by the kernel"
    );
    let mut entries = Vec::new();
    let mut capacity = LOOKUP_CHUNK;
    let mut keys = vec![K::default(); capacity];
    let mut values = vec![V::default(); capacity * cpus];
    // The hash map's cursor, none before the first call: a bucket index (u32); 8 bytes
    // leave room to spare.
    let (mut cursor, mut next) = (None::<u64>, 0u64);
    // Each call but the last moves the cursor a bucket or more; the map has at most
    // `u32::MAX` buckets, and a call more than this would be a kernel's bug.
    for _ in 0..1 << 20 {
        let mut attr = BatchAttr {
            in_batch: cursor.as_ref().map_or(0, |c| c as *const u64 as u64),
            out_batch: &mut next as *mut u64 as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: capacity as u32,
            map_fd: map.fd().as_fd().as_raw_fd() as u32,
            ..BatchAttr::default()
        };
        // SAFETY: `keys` holds `capacity` keys and `values` `capacity` per-CPU values
        // of `cpus` entries of `V` each; the cursors hold a bucket index.
        let result = unsafe { bpf(BPF_MAP_LOOKUP_BATCH, &mut attr) };
        let done = match result {
            Ok(_) => false,
            Err(error) if error.raw_os_error() == Some(libc::ENOENT) => true,
            // One bucket holds more entries than fit: again, larger.
            Err(error) if error.raw_os_error() == Some(libc::ENOSPC) && capacity < 1 << 16 => {
                capacity *= 4;
                keys.resize(capacity, K::default());
                values.resize(capacity * cpus, V::default());
                continue;
            }
            Err(error) => return Err(error),
        };
        let count = (attr.count as usize).min(capacity);
        for (index, key) in keys.iter().take(count).enumerate() {
            entries.push((*key, values[index * cpus..(index + 1) * cpus].to_vec()));
        }
        if done {
            return Ok(entries);
        }
        cursor = Some(next);
    }
    Err(std::io::Error::other("a batched lookup that never ended"))
}
