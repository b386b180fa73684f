//! The runtimes' per-process map entries, written as the bytes a runtime hands over:
//! a pid-keyed hash map named by the runtime, whose value layout only it and its eBPF
//! part know. aya's typed maps need the value type at compile time, so these go
//! through the `bpf` system call with the map's descriptor, the value's size checked
//! against the map's own.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use aya::maps::{Map, MapData};

use super::{load_error, missing, ProbeError, Sampler};

/// `BPF_MAP_UPDATE_ELEM` and `BPF_MAP_DELETE_ELEM` (uapi `enum bpf_cmd`).
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;

/// The map-element part of uapi `union bpf_attr`.
#[repr(C)]
struct ElementAttr {
    map_fd: u32,
    pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

impl Sampler {
    /// Writes `pid`'s entry of the per-process hash map `map`: `value` must be exactly
    /// the map's value size. The map is remembered, so that a process's exit clears
    /// its entry there too ([`Sampler::forget_processes`]).
    pub fn set_entry(
        &mut self,
        map: &'static str,
        pid: u32,
        value: &[u8],
    ) -> Result<(), ProbeError> {
        let value_size = self.entry_map_value_size(map)?;
        if value.len() != value_size {
            return Err(invalid(
                map,
                format!(
                    "an entry of {} bytes, where the map holds {value_size}",
                    value.len()
                ),
            ));
        }
        let data = self
            .ebpf
            .map(map)
            .and_then(hash_map_data)
            .ok_or_else(|| load_error(missing(map)))?;
        element_call(data.fd().as_fd(), BPF_MAP_UPDATE_ELEM, pid, Some(value))
            .map_err(|source| ProbeError::System { map, source })
    }

    /// Removes `pid`'s entry of the per-process hash map `map`, if any (a map never
    /// written this session has none).
    pub fn forget_entry(&mut self, map: &str, pid: u32) {
        if !self.runtime_maps.contains_key(map) {
            return;
        }
        if let Some(data) = self.ebpf.map(map).and_then(hash_map_data) {
            let _ = element_call(data.fd().as_fd(), BPF_MAP_DELETE_ELEM, pid, None);
        }
    }

    /// Removes `pid`'s entry of every runtime map written so far.
    pub(super) fn forget_entries(&mut self, pid: u32) {
        let maps: Vec<&'static str> = self.runtime_maps.keys().copied().collect();
        for map in maps {
            self.forget_entry(map, pid);
        }
    }

    /// The value size of `map`, a pid-keyed hash map, read from the kernel once per
    /// session; the map is remembered as a runtime's.
    fn entry_map_value_size(&mut self, map: &'static str) -> Result<usize, ProbeError> {
        if let Some(&size) = self.runtime_maps.get(map) {
            return Ok(size);
        }
        let data = self
            .ebpf
            .map(map)
            .and_then(hash_map_data)
            .ok_or_else(|| load_error(missing(map)))?;
        let info = data.info().map_err(super::map_error(map))?;
        if info.key_size() as usize != std::mem::size_of::<u32>() {
            return Err(invalid(
                map,
                format!("keys of {} bytes, not a pid", info.key_size()),
            ));
        }
        let size = info.value_size() as usize;
        self.runtime_maps.insert(map, size);
        Ok(size)
    }
}

/// The data of `map` when it is a (non-per-CPU) hash map.
fn hash_map_data(map: &Map) -> Option<&MapData> {
    match map {
        Map::HashMap(data) | Map::LruHashMap(data) => Some(data),
        _ => None,
    }
}

/// A runtime's entry that does not fit its map.
fn invalid(map: &'static str, what: String) -> ProbeError {
    ProbeError::System {
        map,
        source: std::io::Error::new(std::io::ErrorKind::InvalidInput, what),
    }
}

/// One element call on `fd` for key `pid`: an update with `value`, or a delete.
fn element_call(
    fd: BorrowedFd<'_>,
    command: libc::c_long,
    pid: u32,
    value: Option<&[u8]>,
) -> std::io::Result<()> {
    let attr = ElementAttr {
        map_fd: fd.as_raw_fd() as u32,
        pad: 0,
        key: &pid as *const u32 as u64,
        value: value.map_or(0, |value| value.as_ptr() as u64),
        // BPF_ANY: create or replace.
        flags: 0,
    };
    // SAFETY: `attr` is a valid bpf_attr prefix for these commands; the key and value
    // it points at live across the call, and the value's length was checked against
    // the map's value size (the kernel reads exactly that many bytes).
    let result = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            command,
            &attr as *const ElementAttr,
            std::mem::size_of::<ElementAttr>() as libc::c_uint,
        )
    };
    if result < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
