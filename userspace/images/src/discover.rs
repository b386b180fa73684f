//! Finding the allocator images processes use, once per image.
//!
//! Every file is parsed at most once per session: the cache remembers, by device and
//! inode, both the images found and the files that turned out to define no allocator
//! (most executables), so rescanning a process costs one read of its maps.

use std::collections::{hash_map::Entry, HashMap, HashSet};

use crate::image::{examine, AllocatorImage, FileFacts, ImageKey, Lookup};
use crate::procfs::MapsEntry;

/// Files already examined, by identity.
#[derive(Clone, Debug, Default)]
pub struct ImageCache {
    /// `None`: the file could not be read.
    known: HashMap<ImageKey, Option<FileFacts>>,
    /// Files refused unread for a hostile layout ([`crate::elf_ranges::Refusal`]), kept
    /// past [`ImageCache::retain`] so that each is counted and logged once.
    refused: HashSet<ImageKey>,
    /// Distinct files refused so far (the collector's `files_refused`).
    refused_total: u64,
    /// Opens that failed for want of descriptors so far.
    descriptor_errors: u64,
}

/// Refused files remembered at most (keys only); past it the set starts over, and a
/// file refused again is counted and logged again.
const MAX_REFUSED_KEPT: usize = 4096;

/// Why a process made no call to a probed entry, as far as its files tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Silence {
    /// A Go program: its heap is the Go runtime's own.
    GoRuntime,
    /// No file it maps imports an allocation entry: it allocates another way.
    NoAllocationImports,
    /// It calls probed entries, just not while it was profiled.
    NotYet,
}

impl std::fmt::Display for Silence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Silence::GoRuntime => {
                "no probed call: this is a Go program, whose heap is the Go runtime's own \
                 (read from its heap profile, not probed); only its C allocations (cgo) \
                 are probed"
            }
            Silence::NoAllocationImports => {
                "no probed call: none of the files this process maps calls an allocation \
                 entry allocbpf knows, so it allocates another way (its own allocator or \
                 runtime; see --allocator-symbol)"
            }
            Silence::NotYet => {
                "no probed call while profiled: the process links an allocator allocbpf \
                 probes but did not allocate in this window (it may allocate later)"
            }
        })
    }
}

impl ImageCache {
    /// The allocator images among `pid`'s mappings: every executable file it maps that
    /// defines allocation entries ([`crate::allocators`]), found as `lookup` says. Files that
    /// cannot be read are skipped and logged (the process may have exited while we
    /// looked); a file refused for a hostile layout is counted ([`ImageCache::refused`])
    /// and logged as a warning once, and the process's other files are examined as
    /// usual.
    pub fn discover(
        &mut self,
        pid: u32,
        maps: &[MapsEntry],
        lookup: &Lookup,
    ) -> Vec<AllocatorImage> {
        let mut images = Vec::new();
        for entry in crate::image::candidate_mappings(maps) {
            let key = ImageKey::of(entry);
            if let Entry::Vacant(slot) = self.known.entry(key) {
                let facts = match examine(pid, entry, lookup) {
                    Ok(facts) => Some(facts),
                    Err(error) if error.out_of_descriptors => {
                        self.descriptor_errors += 1;
                        tracing::debug!("pid {pid}: {error}");
                        continue;
                    }
                    // The process (or its mapping) is gone: no verdict worth caching.
                    Err(error) if error.gone => continue,
                    Err(error) if error.refusal.is_some() => {
                        if self.refused.len() >= MAX_REFUSED_KEPT {
                            self.refused.clear();
                        }
                        if self.refused.insert(key) {
                            self.refused_total += 1;
                            tracing::warn!("pid {pid}: {error} ({key})");
                        }
                        None
                    }
                    Err(error) => {
                        tracing::debug!("pid {pid}: {error}");
                        None
                    }
                };
                slot.insert(facts);
            }
            if let Some(image) = self.known[&key].as_ref().and_then(|f| f.image.as_ref()) {
                images.push(image.clone());
            }
        }
        images
    }

    /// Files refused unread for a hostile layout so far, each counted once.
    pub fn refused(&self) -> u64 {
        self.refused_total
    }

    /// Keeps the facts (and open files) of the files `keep` accepts only.
    pub fn retain(&mut self, mut keep: impl FnMut(&ImageKey) -> bool) {
        self.known.retain(|key, _| keep(key));
    }

    /// Images resolved so far.
    pub fn images(&self) -> impl Iterator<Item = &AllocatorImage> {
        self.known
            .values()
            .flatten()
            .filter_map(|facts| facts.image.as_ref())
    }

    /// Opens of mapped files that failed for want of descriptors so far.
    pub fn descriptor_errors(&self) -> u64 {
        self.descriptor_errors
    }

    /// The mappings of Go executables (already discovered) among `maps`.
    pub fn go_mappings<'m>(&self, maps: &'m [MapsEntry]) -> Vec<&'m MapsEntry> {
        crate::image::candidate_mappings(maps)
            .into_iter()
            .filter(|entry| {
                self.known
                    .get(&ImageKey::of(entry))
                    .is_some_and(|facts| facts.as_ref().is_some_and(|f| f.go_runtime))
            })
            .collect()
    }

    /// Why a process with these (already discovered) mappings would make no probed
    /// call.
    pub fn silence(&self, maps: &[MapsEntry]) -> Silence {
        let facts: Vec<&FileFacts> = crate::image::candidate_mappings(maps)
            .iter()
            .filter_map(|entry| self.known.get(&ImageKey::of(entry))?.as_ref())
            .collect();
        if facts.iter().any(|f| f.go_runtime) {
            Silence::GoRuntime
        } else if facts.iter().any(|f| f.imports_allocation) {
            Silence::NotYet
        } else {
            Silence::NoAllocationImports
        }
    }
}
