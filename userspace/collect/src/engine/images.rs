//! The image set: every allocator image the engine found, its probes while attached,
//! and the facts cached about executable files (`ImageCache`).

use std::{collections::HashMap, time::Instant};

use allocbpf_probe::{
    discover::ImageCache,
    image::{AllocatorImage, ImageKey, Lookup},
    procfs::MapsEntry,
    sampler::{ImageLinks, Sampler},
};

use super::CollectorStats;
use crate::error::error_chain;

/// One allocator image.
pub(crate) struct ImageState {
    /// What was found in it.
    pub image: AllocatorImage,
    /// Its probes; `None` while detached by the budget (or after a failed attach).
    pub links: Option<ImageLinks>,
    /// When a budget detachment ends.
    pub detached_until: Option<Instant>,
}

/// Allocator images by file identity, attached once each for every process.
#[derive(Default)]
pub(crate) struct ImageSet {
    /// Known images.
    pub images: HashMap<ImageKey, ImageState>,
    /// Facts about executable files examined (allocator or not).
    pub cache: ImageCache,
}

impl ImageSet {
    /// Attaches the images `pid` maps (`maps`) that are not attached yet; returns the
    /// allocator images it maps and every executable file it maps.
    pub fn attach_images_of(
        &mut self,
        sampler: &mut Sampler,
        stats: &mut CollectorStats,
        pid: u32,
        maps: &[MapsEntry],
        lookup: &Lookup,
    ) -> (Vec<ImageKey>, Vec<ImageKey>) {
        let found = self.cache.discover(pid, maps, lookup);
        let keys: Vec<ImageKey> = found.iter().map(|i| i.key).collect();
        let mapped: Vec<ImageKey> = allocbpf_probe::image::candidate_mappings(maps)
            .into_iter()
            .map(ImageKey::of)
            .collect();
        for image in found {
            if self.images.contains_key(&image.key) {
                continue;
            }
            let links = match sampler.attach(&image) {
                Ok(attached) => {
                    stats.images_attached += 1;
                    image.log_probe_points();
                    tracing::info!(
                        "attached {} probes to {} ({}) for pid {pid}",
                        attached.links.len(),
                        image.path_in_target.display(),
                        image.key
                    );
                    Some(attached.links)
                }
                Err(error) => {
                    stats.attach_failures += 1;
                    tracing::warn!(
                        "cannot attach to {} ({}): {}",
                        image.path_in_target.display(),
                        image.key,
                        error_chain(&error)
                    );
                    None
                }
            };
            self.insert(image, links);
        }
        (keys, mapped)
    }

    /// Records `image`, with its probes if attached.
    pub fn insert(&mut self, image: AllocatorImage, links: Option<ImageLinks>) {
        self.images.insert(
            image.key,
            ImageState {
                image,
                links,
                detached_until: None,
            },
        );
    }

    /// Detaches `key`'s probes until `until` (a budget back-off).
    pub fn detach_until(
        &mut self,
        sampler: &mut Sampler,
        stats: &mut CollectorStats,
        key: &ImageKey,
        until: Instant,
    ) {
        let links = self.images.get_mut(key).and_then(|state| {
            state.detached_until = Some(until);
            state.links.take()
        });
        if let Some(links) = links {
            sampler.detach(links);
            stats.images_attached -= 1;
        }
    }

    /// Re-attaches the images whose budget detachment has ended.
    pub fn reattach_due(
        &mut self,
        sampler: &mut Sampler,
        stats: &mut CollectorStats,
        now: Instant,
    ) {
        for state in self.images.values_mut() {
            if state.links.is_some() || state.detached_until.is_none_or(|t| t > now) {
                continue;
            }
            state.detached_until = None;
            match sampler.attach(&state.image) {
                Ok(attached) => {
                    state.links = Some(attached.links);
                    stats.images_attached += 1;
                    tracing::info!("re-attached {}", state.image.path_in_target.display());
                }
                Err(error) => {
                    stats.attach_failures += 1;
                    tracing::warn!(
                        "cannot re-attach {}: {error}",
                        state.image.path_in_target.display()
                    );
                }
            }
        }
    }

    /// Takes every image's probes (to detach them at stop).
    pub fn take_links(&mut self) -> Vec<ImageLinks> {
        self.images
            .values_mut()
            .filter_map(|state| state.links.take())
            .collect()
    }
}
