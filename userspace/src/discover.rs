//! Finding the allocator images processes use, once per image.
//!
//! Every file is parsed at most once per session: the cache remembers, by device and
//! inode, both the images found and the files that turned out to define no allocator
//! (most executables), so rescanning a process costs one read of its maps.

use std::{collections::HashMap, path::Path};

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
    /// The allocator images among `pid`'s mappings (see
    /// [`crate::image::candidate_mappings`]). `prefixes` are `--allocator-symbol`
    /// prefixes, tried before the plain names; with any, every mapped file is a
    /// candidate. Files that cannot be read are skipped and logged (the process may
    /// have exited while we looked).
    pub fn discover(
        &mut self,
        pid: u32,
        maps: &[MapsEntry],
        prefixes: &[String],
    ) -> Vec<AllocatorImage> {
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
        let exe = exe.as_deref().map(|p| {
            Path::new(
                p.to_str()
                    .unwrap_or_default()
                    .trim_end_matches(" (deleted)"),
            )
            .to_path_buf()
        });
        let mut images = Vec::new();
        for entry in crate::image::candidate_mappings(maps, exe.as_deref(), !prefixes.is_empty()) {
            let key = ImageKey {
                device: entry.device,
                inode: entry.inode,
            };
            let readable = entry
                .file_path()
                .is_some_and(|path| crate::procfs::in_root(pid, path).exists());
            if !readable && !self.known.contains_key(&key) {
                // The process is gone (or the file is): not a verdict worth caching.
                continue;
            }
            let known = self
                .known
                .entry(key)
                .or_insert_with(|| resolve_any_prefix(pid, key, entry, prefixes));
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

/// The image with the first prefix (user prefixes first, then none) whose `malloc` the
/// file defines, if any.
fn resolve_any_prefix(
    pid: u32,
    key: ImageKey,
    entry: &MapsEntry,
    prefixes: &[String],
) -> Option<AllocatorImage> {
    let path = entry.file_path()?;
    let mut last_error = None;
    for prefix in prefixes.iter().map(String::as_str).chain([""]) {
        match AllocatorImage::resolve(pid, key, path, prefix) {
            Ok(image) => return Some(image),
            Err(error) => last_error = Some(error),
        }
    }
    if let Some(error) = last_error {
        tracing::debug!("pid {pid}: {error}");
    }
    None
}
