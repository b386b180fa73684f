//! Loading, configuring and attaching the eBPF sampler, and reading its maps.
//!
//! The compiled eBPF object is the binary's (its `build.rs` builds `ebpf/allocbpf-ebpf`
//! and embeds it), passed to [`Sampler::load`] as bytes: this crate never needs the BPF
//! toolchain.

mod attach;
mod batch;
mod bpf_syscall;
mod entries;
mod gates;
mod mapped_array;
pub mod session_link;
mod thread_slots;
mod totals;

pub use self::attach::{Attached, DetachingLinks, ImageLinks};

use allocbpf_common::{
    Counter, LiveMode, Totals, CERTAIN_THRESHOLD_GLOBAL, COUNTER_COUNT, COUNT_HITS_GLOBAL,
    LIVE_MODE_GLOBAL, LOST_MAP, PRESSURE_MAP, RATE_GLOBAL, SELF_TGID_GLOBAL,
    STACK_COPY_BYTES_GLOBAL, TARGET_PID_GLOBAL, THREAD_SLOT_MASK_GLOBAL,
};
use aya::{
    maps::{Array, IterableMap, MapData, RingBuf},
    programs::{uprobe::UProbeLinkId, RawTracePoint},
    Btf, Ebpf, EbpfLoader,
};
use aya_log::EbpfLogger;

use std::os::fd::AsFd;

use self::mapped_array::MappedArray;
use self::session_link::{LinkKind, SessionPrograms};
use allocbpf_sampling::{certain_threshold, interval_table::IntervalTable, Counters};

/// Errors from loading or attaching the sampler.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// The kernel refused the object or a program.
    #[error("cannot load the eBPF sampler")]
    Load(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A uprobe could not be attached.
    #[error("cannot attach a uprobe to {symbol} in {path}")]
    Attach {
        /// The entry.
        symbol: String,
        /// The image file.
        path: String,
        /// The cause (boxed: it is large, and errors travel by value).
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A map could not be read or written.
    #[error("eBPF map {map}")]
    Map {
        /// Map name.
        map: &'static str,
        /// The cause.
        source: aya::maps::MapError,
    },
    /// A map could not be memory-mapped, or the CPUs counted.
    #[error("eBPF map {map}: {source}")]
    System {
        /// Map name.
        map: &'static str,
        /// The cause.
        source: std::io::Error,
    },
}

/// What [`Sampler::attach_empty_at`] attached, for [`Sampler::detach_empty`].
pub type EmptyLink = UProbeLinkId;

/// How often the thread tables' frozen entries of exited threads are collected.
pub const COLLECT_EXITED_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

fn load_error(e: impl std::error::Error + Send + Sync + 'static) -> ProbeError {
    ProbeError::Load(Box::new(e))
}

fn map_error(map: &'static str) -> impl FnOnce(aya::maps::MapError) -> ProbeError {
    move |source| ProbeError::Map { map, source }
}

/// What to load.
#[derive(Clone, Copy, Debug)]
pub struct SamplerConfig {
    /// Profile only this process (also filtered in the kernel); `None` for all.
    pub pid: Option<u32>,
    /// Mean sampling interval in bytes.
    pub rate: u64,
    /// Attach the empty program instead of the sampler (benchmark floor).
    pub empty_probes: bool,
    /// Thread table sizes (tests shrink them to exercise the overflow paths).
    pub thread_tables: ThreadTables,
    /// Track sampled blocks until freed, and how.
    pub live: Option<LiveMechanism>,
    /// Bytes of user stack copied per sample (0: frame pointers walked in the kernel).
    pub stack_copy_bytes: u32,
    /// Count probe hits per process even with `pid` (an overhead budget on one
    /// process); every process's are counted without.
    pub count_hits: bool,
    /// Attach entry probes through uprobe_multi links where the kernel has them (6.6+):
    /// one link per program and image, detached in one step (the overhead budget's
    /// windows detach images every period; `session_link.rs` says why).
    pub multi_links: bool,
}

impl SamplerConfig {
    /// The size of the `EVENTS` ring buffer: larger when samples carry stack copies.
    pub fn ring_bytes(&self) -> u32 {
        if self.stack_copy_bytes > 0 {
            allocbpf_common::RING_BUFFER_BYTES_WITH_STACKS
        } else {
            allocbpf_common::RING_BUFFER_BYTES
        }
    }
}

/// How live tracking observes the return of sampled calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LiveMechanism {
    /// uprobe session links where the kernel has them (6.13+), else uretprobes.
    Auto,
    /// A uretprobe on every allocation call (the fallback; for comparison).
    Uretprobe,
}

/// Sizes of the per-thread state tables (docs/design.md, "Per-thread countdown");
/// by default `THREAD_SLOTS_LEN` and `MAX_OVERFLOW_THREADS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ThreadTables {
    /// Direct-mapped slots (a power of two).
    pub slots: u32,
    /// Overflow hash entries for threads whose slot is taken.
    pub overflow: u32,
}

impl Default for ThreadTables {
    fn default() -> Self {
        Self {
            slots: allocbpf_common::THREAD_SLOTS_LEN,
            overflow: allocbpf_common::MAX_OVERFLOW_THREADS,
        }
    }
}

/// The loaded and attached sampler. Dropping it detaches every probe.
pub struct Sampler {
    ebpf: Ebpf,
    /// Set once a batched lookup failed: the kernel has none, maps are iterated.
    no_batch_lookups: std::sync::atomic::AtomicBool,
    config: SamplerConfig,
    intervals: Option<Array<MapData, u64>>,
    table: IntervalTable,
    logger: Option<EbpfLogger<&'static dyn log::Log>>,
    /// Programs relocated for session links (live tracking, on kernels that have them).
    session_programs: Option<SessionPrograms>,
    /// Programs relocated for uprobe_multi links ([`SamplerConfig::multi_links`]).
    multi_programs: Option<SessionPrograms>,
    /// Exact totals and counters by epoch.
    book: totals::EpochBook,
    /// The window shift of the attach under way ([`Sampler::attach_in_windows`]).
    window_shift: u8,
    /// The process whose own links the attach under way makes ([`Sampler::attach_own`]).
    own_pid: Option<u32>,
    /// The runtimes' per-process maps written so far, with their value sizes
    /// ([`Sampler::set_entry`]).
    runtime_maps: std::collections::BTreeMap<&'static str, usize>,
}

impl Sampler {
    /// Loads `object` (the eBPF program built from `ebpf/allocbpf-ebpf`, 8-byte aligned:
    /// `aya::include_bytes_aligned!`) with its globals set for `config`; nothing is
    /// attached yet.
    pub fn load(object: &[u8], config: SamplerConfig) -> Result<Sampler, ProbeError> {
        let target_pid = config.pid.unwrap_or(0);
        let threshold = certain_threshold(config.rate);
        let tables = config.thread_tables;
        let slot_mask = tables.slots.next_power_of_two() - 1;
        let live_mode = match config.live {
            None => LiveMode::Off,
            Some(LiveMechanism::Auto) if session_link::kernel_supports_sessions() => {
                LiveMode::Session
            }
            Some(LiveMechanism::Auto) => {
                tracing::warn!(
                    "this kernel has no uprobe session links (Linux 6.13+): live tracking uses a uretprobe on every allocation call, which costs about 0.4 us more per call (docs/benchmarks.md)"
                );
                LiveMode::Uretprobe
            }
            Some(LiveMechanism::Uretprobe) => LiveMode::Uretprobe,
        };
        let live_mode_value = live_mode as u32;
        let count_hits = u32::from(config.count_hits);
        let load = |btf: Option<&Btf>| {
            EbpfLoader::new()
                .btf(btf)
                .override_global(TARGET_PID_GLOBAL, &target_pid, true)
                .override_global(COUNT_HITS_GLOBAL, &count_hits, true)
                .override_global(SELF_TGID_GLOBAL, &std::process::id(), true)
                .override_global(RATE_GLOBAL, &config.rate, true)
                .override_global(CERTAIN_THRESHOLD_GLOBAL, &threshold, true)
                .override_global(THREAD_SLOT_MASK_GLOBAL, &slot_mask, true)
                .override_global(LIVE_MODE_GLOBAL, &live_mode_value, true)
                .override_global(STACK_COPY_BYTES_GLOBAL, &config.stack_copy_bytes, true)
                .map_max_entries("THREAD_SLOTS", slot_mask + 1)
                .map_max_entries("THREADS", tables.overflow.max(1))
                .map_max_entries("EVENTS", config.ring_bytes())
                .load(object)
        };
        // Our programs read no kernel structure by its BTF (no CO-RE relocation), so
        // the kernel's BTF, whose parse was most of the agent's peak memory, is read
        // only if a load without it fails.
        let mut ebpf = match load(None) {
            Ok(ebpf) => ebpf,
            Err(error) => {
                tracing::debug!("loading without the kernel's BTF failed ({error}); with it");
                load(Btf::from_sys_fs().ok().as_ref()).map_err(load_error)?
            }
        };
        // Before anything takes maps out of `ebpf`: relocation needs every map's fd.
        let session_programs = (live_mode == LiveMode::Session && !config.empty_probes)
            .then(|| SessionPrograms::relocate(object, &ebpf, LinkKind::Session))
            .transpose()
            .map_err(load_error)?;
        let multi_programs = (config.multi_links && session_link::kernel_supports_multi_links())
            .then(|| SessionPrograms::relocate(object, &ebpf, LinkKind::Multi))
            .transpose()
            .map_err(load_error)?;
        // The eBPF side logs only on rare paths; no log map means nothing to forward.
        let logger = EbpfLogger::init(&mut ebpf).ok();
        let intervals = ebpf
            .take_map("INTERVALS")
            .map(Array::try_from)
            .transpose()
            .map_err(map_error("INTERVALS"))?;
        let book = totals::EpochBook::new(&ebpf, (slot_mask + 1) as usize)?;
        let mut sampler = Sampler {
            ebpf,
            no_batch_lookups: Default::default(),
            config,
            intervals,
            table: IntervalTable::new(config.rate),
            logger,
            session_programs,
            multi_programs,
            book,
            window_shift: 0,
            own_pid: None,
            runtime_maps: Default::default(),
        };
        sampler.refresh_intervals()?;
        if !config.empty_probes {
            sampler.attach_tracepoints()?;
        }
        Ok(sampler)
    }

    /// Writes a fresh table of exponential intervals (see `intervals`).
    pub fn refresh_intervals(&mut self) -> Result<(), ProbeError> {
        let Some(map) = self.intervals.as_mut() else {
            return Ok(());
        };
        let started = std::time::Instant::now();
        let intervals = self.table.generate();
        // Written through a mapping of the table: each entry one aligned store, so a
        // probe reading it meanwhile draws an old interval or a new one, either a
        // draw of the same distribution. Else one system call for the whole table
        // (copying entry by entry in the kernel, the agent's largest periodic cost
        // on a quiet host), else (kernels before 5.6) entry by entry.
        let mapped =
            MappedArray::<u64>::map(map.map().fd().as_fd(), "INTERVALS", 0, intervals.len()).map(
                |table| {
                    for (index, &interval) in intervals.iter().enumerate() {
                        // SAFETY: an entry of the mapping, written whole.
                        unsafe { table.entry(index).write_volatile(interval) };
                    }
                },
            );
        let Err(error) = mapped else {
            tracing::debug!("interval table refreshed in {:?}", started.elapsed());
            return Ok(());
        };
        tracing::debug!("mapping INTERVALS failed ({error}): a batched update");
        if let Err(error) = batch::update_array(map.map(), &intervals) {
            tracing::debug!("batched update of INTERVALS failed ({error}): entry by entry");
            for (index, interval) in intervals.into_iter().enumerate() {
                map.set(index as u32, interval, 0)
                    .map_err(map_error("INTERVALS"))?;
            }
        }
        tracing::debug!("interval table refreshed in {:?}", started.elapsed());
        Ok(())
    }

    /// Attaches the thread-exit tracepoint and, system-wide, the exec tracepoint.
    fn attach_tracepoints(&mut self) -> Result<(), ProbeError> {
        let mut names = vec![("thread_exit", "sched_process_exit")];
        if self.config.pid.is_none() {
            names.push(("process_exec", "sched_process_exec"));
        }
        for (name, tracepoint) in names {
            let program: &mut RawTracePoint = program_of(&mut self.ebpf, name)?;
            program.load().map_err(load_error)?;
            program.attach(tracepoint).map_err(load_error)?;
        }
        Ok(())
    }

    /// Takes the ring buffers (once), for their reader: the sample ring and its size
    /// ([`SamplerConfig::ring_bytes`]), and the ring of samples it had no room for.
    pub fn take_events(&mut self) -> Result<EventRings, ProbeError> {
        let mut take = |name: &'static str| {
            let map = self
                .ebpf
                .take_map(name)
                .ok_or_else(|| load_error(missing(name)))?;
            RingBuf::try_from(map).map_err(map_error(name))
        };
        Ok(EventRings {
            events: take("EVENTS")?,
            lost: take(LOST_MAP)?,
            events_bytes: self.config.ring_bytes(),
        })
    }

    /// The ring-pressure level in force: sampling intervals are `rate << level`
    /// (0 while the reader keeps up).
    pub fn pressure_level(&self) -> u32 {
        self.ebpf
            .map(PRESSURE_MAP)
            .and_then(|map| Array::<_, u64>::try_from(map).ok())
            .and_then(|array| array.get(&0, 0).ok())
            .map_or(0, |level| level as u32)
    }

    /// Forwards pending eBPF log records to the `log` facade.
    pub fn flush_logs(&mut self) {
        if let Some(logger) = self.logger.as_mut() {
            logger.flush();
        }
    }

    /// Reads the per-CPU counters, summed over CPUs.
    pub fn counters(&self) -> Result<Counters, ProbeError> {
        Ok(counters_from(self.book.counters(&self.ebpf, None)?))
    }

    /// The kernel's counters of one epoch only (see [`Sampler::next_epoch`]).
    pub fn counters_of(&self, epoch: u64) -> Result<Counters, ProbeError> {
        Ok(counters_from(self.book.counters(&self.ebpf, Some(epoch))?))
    }

    /// Exact totals per process of the current epoch (all of them, for a sampler whose
    /// epoch never moved). Read after detaching and `wait_for_running_programs`.
    pub fn totals(&mut self) -> Result<std::collections::HashMap<u32, Totals>, ProbeError> {
        let epoch = self.book.epoch();
        self.book.window(&mut self.ebpf, epoch)
    }

    /// Exact totals per process of an ended `epoch`, read after
    /// `wait_for_running_programs`. Each epoch is read once.
    pub fn totals_of(
        &mut self,
        epoch: u64,
    ) -> Result<std::collections::HashMap<u32, Totals>, ProbeError> {
        self.book.window(&mut self.ebpf, epoch)
    }

    /// Starts a new epoch and returns the one that ended: an interval cut that does
    /// not stop the probes (`totals.rs`).
    pub fn next_epoch(&mut self) -> Result<u64, ProbeError> {
        self.book.next_epoch(&mut self.ebpf)
    }

    /// The epoch calls are counted under now.
    pub fn epoch(&self) -> u64 {
        self.book.epoch()
    }

    /// Collects the counts of threads that exited and frees their entries, so the
    /// thread tables hold running threads only. Call about once a second.
    pub fn collect_exited_threads(&mut self) -> usize {
        self.book.collect_exited_if_any(&mut self.ebpf)
    }
}

/// The counters from values indexed by [`Counter`].
fn counters_from(values: [u64; COUNTER_COUNT as usize]) -> Counters {
    let at = |counter: Counter| values[counter as usize];
    Counters {
        samples: at(Counter::Samples),
        ring_buffer_drops: at(Counter::RingBufferDrops),
        stack_errors: at(Counter::StackErrors),
        thread_map_full: at(Counter::ThreadMapFull),
        process_map_full: at(Counter::ProcessMapFull),
        forwarded_calls: at(Counter::ForwardedCalls),
        live_map_full: at(Counter::LiveMapFull),
        live_frees: at(Counter::LiveFrees),
        live_returns: at(Counter::LiveReturns),
        lost_unrecorded: at(Counter::LostUnrecorded),
        pressure_raises: at(Counter::PressureRaises),
    }
}

/// The ring buffers of a sampler, for [`crate::events::EventReader::new`].
pub struct EventRings {
    /// Sampled allocations and process events.
    pub events: RingBuf<MapData>,
    /// Samples `events` had no room for ([`allocbpf_common::LostSample`]).
    pub lost: RingBuf<MapData>,
    /// The size of `events` in bytes.
    pub events_bytes: u32,
}

/// Returns once every eBPF program run that started before the call has finished.
///
/// uprobe programs run inside an RCU read-side critical section (non-sleepable BPF
/// programs always do), and `membarrier(MEMBARRIER_CMD_GLOBAL)` waits for an RCU grace
/// period (`synchronize_rcu`). After detaching, this closes the window in which a
/// probe that trapped before the detach still counts a call or submits a sample.
pub fn wait_for_running_programs() {
    const MEMBARRIER_CMD_GLOBAL: libc::c_long = 1;
    // SAFETY: a plain syscall with integer arguments.
    let result = unsafe { libc::syscall(libc::SYS_membarrier, MEMBARRIER_CMD_GLOBAL, 0, 0) };
    if result != 0 {
        // Without it (membarrier disabled), a short sleep covers a program run, which
        // lasts microseconds.
        tracing::debug!("membarrier: {}", std::io::Error::last_os_error());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// CLOCK_MONOTONIC now, the clock of `bpf_ktime_get_ns()` (the samples' timestamps).
pub fn monotonic_now_ns() -> u64 {
    // CLOCK_MONOTONIC always exists.
    clock_ns(libc::CLOCK_MONOTONIC).unwrap_or(0)
}

/// Clock `clock` now, in nanoseconds (`None`: no such clock, e.g. a process CPU clock
/// of a process that is gone).
pub fn clock_ns(clock: libc::clockid_t) -> Option<u64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-parameter; a bad clock id fails with EINVAL.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    (rc == 0).then(|| ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
}

/// Program `name` of the embedded object, as its aya type.
fn program_of<'a, T>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut T, ProbeError>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program, Error = aya::programs::ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or_else(|| load_error(missing(name)))?
        .try_into()
        .map_err(load_error)
}

fn missing(name: &str) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::NotFound,
        format!("`{name}` is missing from the embedded eBPF object"),
    )
}
