//! Exact totals and counters by epoch: what the kernel counted in one window.
//!
//! Every probe run reads the `EPOCH` map once and counts its call, its sample and the
//! sample counter under that epoch (`allocbpf_common::EpochCounts`). To cut an
//! interval without stopping the probes, the agent:
//! 1. zeroes the counter set the next epoch will use (its previous epoch was read at
//!    the cut before), keeping its values in a running sum for the metrics;
//! 2. increments `EPOCH`;
//! 3. waits for running programs (`wait_for_running_programs`): no run still counts
//!    under the closed epoch;
//! 4. reads the closed epoch's totals ([`EpochBook::window`]) and counters, and drains
//!    the ring buffer, keeping samples of the new epoch for the next interval.
//!
//! Threads that exit leave their entry frozen (`ThreadState::exited`) rather than
//! moving their counts elsewhere, so a reader never sees counts twice or not at all;
//! [`EpochBook::collect_exited`] moves frozen entries' counts into a userspace carry
//! keyed by (pid, epoch) and frees the entries. `THREAD_SLOTS` is memory-mapped for
//! that scan: 65,536 slots are read in about a millisecond, not 65,536 system calls.

use std::collections::HashMap;

use allocbpf_common::{
    EpochCounts, ProcessCounts, ThreadState, Totals, COUNTER_COUNT, COUNTER_SLOTS, EPOCH_MAP,
};
use aya::{
    maps::{Array, HashMap as BpfHashMap, Map, PerCpuArray, PerCpuHashMap, PerCpuValues},
    Ebpf,
};

use super::{load_error, map_error, missing, ProbeError};

/// `THREAD_SLOTS`, mapped into our address space.
struct MappedSlots {
    base: *mut ThreadState,
    len: usize,
    bytes: usize,
}

// SAFETY: the mapping is owned by this value; access goes through `&self`/`&mut self`.
unsafe impl Send for MappedSlots {}

impl MappedSlots {
    /// Maps the `len` slots of the (`BPF_F_MMAPABLE`) array `map`.
    fn map(map: &Map, len: usize) -> Result<MappedSlots, ProbeError> {
        use std::os::fd::{AsFd, AsRawFd};
        let Map::Array(data) = map else {
            return Err(load_error(missing("THREAD_SLOTS array")));
        };
        let page = 4096;
        let bytes = (len * std::mem::size_of::<ThreadState>()).div_ceil(page) * page;
        // SAFETY: a shared mapping of a BPF array fd, with its own size.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                data.fd().as_fd().as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(ProbeError::System {
                map: "THREAD_SLOTS",
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(MappedSlots {
            base: base.cast(),
            len,
            bytes,
        })
    }

    /// A copy of slot `index`, or `None` for a free slot. `tid` and `exited` are read
    /// first: a slot being claimed meanwhile (a free slot holds zero counts, see
    /// [`MappedSlots::free`]) shows at worst a new thread's zero counts.
    fn get(&self, index: usize) -> Option<ThreadState> {
        assert!(index < self.len);
        // SAFETY: in bounds of the mapping; the kernel may write concurrently, which
        // volatile reads tolerate (only frozen or closed-epoch fields are used).
        unsafe {
            let slot = self.base.add(index);
            if std::ptr::addr_of!((*slot).tid).read_volatile() == 0 {
                return None;
            }
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            Some(std::ptr::read_volatile(slot))
        }
    }

    /// Frees a frozen slot: its counts are zeroed (still frozen), then `tid`, so a thread claiming it
    /// (which checks `tid == 0`, then writes the whole slot) never meets stale counts
    /// or a stale `exited`.
    fn free(&self, index: usize) {
        assert!(index < self.len);
        // SAFETY: in bounds; a frozen slot has no other writer until `tid` is 0.
        unsafe {
            let slot = self.base.add(index);
            let tid = (*slot).tid;
            std::ptr::write_volatile(
                slot,
                // Still frozen: a thread reusing the tid must not adopt it half-zeroed.
                ThreadState {
                    tid,
                    exited: 1,
                    ..ThreadState::default()
                },
            );
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            std::ptr::addr_of_mut!((*slot).tid).write_volatile(0);
        }
    }
}

impl Drop for MappedSlots {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `map` mapped.
        unsafe { libc::munmap(self.base.cast(), self.bytes) };
    }
}

/// The userspace side of the epochs: the current epoch, the counts of collected
/// exited threads, and the counters of zeroed counter sets.
pub struct EpochBook {
    slots: MappedSlots,
    /// The epoch probes count under now.
    epoch: u64,
    /// The latest epoch whose window was read; frozen counts of it or older were read
    /// then (from the live entry) and are not collected again.
    read_through: Option<u64>,
    /// Counts of collected exited threads, by (pid, epoch).
    carry: HashMap<(u32, u64), Totals>,
    /// Counter values of counter sets zeroed for reuse.
    retired: [u64; COUNTER_COUNT as usize],
}

impl EpochBook {
    /// Maps `THREAD_SLOTS` (`slots` entries) of the loaded object.
    pub fn new(ebpf: &Ebpf, slots: usize) -> Result<EpochBook, ProbeError> {
        let map = ebpf
            .map("THREAD_SLOTS")
            .ok_or_else(|| load_error(missing("THREAD_SLOTS")))?;
        Ok(EpochBook {
            slots: MappedSlots::map(map, slots)?,
            epoch: 0,
            read_through: None,
            carry: HashMap::new(),
            retired: [0; COUNTER_COUNT as usize],
        })
    }

    /// The epoch probes count under now.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Moves the counts of exited threads into the carry and frees their entries.
    /// Returns how many were freed.
    pub fn collect_exited(&mut self, ebpf: &mut Ebpf) -> usize {
        let mut freed = 0;
        for index in 0..self.slots.len {
            let Some(state) = self.slots.get(index) else {
                continue;
            };
            if state.exited != 0 {
                self.keep(&state);
                self.slots.free(index);
                freed += 1;
            }
        }
        if let Some(map) = ebpf.map_mut("THREADS") {
            if let Ok(mut threads) = BpfHashMap::<_, u32, ThreadState>::try_from(map) {
                let exited: Vec<(u32, ThreadState)> = threads
                    .iter()
                    .flatten()
                    .filter(|(_, state)| state.exited != 0)
                    .collect();
                for (tid, state) in exited {
                    self.keep(&state);
                    let _ = threads.remove(&tid);
                    freed += 1;
                }
            }
        }
        freed
    }

    /// Adds a frozen entry's unread counts to the carry.
    fn keep(&mut self, state: &ThreadState) {
        for half in &state.counts {
            let unread = self.read_through.is_none_or(|read| half.epoch > read);
            if half.calls > 0 && unread {
                let carried = self.carry.entry((state.pid, half.epoch)).or_default();
                carried.calls += half.calls;
                carried.bytes += half.bytes;
            }
        }
    }

    /// Starts the next epoch and returns the one that ends. Call
    /// `wait_for_running_programs` before reading the ended epoch.
    pub fn next_epoch(&mut self, ebpf: &mut Ebpf) -> Result<u64, ProbeError> {
        let ended = self.epoch;
        let next = ended + 1;
        // The counter set `next` will use last served `ended - 1`, read at the cut
        // before: retire its values and zero it.
        let map = ebpf
            .map_mut("COUNTERS")
            .ok_or_else(|| load_error(missing("COUNTERS")))?;
        let mut counters = PerCpuArray::<_, u64>::try_from(map).map_err(map_error("COUNTERS"))?;
        let cpus = aya::util::nr_cpus().map_err(|(_, source)| ProbeError::System {
            map: "COUNTERS",
            source,
        })?;
        let base = (next & 1) as u32 * COUNTER_COUNT;
        for counter in 0..COUNTER_COUNT {
            let values = counters
                .get(&(base + counter), 0)
                .map_err(map_error("COUNTERS"))?;
            self.retired[counter as usize] += values.iter().sum::<u64>();
            let zeros =
                PerCpuValues::try_from(vec![0u64; cpus]).map_err(|source| ProbeError::System {
                    map: "COUNTERS",
                    source,
                })?;
            counters
                .set(base + counter, zeros, 0)
                .map_err(map_error("COUNTERS"))?;
        }
        let map = ebpf
            .map_mut(EPOCH_MAP)
            .ok_or_else(|| load_error(missing(EPOCH_MAP)))?;
        let mut epoch = Array::<_, u64>::try_from(map).map_err(map_error(EPOCH_MAP))?;
        epoch.set(0, next, 0).map_err(map_error(EPOCH_MAP))?;
        self.epoch = next;
        Ok(ended)
    }

    /// Exact totals per process of `epoch`, which must have ended (after
    /// `wait_for_running_programs`), or be the current one with every probe detached.
    /// Each epoch is read once: its carried counts are consumed.
    pub fn window(
        &mut self,
        ebpf: &mut Ebpf,
        epoch: u64,
    ) -> Result<HashMap<u32, Totals>, ProbeError> {
        let started = std::time::Instant::now();
        self.collect_exited(ebpf);
        let mut totals: HashMap<u32, Totals> = HashMap::new();
        let mut add = |pid: u32, half: &EpochCounts| {
            if half.epoch == epoch && half.calls > 0 {
                let entry = totals.entry(pid).or_default();
                entry.calls += half.calls;
                entry.bytes += half.bytes;
            }
        };
        for index in 0..self.slots.len {
            if let Some(state) = self.slots.get(index) {
                state.counts.iter().for_each(|half| add(state.pid, half));
            }
        }
        if let Some(map) = ebpf.map("THREADS") {
            let threads =
                BpfHashMap::<_, u32, ThreadState>::try_from(map).map_err(map_error("THREADS"))?;
            for (_, state) in threads.iter().flatten() {
                state.counts.iter().for_each(|half| add(state.pid, half));
            }
        }
        if let Some(map) = ebpf.map("PROCESS_TOTALS") {
            let per_process = PerCpuHashMap::<_, u32, ProcessCounts>::try_from(map)
                .map_err(map_error("PROCESS_TOTALS"))?;
            // Entries may vanish while we iterate; a failed item is skipped, not fatal.
            for (pid, values) in per_process.iter().flatten() {
                for value in values.iter() {
                    value.halves.iter().for_each(|half| add(pid, half));
                }
            }
        }
        self.carry.retain(|&(pid, of), carried| {
            if of != epoch {
                return of > epoch;
            }
            let entry = totals.entry(pid).or_default();
            entry.calls += carried.calls;
            entry.bytes += carried.bytes;
            false
        });
        self.read_through = Some(epoch);
        tracing::debug!(
            "exact totals of epoch {epoch} read in {:?}",
            started.elapsed()
        );
        Ok(totals)
    }

    /// Counter values: of `epoch`'s counter set, or (`None`) everything since load.
    pub fn counters(
        &self,
        ebpf: &Ebpf,
        epoch: Option<u64>,
    ) -> Result<[u64; COUNTER_COUNT as usize], ProbeError> {
        let map = ebpf
            .map("COUNTERS")
            .ok_or_else(|| load_error(missing("COUNTERS")))?;
        let array = PerCpuArray::<_, u64>::try_from(map).map_err(map_error("COUNTERS"))?;
        let mut values = match epoch {
            Some(_) => [0; COUNTER_COUNT as usize],
            None => self.retired,
        };
        for slot in 0..COUNTER_SLOTS {
            let (parity, counter) = (slot / COUNTER_COUNT, slot % COUNTER_COUNT);
            if epoch.is_some_and(|e| (e & 1) as u32 != parity) {
                continue;
            }
            let sum: u64 = array
                .get(&slot, 0)
                .map_err(map_error("COUNTERS"))?
                .iter()
                .sum();
            values[counter as usize] += sum;
        }
        Ok(values)
    }
}
