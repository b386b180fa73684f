//! What a language runtime found in the files its processes map (a `libjvm.so`, a
//! `node` binary), examined once per file whichever process maps it: read through the
//! kernel's link to the very file mapped ([`procfs::read_mapped_file`]), parsed, and
//! remembered by device and inode, a bounded number of them.

use std::{collections::HashMap, ffi::OsStr, path::Path};

use crate::procfs::{self, MapsEntry};

/// Files remembered at most; past it the cache starts over.
const MAX_FILES: usize = 64;

/// Files examined, by (device, inode): `None` for a file that is not the runtime's.
pub struct ExaminedFiles<T> {
    files: HashMap<(u64, u64), Option<T>>,
    /// Opens that failed for want of descriptors so far.
    pub descriptor_errors: u64,
}

impl<T> Default for ExaminedFiles<T> {
    fn default() -> Self {
        Self {
            files: HashMap::new(),
            descriptor_errors: 0,
        }
    }
}

impl<T> ExaminedFiles<T> {
    /// The first mapping of `maps` at file offset 0 whose file name `named` accepts,
    /// its path, and what `examine` found in its parsed file (at the file's first
    /// sight); `None` when there is no such mapping or its file is not the runtime's.
    pub fn find<'m>(
        &mut self,
        pid: u32,
        maps: &'m [MapsEntry],
        named: impl Fn(&OsStr) -> bool,
        examine: impl FnOnce(&object::File<'_>) -> Option<T>,
    ) -> Option<(&'m MapsEntry, &'m Path, &T)> {
        let (mapping, path) = maps.iter().find_map(|m| {
            let path = m.file_path()?;
            (m.offset == 0 && named(path.file_name()?)).then_some((m, path))
        })?;
        let key = (mapping.device, mapping.inode);
        if !self.files.contains_key(&key) {
            if self.files.len() >= MAX_FILES {
                self.files.clear();
            }
            let data = procfs::read_mapped_file(pid, mapping, path, &mut self.descriptor_errors);
            let found = data.and_then(|data| examine(&object::File::parse(&*data).ok()?));
            self.files.insert(key, found);
        }
        let found = self.files.get(&key)?.as_ref()?;
        Some((mapping, path, found))
    }
}
