//! The kernel's query of one mapping of a process (`PROCMAP_QUERY`, an ioctl on its
//! `/proc/PID/maps`, Linux 6.11+): the mapping as it is now, asked for without the
//! text of the whole table.

use std::{fs::File, io, os::fd::AsRawFd};

/// `_IOWR('f', 17, struct procmap_query)` (`include/uapi/linux/fs.h`).
const PROCMAP_QUERY: libc::c_ulong = 0xC068_6611;

/// `PROCMAP_QUERY_VMA_EXECUTABLE`: only executable mappings.
pub const QUERY_EXECUTABLE: u64 = 0x04;
/// `PROCMAP_QUERY_COVERING_OR_NEXT_VMA`: the mapping at the address or the next one.
pub const QUERY_COVERING_OR_NEXT: u64 = 0x10;
/// `PROCMAP_QUERY_FILE_BACKED_VMA`: only mappings of a file.
pub const QUERY_FILE_BACKED: u64 = 0x20;

/// A process's mappings walked at most: `vm.max_map_count`'s default (a process may
/// raise it; the walk then stops short and says so).
pub const MAX_MAPPINGS_WALKED: usize = 65_536;

/// `struct procmap_query`, as Linux 6.11 defines it (104 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcmapQuery {
    /// The struct's size (in).
    pub size: u64,
    /// `QUERY_*` flags (in).
    pub query_flags: u64,
    /// The address asked about (in).
    pub query_addr: u64,
    /// The mapping's first address (out).
    pub vma_start: u64,
    /// The mapping's end (out).
    pub vma_end: u64,
    /// Its protection flags (out).
    pub vma_flags: u64,
    /// Its page size (out).
    pub vma_page_size: u64,
    /// Its offset in its file (out).
    pub vma_offset: u64,
    /// Its file's inode (out; 0 for anonymous memory).
    pub inode: u64,
    /// Its file's device, major (out).
    pub dev_major: u32,
    /// Its file's device, minor (out).
    pub dev_minor: u32,
    /// Size of the name buffer (in; 0: no name asked for).
    pub vma_name_size: u32,
    /// Size of the build id buffer (in; 0: none asked for).
    pub build_id_size: u32,
    /// Where to write the name (in).
    pub vma_name_addr: u64,
    /// Where to write the build id (in).
    pub build_id_addr: u64,
}

impl ProcmapQuery {
    /// Its file's device in [`super::MapsEntry::device`]'s encoding.
    pub fn device(&self) -> u64 {
        (u64::from(self.dev_major) << 32) | u64::from(self.dev_minor)
    }
}

/// The mapping of the process whose maps `maps` is that `flags` select at `address`
/// (`ENOENT`: none). Names and build ids are not asked for.
pub fn query(maps: &File, address: u64, flags: u64) -> io::Result<ProcmapQuery> {
    let mut query = ProcmapQuery {
        size: std::mem::size_of::<ProcmapQuery>() as u64,
        query_flags: flags,
        query_addr: address,
        ..ProcmapQuery::default()
    };
    // SAFETY: PROCMAP_QUERY reads and writes a `struct procmap_query` of the size given
    // in it; names and build ids are not asked for (their sizes are 0).
    let result = unsafe { libc::ioctl(maps.as_raw_fd(), PROCMAP_QUERY, &mut query) };
    if result < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(query)
}

/// The `(device, inode)` of every file `pid` maps executable now, in address order
/// (a file once per mapping), without reading the text of its maps: a few ioctls where
/// the text costs a line per mapping. An error if the kernel has no query, the process
/// is gone, or it has more than [`MAX_MAPPINGS_WALKED`] such mappings.
pub fn executable_files(pid: u32) -> io::Result<Vec<(u64, u64)>> {
    let maps = File::open(format!("/proc/{pid}/maps"))?;
    let flags = QUERY_COVERING_OR_NEXT | QUERY_EXECUTABLE | QUERY_FILE_BACKED;
    let mut files = Vec::new();
    let mut address = 0u64;
    while files.len() < MAX_MAPPINGS_WALKED {
        match query(&maps, address, flags) {
            Ok(mapping) => {
                files.push((mapping.device(), mapping.inode));
                // A mapping ends above its start; one that does not ends the walk.
                if mapping.vma_end <= address {
                    return Ok(files);
                }
                address = mapping.vma_end;
            }
            Err(error) if error.raw_os_error() == Some(libc::ENOENT) => return Ok(files),
            Err(error) => return Err(error),
        }
    }
    Err(io::Error::other(format!(
        "more than {MAX_MAPPINGS_WALKED} executable file mappings"
    )))
}

/// True if one of `addresses` lies in a mapping of an executable file of `pid` now: an
/// ioctl an address, not the text of its maps. An error if the kernel has no query or
/// the process is gone.
pub fn any_in_executable_file(pid: u32, addresses: &[u64]) -> io::Result<bool> {
    let maps = File::open(format!("/proc/{pid}/maps"))?;
    for &address in addresses {
        match query(&maps, address, QUERY_EXECUTABLE | QUERY_FILE_BACKED) {
            Ok(_) => return Ok(true),
            Err(error) if error.raw_os_error() == Some(libc::ENOENT) => {}
            Err(error) => return Err(error),
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_executable_files_are_those_our_maps_list() {
        let listed: Vec<(u64, u64)> = super::super::read_maps(std::process::id())
            .iter()
            .filter(|entry| entry.executable && entry.inode != 0)
            .map(|entry| (entry.device, entry.inode))
            .collect();
        let queried = match executable_files(std::process::id()) {
            Ok(files) => files,
            // A kernel before 6.11 has no query: nothing to compare.
            Err(error) if matches!(error.raw_os_error(), Some(libc::ENOTTY | libc::EINVAL)) => {
                return
            }
            Err(error) => panic!("{error}"),
        };
        assert!(!queried.is_empty());
        assert_eq!(queried, listed);
    }

    #[test]
    fn our_code_is_in_an_executable_file_and_our_heap_is_not() {
        let code = our_code_is_in_an_executable_file_and_our_heap_is_not as fn() as usize as u64;
        let heap = Box::new(0u64);
        let heap = &*heap as *const u64 as u64;
        match any_in_executable_file(std::process::id(), &[heap, code]) {
            Ok(found) => assert!(found),
            Err(error) if matches!(error.raw_os_error(), Some(libc::ENOTTY | libc::EINVAL)) => {
                return
            }
            Err(error) => panic!("{error}"),
        }
        assert!(!any_in_executable_file(std::process::id(), &[heap, 0, u64::MAX]).unwrap());
    }

    #[test]
    fn a_process_gone_is_an_error() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(executable_files(pid).is_err());
    }
}
