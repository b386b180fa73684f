//! Attaching and detaching one image's probes: aya uprobes, or uprobe_multi and
//! session links where the kernel has them (`session_link.rs`).

use std::{num::NonZeroU32, os::fd::OwnedFd};

use allocbpf_common::LiveMode;
use allocbpf_images::image::{AllocatorImage, ProbedEntry};
use aya::programs::{
    uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLink, UProbeLinkId, UProbeScope},
    UProbe,
};

use super::{load_error, program_of, session_link::SessionPrograms, ProbeError, Sampler};

/// What [`Sampler::attach`] attached to one image.
#[derive(Debug)]
pub struct Attached {
    /// With live tracking: how returns are observed...
    pub live_mode: LiveMode,
    /// ...and how many deallocation entries are probed.
    pub frees: usize,
    /// The links, for [`Sampler::detach`].
    pub links: ImageLinks,
}

/// The probes attached to one image.
#[derive(Debug, Default)]
pub struct ImageLinks {
    /// aya-managed uprobes: (program name, link).
    uprobes: Vec<(&'static str, UProbeLinkId)>,
    /// Session and uprobe_multi links (closing the fd detaches).
    sessions: Vec<OwnedFd>,
    /// Probes behind those links (a multi link has several).
    fd_probes: usize,
}

impl ImageLinks {
    /// Number of probes attached.
    pub fn len(&self) -> usize {
        self.uprobes.len() + self.fd_probes
    }

    /// True if nothing is attached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Moves `other`'s links into these.
    fn append(&mut self, mut other: ImageLinks) {
        self.uprobes.append(&mut other.uprobes);
        self.sessions.append(&mut other.sessions);
        self.fd_probes += other.fd_probes;
    }
}

/// Attaches `program(entry)` at every entry of `entries` through `programs`' links:
/// one link per program, each with every offset (and cookie) of its entries.
fn link_grouped(
    programs: &mut SessionPrograms,
    image: &AllocatorImage,
    entries: &[ProbedEntry],
    program: impl Fn(&ProbedEntry) -> &'static str,
    scope: LinkScope,
    links: &mut ImageLinks,
) -> Result<(), ProbeError> {
    let mut groups: std::collections::BTreeMap<&'static str, (Vec<u64>, Vec<u64>)> =
        Default::default();
    for entry in entries {
        let (offsets, cookies) = groups.entry(program(entry)).or_default();
        offsets.push(entry.probe_file_offset());
        cookies.push(entry.cookie_for(scope.window_shift, scope.own_link));
    }
    for (name, (offsets, cookies)) in groups {
        let link = programs
            .attach_many(name, &image.attach_path(), &offsets, &cookies, scope.pid)
            .map_err(|source| ProbeError::Attach {
                symbol: name.to_string(),
                path: image.path_in_target.display().to_string(),
                source: Box::new(source),
            })?;
        links.sessions.push(link);
        links.fd_probes += offsets.len();
    }
    Ok(())
}

/// Which processes a link probes and how its cookies say so.
#[derive(Clone, Copy, Debug)]
struct LinkScope {
    /// One process (`None`: every process).
    pid: Option<u32>,
    /// The window shift of its cookies.
    window_shift: u8,
    /// One process's own links ([`Sampler::attach_own`]).
    own_link: bool,
}

/// Probes of one image taken out of the sampler ([`Sampler::take_links`]): dropping
/// this detaches them.
pub struct DetachingLinks {
    uprobes: Vec<UProbeLink>,
    sessions: Vec<OwnedFd>,
}

impl DetachingLinks {
    /// Splits into one part per link: each close waits for a grace period after its
    /// breakpoints are gone, so links closed one after another would leave the last
    /// ones trapping for the sum of the waits; closed on one thread each, they all go
    /// at once.
    pub fn split(self) -> Vec<DetachingLinks> {
        let uprobes = self.uprobes.into_iter().map(|link| DetachingLinks {
            uprobes: vec![link],
            sessions: Vec::new(),
        });
        let sessions = self.sessions.into_iter().map(|fd| DetachingLinks {
            uprobes: Vec::new(),
            sessions: vec![fd],
        });
        uprobes.chain(sessions).collect()
    }

    /// Number of links.
    pub fn len(&self) -> usize {
        self.uprobes.len() + self.sessions.len()
    }

    /// True if there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Sampler {
    /// [`Sampler::attach`] for an image observed in windows only: its probes sample
    /// `2^window_shift` times denser than the configured rate (each sample carries the
    /// interval it was drawn at), so that a process observed a fraction of the time
    /// still gets about the samples it would get probed full time.
    pub fn attach_in_windows(
        &mut self,
        image: &AllocatorImage,
        window_shift: u8,
    ) -> Result<Attached, ProbeError> {
        self.window_shift = window_shift;
        let attached = self.attach(image);
        self.window_shift = 0;
        attached
    }

    /// [`Sampler::attach`] for process `pid` only, full time, as its own links: on an
    /// image the overhead budget probes part time for the others, a light process is
    /// probed full time through these, and its gate (`GateState::OwnLinks`, set by the
    /// caller once this returns) makes the shared links' runs of its traps do nothing.
    /// Needs uprobe_multi links.
    pub fn attach_own(&mut self, image: &AllocatorImage, pid: u32) -> Result<Attached, ProbeError> {
        if self.multi_programs.is_none() {
            return Err(ProbeError::Attach {
                symbol: "(own links)".into(),
                path: image.path_in_target.display().to_string(),
                source: "this kernel has no uprobe_multi links".into(),
            });
        }
        self.own_pid = Some(pid);
        let attached = self.attach(image);
        self.own_pid = None;
        attached
    }

    /// The scope of the links the attach under way makes.
    fn link_scope(&self) -> LinkScope {
        LinkScope {
            pid: self.own_pid.or(self.config.pid),
            window_shift: self.window_shift,
            own_link: self.own_pid.is_some(),
        }
    }

    /// Attaches one probe per allocation entry of `image`, and with live tracking the
    /// probes on its deallocation entries and the return mechanism. Dropping the
    /// sampler detaches everything; [`Sampler::detach`] detaches one image earlier.
    pub fn attach(&mut self, image: &AllocatorImage) -> Result<Attached, ProbeError> {
        let mut attached = Attached {
            live_mode: LiveMode::Off,
            frees: 0,
            links: ImageLinks::default(),
        };
        // On failure, what this image attached so far is detached again.
        let result = self.attach_all(image, &mut attached);
        if let Err(error) = result {
            self.detach(std::mem::take(&mut attached.links));
            return Err(error);
        }
        Ok(attached)
    }

    fn attach_all(
        &mut self,
        image: &AllocatorImage,
        attached: &mut Attached,
    ) -> Result<(), ProbeError> {
        let empty = self.config.empty_probes;
        let program = |entry: &ProbedEntry| {
            if empty {
                "probe_empty"
            } else {
                entry.shape.program()
            }
        };
        let live = self.config.live.is_some();
        self.preload(image, &program);
        // The exported deallocation entries first: a block predicted at an inlined site
        // from the moment those sites are in may die through them.
        if live {
            self.attach_entries(image, &image.frees, program, &mut attached.links)?;
            attached.frees += image.frees.len();
        }
        // Plain uprobes (never sessions): an inlined site is no function entry. Best
        // effort: the image's entries are probed whatever becomes of its sites. With
        // live tracking the inlined frees go with the inlined sites, and before them: a
        // block predicted at a site must be seen freed wherever it dies.
        let mut sites = ImageLinks::default();
        let inlined = match live {
            true => self
                .attach_entries(image, &image.inlined_frees, program, &mut sites)
                .and_then(|()| self.attach_entries(image, &image.inlined, program, &mut sites)),
            false => self.attach_entries(image, &image.inlined, program, &mut sites),
        };
        match inlined {
            Ok(()) => {
                attached.links.append(sites);
                attached.frees += if live { image.inlined_frees.len() } else { 0 };
            }
            Err(error) => {
                self.detach(sites);
                tracing::warn!(
                    "{}: its inlined allocation sites are not probed: {error}",
                    image.path_in_target.display()
                );
            }
        }
        if live && !empty {
            if self.session_programs.is_some() {
                attached.live_mode = LiveMode::Session;
                return self.attach_sessions(image, &mut attached.links);
            }
            attached.live_mode = LiveMode::Uretprobe;
            // The return of every allocation call, armed at the entry's probe point:
            // `[sp]` is still the return address there, and the kernel runs our entry
            // program before it swaps that for its trampoline.
            for entry in &image.entries {
                let link = self.attach_uprobe("probe_return", entry, 0, image)?;
                attached.links.uprobes.push(link);
            }
        }
        self.attach_entries(image, &image.entries, program, &mut attached.links)
    }

    /// Verifies, in parallel, every program [`Sampler::attach_all`] will link on
    /// `image`. Best effort: a program that fails to load here fails again, with its
    /// error, at the attach that needs it.
    fn preload(&mut self, image: &AllocatorImage, program: &impl Fn(&ProbedEntry) -> &'static str) {
        let live = self.config.live.is_some();
        let sessions = live && self.session_programs.is_some();
        if let Some(multi) = self.multi_programs.as_mut() {
            let mut names: Vec<&str> = image.inlined.iter().map(program).collect();
            if live {
                names.extend(image.frees.iter().chain(&image.inlined_frees).map(program));
            }
            if !sessions {
                names.extend(image.entries.iter().map(program));
            }
            let _ = multi.preload(&names);
        }
        if let (true, Some(programs)) = (sessions, self.session_programs.as_mut()) {
            let names: Vec<&str> = image.entries.iter().map(|e| e.shape.program()).collect();
            let _ = programs.preload(&names);
        }
    }

    /// Attaches `program(entry)` at every entry of `entries` with its cookie: one
    /// uprobe_multi link per program where they are used, else one aya uprobe each.
    fn attach_entries(
        &mut self,
        image: &AllocatorImage,
        entries: &[ProbedEntry],
        program: impl Fn(&ProbedEntry) -> &'static str,
        links: &mut ImageLinks,
    ) -> Result<(), ProbeError> {
        let scope = self.link_scope();
        let Some(multi) = self.multi_programs.as_mut() else {
            for entry in entries {
                let cookie = entry.cookie_in_windows(self.window_shift);
                let link = self.attach_uprobe(program(entry), entry, cookie, image)?;
                links.uprobes.push(link);
            }
            return Ok(());
        };
        link_grouped(multi, image, entries, program, scope, links)
    }

    /// Attaches every allocation entry of `image` through session links, one per
    /// program.
    fn attach_sessions(
        &mut self,
        image: &AllocatorImage,
        links: &mut ImageLinks,
    ) -> Result<(), ProbeError> {
        let scope = self.link_scope();
        let Some(programs) = self.session_programs.as_mut() else {
            return Ok(());
        };
        link_grouped(
            programs,
            image,
            &image.entries,
            |e| e.shape.program(),
            scope,
            links,
        )
    }

    /// Loads (once) and attaches aya program `name` at `entry`'s probe point in
    /// `image`, with `cookie` for the program to read.
    fn attach_uprobe(
        &mut self,
        name: &'static str,
        entry: &ProbedEntry,
        cookie: u64,
        image: &AllocatorImage,
    ) -> Result<(&'static str, UProbeLinkId), ProbeError> {
        let scope = match self.config.pid.and_then(NonZeroU32::new) {
            Some(pid) => UProbeScope::OneProcess(pid),
            None => UProbeScope::AllProcesses,
        };
        let program: &mut UProbe = program_of(&mut self.ebpf, name)?;
        if program.fd().is_err() {
            program.load().map_err(load_error)?;
        }
        let point = UProbeAttachPoint {
            location: UProbeAttachLocation::AbsoluteOffset(entry.probe_file_offset()),
            cookie: Some(cookie),
        };
        let link = program
            .attach(point, image.attach_path(), scope)
            .map_err(|source| ProbeError::Attach {
                symbol: entry.symbol.clone(),
                path: image.path_in_target.display().to_string(),
                source: Box::new(source),
            })?;
        Ok((name, link))
    }

    /// Detaches the probes of one image (system-wide mode: a budget back-off, or an
    /// image no process maps any more).
    pub fn detach(&mut self, links: ImageLinks) {
        for (name, link) in links.uprobes {
            if let Ok(program) = program_of::<UProbe>(&mut self.ebpf, name) {
                if let Err(error) = program.detach(link) {
                    tracing::warn!("detaching {name}: {error}");
                }
            }
        }
        // Session links are file descriptors: closing them detaches.
        drop(links.sessions);
    }

    /// Takes `links` out of the sampler's programs without detaching them: they detach
    /// when the result is dropped. Closing a uprobe waits for an RCU grace period
    /// after its breakpoints are gone (docs/design.md, "Attaching and detaching"), so
    /// the caller drops it
    /// on another thread and goes on.
    pub fn take_links(&mut self, links: ImageLinks) -> DetachingLinks {
        let mut uprobes = Vec::new();
        for (name, link) in links.uprobes {
            let taken = program_of::<UProbe>(&mut self.ebpf, name)
                .and_then(|program| program.take_link(link).map_err(load_error));
            match taken {
                Ok(link) => uprobes.push(link),
                Err(error) => tracing::warn!("detaching {name}: {error}"),
            }
        }
        DetachingLinks {
            uprobes,
            sessions: links.sessions,
        }
    }

    /// True if images can be probed part time (the overhead budget's windows): their
    /// probes are uprobe_multi links, which go at once, and returns are not observed
    /// through uretprobes (perf events, whose detach waits a grace period per probe).
    pub fn windows_supported(&self) -> bool {
        self.multi_programs.is_some()
            && self.session_programs.is_some() == self.config.live.is_some()
    }
}
