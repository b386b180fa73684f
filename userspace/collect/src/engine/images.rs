//! The image set: every allocator image the engine found, its probes while attached,
//! and the facts cached about executable files (`ImageCache`).

use std::{
    collections::{HashMap, VecDeque},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
};

use allocbpf_images::{
    discover::ImageCache,
    image::{AllocatorImage, ImageKey, Lookup},
    procfs::MapsEntry,
};
use allocbpf_probe::sampler::monotonic_now_ns;

use super::CollectorStats;
use crate::{
    error::error_chain,
    kernel::{Attach, Kernel, LinkSet},
};

/// One allocator image.
pub(crate) struct ImageState {
    /// What was found in it.
    pub image: AllocatorImage,
    /// Its probes; `None` outside its observation windows (or after a failed attach).
    pub links: Option<LinkSet>,
    /// Its first attach failed: never probed, so not part of any process's
    /// observation (windows do not try it again; a later window's failed attach only
    /// loses that window).
    pub failed: bool,
    /// CLOCK_MONOTONIC ns its probes were all in, while they are.
    attached_since_ns: Option<u64>,
    /// Probed time before that, ns (the budget's exposure).
    attached_ns: u64,
    /// Recent `[in, out)` spans of its probes (CLOCK_MONOTONIC ns), newest last.
    spans: VecDeque<(u64, u64)>,
    /// Its links closing on other threads (their breakpoints may still trap).
    closing: Arc<AtomicUsize>,
    /// The window shift its probes were attached with (`budget::windows::window_shift`).
    pub window_shift: u8,
}

/// Probe spans kept per image: samples are read within milliseconds, and a window per
/// second leaves a span per second.
const SPANS_KEPT: usize = 256;

impl ImageState {
    /// Total time its probes were in up to `now_ns`.
    pub fn attached_ns(&self, now_ns: u64) -> u64 {
        self.attached_ns
            + self
                .attached_since_ns
                .map_or(0, |since| now_ns.saturating_sub(since))
    }

    /// True if all its probes were in at `t_ns` (or it is never probed).
    fn covered(&self, t_ns: u64) -> bool {
        self.failed
            || self.attached_since_ns.is_some_and(|since| since <= t_ns)
            || self
                .spans
                .iter()
                .rev()
                .any(|&(from, to)| from <= t_ns && t_ns < to)
    }
}

/// The file of allocbpf's own executable. Its allocator (linked in) is never probed,
/// in any process: a probe there would trap on every allocation of ours, and of every
/// other allocbpf on the host, before the program could tell that it was us.
fn own_executable() -> Option<ImageKey> {
    static OWN: std::sync::OnceLock<Option<ImageKey>> = std::sync::OnceLock::new();
    *OWN.get_or_init(|| {
        let code = own_executable as fn() -> Option<ImageKey> as usize as u64;
        allocbpf_images::procfs::own_mapping_at(code).map(|entry| ImageKey::of(&entry))
    })
}

/// Allocator images by file identity, attached once each for every process.
#[derive(Default)]
pub(crate) struct ImageSet {
    /// Known images.
    pub images: HashMap<ImageKey, ImageState>,
    /// Facts about executable files examined (allocator or not).
    pub cache: ImageCache,
    /// Detaches running on other threads now.
    detaching: Arc<AtomicUsize>,
}

impl ImageSet {
    /// True if `key`'s probes were all in at `t_ns` (images never probed, or unknown
    /// here, do not count against it).
    pub fn covered(&self, key: &ImageKey, t_ns: u64) -> bool {
        self.images.get(key).is_none_or(|state| state.covered(t_ns))
    }

    /// Waits (at most `limit`) for the links closing on other threads: at stop, every
    /// probe is gone before the last figures are read.
    pub fn wait_for_detaches(&self, limit: std::time::Duration) {
        let deadline = std::time::Instant::now() + limit;
        while self.detaching.load(Ordering::Relaxed) > 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
}

/// Detaches `links` without waiting: each link is closed on a thread of its own, and
/// counted in `running` (every link closing) and `closing` (its image's, if given)
/// until its close returns; in place once [`MAX_BACKGROUND_DETACHES`] are closing.
fn close_in_background(
    kernel: &mut dyn Attach,
    links: LinkSet,
    running: &Arc<AtomicUsize>,
    closing: Option<&Arc<AtomicUsize>>,
) {
    if running.load(Ordering::Relaxed) >= MAX_BACKGROUND_DETACHES {
        kernel.detach(links);
        return;
    }
    let counters: Vec<&Arc<AtomicUsize>> = std::iter::once(running).chain(closing).collect();
    for link in kernel.detach_later(links) {
        let held: Vec<Arc<AtomicUsize>> = counters.iter().map(|&c| Arc::clone(c)).collect();
        for counter in &held {
            counter.fetch_add(1, Ordering::Relaxed);
        }
        let spawned = std::thread::Builder::new()
            .name("allocbpf-detach".into())
            .spawn(move || {
                drop(link);
                for counter in &held {
                    counter.fetch_sub(1, Ordering::Relaxed);
                }
            });
        if let Err(error) = spawned {
            // The closure (and the link) were dropped: detached here, after all.
            for counter in &counters {
                counter.fetch_sub(1, Ordering::Relaxed);
            }
            tracing::warn!("detached in place (no thread: {error})");
        }
    }
}

/// Links closing at once on other threads; beyond this, detaching waits in place.
const MAX_BACKGROUND_DETACHES: usize = 64;

/// Allocator images known at once (attached, or whose attach failed); a new one beyond
/// is skipped and counted (`images_skipped`), and attached at a later look at a process
/// mapping it (a new process, or new mappings) if images were released meanwhile. A host has one per distinct allocator file: its libc, each container's
/// own, jemalloc or tcmalloc where linked, static programs' own malloc. Each costs a
/// probe set (8 uprobes for glibc, each attach a trip through the kernel's uprobe
/// registration) and a place in every budget plan; a user who copies a file defining
/// `malloc` thousands of times and runs the copies must not make the agent attach
/// thousands of probe sets.
pub(crate) const MAX_IMAGES: usize = 256;

impl ImageSet {
    /// Attaches the images `pid` maps (`maps`) that are not attached yet; returns the
    /// allocator images it maps and every executable file it maps.
    pub fn attach_images_of(
        &mut self,
        kernel: &mut dyn Kernel,
        stats: &mut CollectorStats,
        pid: u32,
        maps: &[MapsEntry],
        lookup: &Lookup,
    ) -> (Vec<ImageKey>, Vec<ImageKey>) {
        let found = self.cache.discover(pid, maps, lookup);
        stats.files_refused = self.cache.refused();
        let mut keys: Vec<ImageKey> = found.iter().map(|i| i.key).collect();
        let mapped: Vec<ImageKey> = allocbpf_images::image::candidate_mappings(maps)
            .into_iter()
            .map(ImageKey::of)
            .collect();
        for image in found {
            if self.images.contains_key(&image.key) || Some(image.key) == own_executable() {
                continue;
            }
            if self.images.len() >= MAX_IMAGES {
                stats.images_skipped += 1;
                let message = format!(
                    "not attaching {} ({}) for pid {pid}: {MAX_IMAGES} allocator images \
                     are known already (the process is profiled through its other images)",
                    image.path_in_target.display(),
                    image.key
                );
                // A warning the first time only: at the cap, every look would log it.
                if stats.images_skipped == 1 {
                    tracing::warn!("{message}");
                } else {
                    tracing::debug!("{message}");
                }
                continue;
            }
            let links = match kernel.attach(&image) {
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
        // Skipped images are no part of the process's observation (budget windows).
        keys.retain(|key| self.images.contains_key(key));
        (keys, mapped)
    }

    /// Records `image`, with its probes if attached.
    pub fn insert(&mut self, image: AllocatorImage, links: Option<LinkSet>) {
        let attached_since_ns = links.is_some().then(monotonic_now_ns);
        self.images.insert(
            image.key,
            ImageState {
                image,
                failed: links.is_none(),
                links,
                attached_since_ns,
                attached_ns: 0,
                spans: VecDeque::new(),
                closing: Arc::default(),
                window_shift: 0,
            },
        );
    }

    /// True while `key`'s probes detached in the background may still be in (its links
    /// are closing on other threads: the breakpoints go only once each close has taken
    /// the kernel's uprobe lock, tens of milliseconds after the window closed).
    pub fn detaching(&self, key: &ImageKey) -> bool {
        self.images
            .get(key)
            .is_some_and(|state| state.closing.load(Ordering::Relaxed) > 0)
    }

    /// Attaches `key`'s probes again (a window opens), sampling `2^window_shift` times
    /// denser than the configured rate; false if that failed.
    pub fn reattach(
        &mut self,
        kernel: &mut dyn Attach,
        stats: &mut CollectorStats,
        key: &ImageKey,
        window_shift: u8,
    ) -> bool {
        let Some(state) = self.images.get_mut(key) else {
            return false;
        };
        if state.links.is_some() {
            return true;
        }
        match kernel.attach_in_windows(&state.image, window_shift) {
            Ok(attached) => {
                state.links = Some(attached.links);
                state.window_shift = window_shift;
                state.attached_since_ns = Some(monotonic_now_ns());
                stats.images_attached += 1;
                true
            }
            Err(error) => {
                // This window is lost (its samples are not placed); the next tries again.
                stats.attach_failures += 1;
                tracing::warn!(
                    "cannot attach {:?} again: {}",
                    state.image.path_in_target,
                    error_chain(&error)
                );
                false
            }
        }
    }

    /// Detaches one process's own links ([`OwnLinks`]) without waiting: closed on other
    /// threads, or here once [`MAX_BACKGROUND_DETACHES`] are closing.
    ///
    /// [`OwnLinks`]: super::process_table::OwnLinks
    pub fn detach_own_in_background(&self, kernel: &mut dyn Attach, links: Vec<LinkSet>) {
        for set in links {
            close_in_background(kernel, set, &self.detaching, None);
        }
    }

    /// Detaches `key`'s probes (a window closes) without waiting: their breakpoints are
    /// gone when this returns, the kernel's grace period is waited for on another thread.
    pub fn detach_in_background(
        &mut self,
        kernel: &mut dyn Kernel,
        stats: &mut CollectorStats,
        key: &ImageKey,
    ) {
        let Some(state) = self.images.get_mut(key) else {
            return;
        };
        let Some(links) = state.links.take() else {
            return;
        };
        let now = monotonic_now_ns();
        state.attached_ns = state.attached_ns(now);
        if let Some(since) = state.attached_since_ns.take() {
            state.spans.push_back((since, now));
            if state.spans.len() > SPANS_KEPT {
                state.spans.pop_front();
            }
        }
        stats.images_attached -= 1;
        close_in_background(kernel, links, &self.detaching, Some(&state.closing));
    }

    /// Takes every image's probes (to detach them at stop).
    pub fn take_links(&mut self) -> Vec<LinkSet> {
        self.images
            .values_mut()
            .filter_map(|state| state.links.take())
            .collect()
    }
}
