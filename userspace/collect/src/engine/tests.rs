//! The engine against a fake kernel (`kernel/fake.rs`): event handling, interval cuts,
//! image release, gates and the overhead budget's windows, without root and without
//! the BPF toolchain. The processes are real (this test and children it starts): the
//! engine reads their identity from `/proc` as it would any other's.

use std::{
    collections::HashMap,
    fs::File,
    process::{Child, Command},
    sync::Arc,
    time::Duration,
};

use allocbpf_common::{GateState, ProcessGate, Totals};
use allocbpf_images::{
    discover::{ImageCache, Silence},
    image::{AllocatorImage, ImageKey},
    procfs,
    target::Target,
};
use allocbpf_probe::{
    events::{Event, RawSample},
    sampler::monotonic_now_ns,
};
use allocbpf_profile::{estimate::interval_table::REFRESH_INTERVAL, frame::Frame};
use allocbpf_stacks::resolve::UnwindMode;

use super::{Collector, ProcessProfile, MAX_STACKS_PER_PROCESS};
use crate::{
    budget::{BudgetOptions, HitCost},
    error::CollectError,
    filter::{FilterOptions, ProcessFilter},
    kernel::fake::FakeLoader,
    options::{CollectOptions, Scope},
};

/// The mean sampling interval the tests' samples were drawn at.
const RATE: u64 = 4096;

/// Options that keep the tests to the engine: frame-pointer stacks (the samples carry
/// none), no symbolization.
fn options() -> CollectOptions {
    CollectOptions {
        rate: RATE,
        unwind: UnwindMode::Fp,
        symbolize: false,
        ..CollectOptions::default()
    }
}

/// The identity of this test's own executable: a file this process really maps.
fn own_executable() -> ImageKey {
    let me = std::process::id();
    let exe = std::fs::read_link("/proc/self/exe").unwrap();
    procfs::read_maps(me)
        .iter()
        .find(|entry| entry.executable && entry.file_path() == Some(exe.as_path()))
        .map(ImageKey::of)
        .expect("this test maps its own executable")
}

/// An allocator image with no entries (the fake kernel attaches nothing anyway).
fn image(key: ImageKey) -> AllocatorImage {
    AllocatorImage {
        key,
        path_in_target: format!("/images/{}", key.inode).into(),
        file: Arc::new(File::open("/proc/self/exe").unwrap()),
        families: vec!["glibc"],
        entries: Vec::new(),
        frees: Vec::new(),
        inlined: Vec::new(),
        inlined_frees: Vec::new(),
        skipped: Vec::new(),
    }
}

/// A sampled allocation of `size` bytes by `pid`, counted in `epoch`.
fn sample(pid: u32, id: u64, size: u64, epoch: u32) -> Event {
    Event::Sample(RawSample {
        sample_id: id,
        pid,
        tid: pid,
        epoch,
        timestamp_ns: monotonic_now_ns(),
        size,
        rate: RATE,
        next_interval: RATE,
        ..RawSample::default()
    })
}

/// This process profiled through `images`, as `--pid` would attach it.
fn one_process(fake: &FakeLoader, images: Vec<ImageKey>) -> Collector {
    try_one_process(fake, images).unwrap()
}

/// [`one_process`], failing as [`Collector::start`] would.
fn try_one_process(fake: &FakeLoader, images: Vec<ImageKey>) -> Result<Collector, CollectError> {
    let me = std::process::id();
    let target = Target {
        pid: me,
        comm: "engine-test".into(),
        images: images.into_iter().map(image).collect(),
        silence: Silence::NotYet,
        cache: ImageCache::default(),
    };
    Collector::start_resolved(fake, options(), Scope::Process(me), Some(target))
}

/// Every process but those named `exclude` (a regex on the command name), with
/// nothing attached yet.
fn host(fake: &FakeLoader, exclude: Option<&str>) -> Collector {
    let filter = ProcessFilter::new(&FilterOptions {
        exclude_comm: exclude.map(str::to_string),
        ..FilterOptions::default()
    })
    .unwrap();
    Collector::assemble(fake, options(), Scope::Host { filter }).unwrap()
}

/// A child process that sleeps until killed.
struct Sleeper(Child);

impl Sleeper {
    /// Started, and done loading its libraries (what the engine reads of it is then
    /// what it keeps: a later look at its maps finds nothing new).
    fn start() -> Self {
        let child = Command::new("sleep").arg("60").spawn().unwrap();
        // The loader maps libc's text after its first pages: wait for the text.
        let loaded = |pid| {
            procfs::read_maps(pid)
                .iter()
                .any(|entry| entry.executable && entry.name.to_string_lossy().contains("libc"))
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !loaded(child.id()) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        Self(child)
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }

    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        self.kill();
    }
}

fn profile_of(profiles: &[ProcessProfile], pid: u32) -> &ProcessProfile {
    profiles
        .iter()
        .find(|p| p.info.pid == pid)
        .unwrap_or_else(|| panic!("no profile of pid {pid} among {}", profiles.len()))
}

#[test]
fn a_cut_has_exactly_its_epochs_samples_and_the_kernels_totals() {
    let me = std::process::id();
    let fake = FakeLoader::new(false);
    let own = own_executable();
    let mut collector = one_process(&fake, vec![own]);
    let config = fake.state.borrow().config.unwrap();
    assert_eq!((config.pid, config.rate), (Some(me), RATE));
    assert!(fake.attached_images().contains(&(own, 0)));

    let totals = Totals {
        calls: 10,
        bytes: 40_960,
    };
    fake.state
        .borrow_mut()
        .totals
        .insert(0, HashMap::from([(me, totals)]));
    // Three samples of the interval, and one the kernel counted in the next epoch,
    // read during the cut (after the epoch advanced): held for the next interval.
    fake.send((0..3).map(|id| sample(me, id, 4096, 0)));
    fake.send([sample(me, 3, 4096, 1)]);
    let first = collector.cut();
    let report = &profile_of(&first, me).report;
    assert_eq!(report.totals.exact_bytes, 40_960);
    assert_eq!(report.totals.exact_calls, 10);
    assert_eq!(report.totals.samples, 3);

    let second = collector.cut();
    let next = &profile_of(&second, me).report;
    assert_eq!(next.totals.samples, 1);
    assert_eq!(
        next.totals.exact_calls, 0,
        "the kernel counted nothing in epoch 1"
    );
    // Same size, same rate: each sample weighs the same, S / (1 - exp(-S/R)).
    let weight = 4096.0 / (1.0 - (-1.0f64).exp());
    assert!((next.totals.estimated_bytes - weight).abs() < 1e-6 * weight);
    assert!((report.totals.estimated_bytes - 3.0 * weight).abs() < 1e-6 * weight);
}

/// A sample the ring had no room for arrives through the ring of lost samples: it keeps
/// its weight in every total, under one frame that says its stack is lost.
#[test]
fn a_lost_sample_counts_under_a_lost_stack() {
    let me = std::process::id();
    let fake = FakeLoader::new(false);
    let mut collector = one_process(&fake, vec![own_executable()]);
    let Event::Sample(mut lost) = sample(me, 1, 4096, 0) else {
        unreachable!()
    };
    lost.lost = true;
    fake.send([Event::Sample(lost), sample(me, 2, 4096, 0)]);
    let profiles = collector.cut();
    let report = &profile_of(&profiles, me).report;
    assert_eq!(collector.stats.lost_samples, 1);
    assert_eq!(report.totals.samples, 2);
    let lost_stacks: Vec<_> = report
        .stacks
        .iter()
        .filter(|stack| stack.locations.len() == 1 && stack.locations[0].frame == Frame::Lost)
        .collect();
    assert_eq!(lost_stacks.len(), 1);
    assert_eq!(lost_stacks[0].stats.samples, 1);
}

/// One process: an image of the target that cannot be attached fails the start (the
/// target would be profiled in part, silently).
#[test]
fn a_target_whose_image_cannot_be_attached_is_refused() {
    let fake = FakeLoader::new(false);
    fake.state.borrow_mut().refuse_attach = true;
    let error = try_one_process(&fake, vec![own_executable()]).err();
    assert!(matches!(error, Some(CollectError::Probe(_))), "{error:?}");
    assert!(fake.attached_images().is_empty());
}

#[test]
fn an_image_no_process_maps_is_detached_at_the_cut() {
    let fake = FakeLoader::new(false);
    let own = own_executable();
    let unmapped = ImageKey {
        device: u64::MAX,
        inode: 7,
    };
    // As root the engine also finds the real allocators this test maps (its libc),
    // which stay: they are mapped.
    let mut collector = one_process(&fake, vec![own, unmapped]);
    let attached = collector.stats.images_attached;
    assert!(fake.attached_images().contains(&(unmapped, 0)));
    collector.cut();
    assert!(fake.attached_images().contains(&(own, 0)));
    assert!(!fake.attached_images().contains(&(unmapped, 0)));
    assert_eq!(fake.state.borrow().detached.len(), 1);
    assert_eq!(collector.stats.images_released, 1);
    assert_eq!(collector.stats.images_attached, attached - 1);
    // At stop every probe left goes too.
    collector.stop();
    assert!(fake.attached_images().is_empty());
}

#[test]
fn a_new_process_is_looked_at_gated_profiled_and_forgotten_after_its_exit() {
    let fake = FakeLoader::new(false);
    let mut collector = host(&fake, None);
    let mut child = Sleeper::start();
    let pid = child.pid();
    fake.send([sample(pid, 1, 100, 0), Event::Exec { pid }]);
    collector.drain_ring();
    assert_eq!(collector.stats.processes_seen, 1);
    assert_eq!(collector.stats.samples, 1);
    assert_eq!(collector.stats.exec_events, 1);
    let gate = fake.state.borrow().gates.get(&pid).copied();
    assert_eq!(gate.map(|g| g.state), Some(GateState::Open as u32));

    child.kill();
    fake.send([Event::Exit { pid }]);
    let profiles = collector.cut();
    let profile = profile_of(&profiles, pid);
    assert!(profile.exited, "its last profile says it exited");
    assert_eq!(profile.report.totals.samples, 1);
    assert_eq!(profile.info.comm, "sleep");
    assert!(fake.state.borrow().forgotten.contains(&pid));
    assert!(!collector.processes.tracked.contains_key(&pid));
    // A late sample of the exited process is not taken for a new one.
    fake.send([sample(pid, 2, 100, 1)]);
    collector.drain_ring();
    assert_eq!(collector.stats.processes_seen, 1);
}

/// Samples of processes not seen yet are held while the batch goes on, and their
/// processes looked at once it ends, or before any other event of theirs: an exit right
/// after a new process's samples comes after its look, and every sample counts, each in
/// its own process, as when a process was looked at in the middle of the batch.
#[test]
fn new_processes_are_looked_at_off_the_sample_path_with_no_sample_lost_or_misplaced() {
    let fake = FakeLoader::new(false);
    let mut collector = host(&fake, None);
    let mut first = Sleeper::start();
    let second = Sleeper::start();
    let (a, b) = (first.pid(), second.pid());
    fake.send([
        sample(a, 1, 100, 0),
        sample(b, 2, 200, 0),
        sample(a, 3, 100, 0),
        Event::Exit { pid: a },
        sample(b, 4, 200, 0),
    ]);
    collector.drain_ring();
    assert!(!collector.intake.first_sight.holds(a) && !collector.intake.first_sight.holds(b));
    assert_eq!(collector.stats.processes_seen, 2);
    assert_eq!(collector.stats.samples, 4);
    assert_eq!(collector.stats.exit_events, 1);
    first.kill();
    let profiles = collector.cut();
    let (of_a, of_b) = (profile_of(&profiles, a), profile_of(&profiles, b));
    assert!(of_a.exited && !of_b.exited);
    assert_eq!(of_a.report.totals.samples, 2);
    assert_eq!(of_b.report.totals.samples, 2);
}

#[test]
fn a_sample_of_a_process_the_filter_excludes_is_dropped_and_its_gate_closed() {
    let fake = FakeLoader::new(false);
    let mut collector = host(&fake, Some("^sleep$"));
    let child = Sleeper::start();
    let pid = child.pid();
    fake.send([sample(pid, 1, 100, 0)]);
    collector.drain_ring();
    assert_eq!(collector.stats.samples, 0);
    assert_eq!(collector.stats.filtered_samples, 1);
    let gate = fake.state.borrow().gates.get(&pid).copied();
    assert_eq!(gate.map(|g| g.state), Some(GateState::Excluded as u32));
}

#[test]
fn a_ring_read_error_comes_once_after_the_events_before_it() {
    let fake = FakeLoader::new(false);
    let me = std::process::id();
    let mut collector = one_process(&fake, vec![own_executable()]);
    fake.send([sample(me, 1, 100, 0)]);
    fake.queue.borrow_mut().error = Some(std::io::Error::other("ring gone"));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runtime.block_on(async {
        collector.read().await.unwrap();
        assert_eq!(collector.stats.samples, 1);
        assert!(collector.read().await.is_err());
        collector.read().await.unwrap();
    });
    // What was collected stays: the last profile has it.
    let profiles = collector.stop();
    assert_eq!(profile_of(&profiles, me).report.totals.samples, 1);
}

#[test]
fn housekeeping_refreshes_the_table_and_reads_the_rings_pressure() {
    let fake = FakeLoader::new(false);
    let mut collector = one_process(&fake, vec![own_executable()]);
    fake.state.borrow_mut().pressure_level = 2;
    collector.chores.last_refresh = collector
        .chores
        .last_refresh
        .checked_sub(REFRESH_INTERVAL)
        .expect("the clock has run that long");
    collector.housekeeping();
    assert_eq!(fake.state.borrow().refreshes, 1);
    assert_eq!(collector.stats.pressure_level, 2);
    fake.state.borrow_mut().pressure_level = 0;
    collector.housekeeping();
    assert_eq!(
        (
            collector.stats.pressure_level,
            collector.stats.pressure_peak_level
        ),
        (0, 2)
    );
}

/// A host scope under the default budget, checked every millisecond, a hit costing
/// a microsecond.
fn budgeted_host(fake: &FakeLoader) -> Collector {
    let mut collector = host(fake, None);
    let options = BudgetOptions {
        check_every: Duration::from_millis(1),
        ..BudgetOptions::default()
    };
    let cost = HitCost {
        hit_ns: 1000.0,
        stepped_extra_ns: 0.0,
    };
    collector.start_budget(options, cost);
    collector
}

/// A process whose probe hits would cost far more than its budget gets its image
/// probed part time: its full-time links go, and windows attach them again with a
/// window shift (samples drawn denser inside the windows).
#[test]
fn a_costly_process_has_its_image_probed_in_windows() {
    let fake = FakeLoader::new(true);
    let mut collector = budgeted_host(&fake);
    let child = Sleeper::start();
    let pid = child.pid();
    let key = ImageKey {
        device: u64::MAX,
        inode: 11,
    };
    let attached = collector.kernel().attach(&image(key)).unwrap();
    let full_time = attached.links.id();
    collector.images.insert(image(key), Some(attached.links));
    collector.stats.images_attached += 1;
    fake.send([sample(pid, 1, 100, 0)]);
    collector.drain_ring();
    collector.processes.tracked.get_mut(&pid).unwrap().images = vec![key];
    // A first check sees no hits; the next one a million more (a second of CPU at a
    // microsecond each), far over a 1% budget.
    std::thread::sleep(Duration::from_millis(5));
    collector.housekeeping();
    fake.state.borrow_mut().gates.insert(
        pid,
        ProcessGate {
            hits: 1_000_000,
            ..ProcessGate::default()
        },
    );
    std::thread::sleep(Duration::from_millis(20));
    collector.housekeeping();
    let figures = &collector.budget.as_ref().unwrap().image_figures;
    assert!(figures[&key].duty < 1.0, "{figures:?}");
    assert!(collector.stats.budget_windowed_images >= 1);
    collector.windows_tick();
    let state = fake.state.borrow();
    assert!(
        state.detached.contains(&full_time),
        "the full-time links went: {state:?}"
    );
    // Any attach since is a window's, sampling denser than the configured rate.
    let windows = state.attaches.iter().filter(|(k, _)| *k == key).skip(1);
    assert!(windows.clone().all(|&(_, shift)| shift > 0), "{state:?}");
}

/// The budget is per process: beside a process whose hits hold a shared image part
/// time, a light process mapping it gets links of its own, full time, and its gate says
/// they are the ones that count (`GateState::OwnLinks`); the heavy one gets none. Once
/// the light one costs more than its budget too, its links go and its gate counts the
/// shared links again.
#[test]
fn a_light_process_beside_a_heavy_one_gets_links_of_its_own() {
    let fake = FakeLoader::new(true);
    let mut collector = budgeted_host(&fake);
    let (heavy, light) = (Sleeper::start(), Sleeper::start());
    let key = ImageKey {
        device: u64::MAX,
        inode: 12,
    };
    let attached = collector.kernel().attach(&image(key)).unwrap();
    collector.images.insert(image(key), Some(attached.links));
    collector.stats.images_attached += 1;
    fake.send([
        sample(heavy.pid(), 1, 100, 0),
        sample(light.pid(), 2, 100, 0),
    ]);
    collector.drain_ring();
    for pid in [heavy.pid(), light.pid()] {
        collector.processes.tracked.get_mut(&pid).unwrap().images = vec![key];
    }
    let hits = |fake: &FakeLoader, pid: u32, hits: u64| {
        let mut state = fake.state.borrow_mut();
        state.gates.entry(pid).or_default().hits = hits;
    };
    std::thread::sleep(Duration::from_millis(5));
    collector.housekeeping();
    // A second of CPU in probes for one, ten microseconds for the other.
    hits(&fake, heavy.pid(), 1_000_000);
    hits(&fake, light.pid(), 10);
    std::thread::sleep(Duration::from_millis(20));
    collector.housekeeping();
    assert!(collector.budget.as_ref().unwrap().image_figures[&key].duty < 1.0);
    let gate = |fake: &FakeLoader, pid: u32| fake.state.borrow().gates[&pid].state;
    assert_eq!(gate(&fake, light.pid()), GateState::OwnLinks as u32);
    assert_eq!(gate(&fake, heavy.pid()), GateState::Open as u32);
    let own: Vec<(ImageKey, u32, u64)> = fake.state.borrow().own_attaches.clone();
    assert_eq!(own.len(), 1, "{own:?}");
    assert_eq!((own[0].0, own[0].1), (key, light.pid()));
    let tracked = &collector.processes.tracked[&light.pid()];
    assert!(tracked.own.attached() && tracked.own.covers(monotonic_now_ns()));
    assert_eq!(collector.stats.own_link_attaches, 1);
    // Now it costs a second of CPU a second too: its links go.
    hits(&fake, light.pid(), 2_000_000);
    std::thread::sleep(Duration::from_millis(20));
    collector.housekeeping();
    assert_eq!(gate(&fake, light.pid()), GateState::Open as u32);
    assert!(fake.state.borrow().detached.contains(&own[0].2));
    let tracked = &collector.processes.tracked[&light.pid()];
    assert!(!tracked.own.attached() && tracked.own.last_span.is_some());
    assert_eq!(collector.stats.own_link_removals, 1);
}

/// A process whose samples bring endless distinct stacks (a forged runtime's names):
/// past its cap, its new stacks share one row that says so, their weight kept, and the
/// stacks it had keep theirs.
#[test]
fn a_process_past_its_cap_on_stacks_adds_them_under_one_row() {
    use allocbpf_profile::frame::PROCESS_STACKS_FULL;
    let me = std::process::id();
    let fake = FakeLoader::new(false);
    let mut collector = one_process(&fake, vec![own_executable()]);
    let over = 100;
    let samples = (0..(MAX_STACKS_PER_PROCESS + over) as u64).map(|i| {
        let Event::Sample(mut sample) = sample(me, i + 1, 4096, 0) else {
            unreachable!()
        };
        // An address nothing maps: one distinct frame each.
        sample.stack = vec![0x10_0000 + 16 * i];
        Event::Sample(sample)
    });
    fake.send(samples.collect::<Vec<_>>());
    let profiles = collector.cut();
    let report = &profile_of(&profiles, me).report;
    assert_eq!(
        report.totals.samples,
        (MAX_STACKS_PER_PROCESS + over) as u64
    );
    assert_eq!(report.stacks.len(), MAX_STACKS_PER_PROCESS + 1);
    let merged: Vec<_> = (report.stacks.iter())
        .filter(|stack| stack.function_names() == [PROCESS_STACKS_FULL])
        .collect();
    assert_eq!(merged.len(), 1);
    assert_eq!(merged[0].stats.samples, over as u64);
    assert_eq!(collector.stats.stacks_merged, over as u64);
}
