//! Finding the allocator images processes use, once per image.
//!
//! Every file is parsed at most once per session: the cache remembers, by device and
//! inode, both the images found and the files that turned out to define no allocator
//! (most executables), so rescanning a process costs one read of its maps.

use std::collections::HashMap;

use crate::{
    image::{AllocatorImage, ImageKey},
    procfs::MapsEntry,
};

/// Files already examined, by identity.
#[derive(Debug, Default)]
pub struct ImageCache {
    /// `None`: the file defines no allocation functions under any prefix.
    known: HashMap<ImageKey, Option<AllocatorImage>>,
}

impl ImageCache {
    /// The allocator images among `pid`'s mappings: every executable file it maps that
    /// defines allocation entries ([`crate::allocators`]). `prefixes` are
    /// `--allocator-symbol` prefixes, searched besides the catalogue's. Files that
    /// cannot be read are skipped and logged (the process may have exited while we
    /// looked).
    pub fn discover(
        &mut self,
        pid: u32,
        maps: &[MapsEntry],
        prefixes: &[String],
    ) -> Vec<AllocatorImage> {
        let mut images = Vec::new();
        for entry in crate::image::candidate_mappings(maps) {
            let key = ImageKey {
                device: entry.device,
                inode: entry.inode,
            };
            let Some(path) = entry.file_path() else {
                continue;
            };
            if !self.known.contains_key(&key) && !crate::procfs::in_root(pid, path).exists() {
                // The process is gone (or the file is): not a verdict worth caching.
                continue;
            }
            let known = self.known.entry(key).or_insert_with(|| {
                AllocatorImage::resolve(pid, key, path, prefixes)
                    .map_err(|error| tracing::debug!("pid {pid}: {error}"))
                    .ok()
            });
            if let Some(image) = known {
                images.push(image.clone());
            }
        }
        images
    }

    /// Images resolved so far.
    pub fn images(&self) -> impl Iterator<Item = &AllocatorImage> {
        self.known.values().flatten()
    }
}
