//! A process's memory map (`/proc/PID/maps`) and its mapped files, as the process
//! sees them.
//!
//! One parser for the maps, and one way to open a mapped file: through
//! `/proc/PID/map_files/START-END` (the very file mapped, even if deleted or replaced),
//! else through `/proc/PID/root/` (the process's own mount namespace: containers).

use std::{
    fs::File,
    ops::Range,
    path::{Path, PathBuf},
};

/// One line of `/proc/PID/maps`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapsEntry {
    /// Address range.
    pub range: Range<u64>,
    /// Executable (`x` in the permissions).
    pub executable: bool,
    /// File offset of the range's start.
    pub offset: u64,
    /// Device of the mapped file (major << 32 | minor); 0 for anonymous mappings.
    pub device: u64,
    /// Inode of the mapped file; 0 for anonymous mappings.
    pub inode: u64,
    /// The path field as printed (may end in " (deleted)"; `[heap]` etc. for anonymous
    /// mappings; empty when there is none).
    pub name: String,
}

impl MapsEntry {
    /// The mapped file's path, if the mapping is file-backed (" (deleted)" removed).
    pub fn file_path(&self) -> Option<&Path> {
        self.name
            .starts_with('/')
            .then(|| Path::new(self.name.trim_end_matches(" (deleted)")))
    }
}

/// Parses the text of `/proc/PID/maps`; malformed lines are skipped.
pub fn parse_maps(text: &str) -> Vec<MapsEntry> {
    text.lines()
        .filter_map(|line| {
            // range perms offset dev inode [name, which may contain spaces]
            let mut fields = line.splitn(6, char::is_whitespace);
            let (start, end) = fields.next()?.split_once('-')?;
            let perms = fields.next()?;
            let offset = u64::from_str_radix(fields.next()?, 16).ok()?;
            let (major, minor) = fields.next()?.split_once(':')?;
            let device =
                u64::from_str_radix(major, 16).ok()? << 32 | u64::from_str_radix(minor, 16).ok()?;
            let inode = fields.next()?.parse().ok()?;
            Some(MapsEntry {
                range: u64::from_str_radix(start, 16).ok()?..u64::from_str_radix(end, 16).ok()?,
                executable: perms.contains('x'),
                offset,
                device,
                inode,
                name: fields.next().unwrap_or("").trim().to_string(),
            })
        })
        .collect()
}

/// `pid`'s memory map; empty if it cannot be read (the process exited).
pub fn read_maps(pid: u32) -> Vec<MapsEntry> {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .map(|text| parse_maps(&text))
        .unwrap_or_default()
}

/// `path` as `pid` sees it: under `/proc/PID/root`.
pub fn in_root(pid: u32, path: &Path) -> PathBuf {
    Path::new(&format!("/proc/{pid}/root")).join(path.strip_prefix("/").unwrap_or(path))
}

/// Opens the file of mapping `entry` of `pid`: through map_files, else the root.
pub fn open_mapped(pid: u32, entry: &MapsEntry) -> Option<File> {
    let map_files = format!(
        "/proc/{pid}/map_files/{:x}-{:x}",
        entry.range.start, entry.range.end
    );
    File::open(map_files)
        .ok()
        .or_else(|| File::open(in_root(pid, entry.file_path()?)).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_parse_with_spaces_and_deleted_files() {
        let maps = "\
55d0c0000000-55d0c0001000 r--p 00000000 fe:01 123 /usr/bin/sleep
7f0000028000-7f000019d000 r-xp 00028000 fe:01 456 /opt/my app/lib.so (deleted)
7f00001f0000-7f00001f1000 rw-p 00000000 00:00 0 [heap]
7f00001f1000-7f00001f2000 rw-p 00000000 00:00 0
garbage
";
        let entries = parse_maps(maps);
        assert_eq!(entries.len(), 4);
        assert!(!entries[0].executable);
        assert_eq!(entries[1].range, 0x7f0000028000..0x7f000019d000);
        assert_eq!(entries[1].offset, 0x28000);
        assert_eq!(entries[1].device, 0xfe << 32 | 1);
        assert_eq!(entries[1].inode, 456);
        assert!(entries[1].executable);
        assert_eq!(
            entries[1].file_path(),
            Some(Path::new("/opt/my app/lib.so"))
        );
        assert_eq!(entries[2].file_path(), None);
        assert_eq!(entries[3].name, "");
        assert_eq!(
            in_root(7, Path::new("/usr/lib/libc.so.6")),
            Path::new("/proc/7/root/usr/lib/libc.so.6")
        );
    }
}
