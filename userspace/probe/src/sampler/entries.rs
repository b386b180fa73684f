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
        let data = pid_map(self.ebpf.map(map)).ok_or_else(|| load_error(missing(map)))?;
        let expected = data.info().map_err(super::map_error(map))?.value_size() as usize;
        if value.len() != expected {
            return Err(ProbeError::System {
                map,
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!(
                        "an entry of {} bytes, where the map holds {expected}",
                        value.len()
                    ),
                ),
            });
        }
        element_call(data.fd().as_fd(), BPF_MAP_UPDATE_ELEM, pid, Some(value))
            .map_err(|source| ProbeError::System { map, source })?;
        self.runtime_maps.insert(map);
        Ok(())
    }

    /// Removes `pid`'s entry of the per-process hash map `map`, if any.
    pub fn forget_entry(&mut self, map: &str, pid: u32) {
        if let Some(data) = pid_map(self.ebpf.map(map)) {
            let _ = element_call(data.fd().as_fd(), BPF_MAP_DELETE_ELEM, pid, None);
        }
    }

    /// Removes `pid`'s entry of every runtime map written so far.
    pub(super) fn forget_entries(&mut self, pid: u32) {
        let maps: Vec<&'static str> = self.runtime_maps.iter().copied().collect();
        for map in maps {
            self.forget_entry(map, pid);
        }
    }
}

/// `map` when it is a pid-keyed hash map.
fn pid_map(map: Option<&Map>) -> Option<&MapData> {
    match map? {
        Map::HashMap(data) | Map::LruHashMap(data) => {
            let key_size = data.info().ok()?.key_size() as usize;
            (key_size == std::mem::size_of::<u32>()).then_some(data)
        }
        _ => None,
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
