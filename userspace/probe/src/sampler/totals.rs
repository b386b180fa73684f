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
//! keyed by (pid, epoch) and frees the entries; between cuts it looks only when the
//! kernel's count of frozen entries (`Counter::ThreadsFrozen`) has moved.
//! `THREAD_SLOTS` is memory-mapped for that scan, a chunk at a time
//! (`thread_slots.rs`): not a system call per slot.

use std::collections::HashMap;

use allocbpf_common::{
    Counter, EpochCounts, ProcessCounts, ThreadState, Totals, COUNTER_COUNT, COUNTER_SLOTS,
    EPOCH_MAP,
};
use aya::{
    maps::{Array, HashMap as BpfHashMap, MapData, PerCpuArray, PerCpuHashMap, PerCpuValues},
    Ebpf,
};

use super::{load_error, map_error, missing, thread_slots::SlotTable, ProbeError};

/// The userspace side of the epochs: the current epoch, the counts of collected
/// exited threads, and the counters of zeroed counter sets.
pub struct EpochBook {
    slots: SlotTable,
    /// The epoch probes count under now.
    epoch: u64,
    /// The latest epoch whose window was read; frozen counts of it or older were read
    /// then (from the live entry) and are not collected again.
    read_through: Option<u64>,
    /// Counts of collected exited threads, by (pid, epoch).
    carry: HashMap<(u32, u64), Totals>,
    /// Counter values of counter sets zeroed for reuse.
    retired: [u64; COUNTER_COUNT as usize],
    /// `Counter::ThreadsFrozen` when the thread tables were last scanned, and when.
    frozen_at_scan: Option<(u64, std::time::Instant)>,
}

/// The thread tables are scanned for frozen entries at least this often even if the
/// kernel counted no new one. Defensive: a freeze counts in the current epoch's set,
/// and `next_epoch` retires the other one, whose writers were waited for at the cut
/// before; but a count lost anyhow must not leave an entry frozen for good.
const SCAN_AT_LEAST_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

impl EpochBook {
    /// Maps `THREAD_SLOTS` (`slots` entries) of the loaded object.
    pub fn new(ebpf: &Ebpf, slots: usize) -> Result<EpochBook, ProbeError> {
        let map = ebpf
            .map("THREAD_SLOTS")
            .ok_or_else(|| load_error(missing("THREAD_SLOTS")))?;
        Ok(EpochBook {
            slots: SlotTable::new(map, slots)?,
            epoch: 0,
            read_through: None,
            carry: HashMap::new(),
            retired: [0; COUNTER_COUNT as usize],
            frozen_at_scan: None,
        })
    }

    /// The epoch probes count under now.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// [`EpochBook::collect_exited`], if the kernel froze an entry since the last scan
    /// (or [`SCAN_AT_LEAST_EVERY`] has passed): a host whose threads live long pays
    /// two counter reads a call, not a scan of the tables.
    pub fn collect_exited_if_any(&mut self, ebpf: &mut Ebpf) -> usize {
        let frozen = match self.counter_total(ebpf, Counter::ThreadsFrozen) {
            Ok(frozen) => frozen,
            Err(error) => {
                tracing::debug!("frozen thread count unread ({error}): scanning");
                return self.collect_exited(ebpf);
            }
        };
        if let Some((at_scan, when)) = self.frozen_at_scan {
            if at_scan == frozen && when.elapsed() < SCAN_AT_LEAST_EVERY {
                return 0;
            }
        }
        // Read before the scan: a freeze after the read is seen at the next call.
        let freed = self.collect_exited(ebpf);
        self.frozen_at_scan = Some((frozen, std::time::Instant::now()));
        freed
    }

    /// `counter`'s count since load: its two counter sets and what was retired of them.
    fn counter_total(&self, ebpf: &Ebpf, counter: Counter) -> Result<u64, ProbeError> {
        let array = counters_array(ebpf)?;
        let mut total = self.retired[counter as usize];
        for parity in 0..2 {
            total += slot_sum(&array, parity * COUNTER_COUNT + counter as u32)?;
        }
        Ok(total)
    }

    /// Moves the counts of exited threads into the carry and frees their entries.
    /// Returns how many were freed.
    pub fn collect_exited(&mut self, ebpf: &mut Ebpf) -> usize {
        let mut freed = 0;
        let mut frozen = Vec::new();
        let mapped = self.slots.for_each_chunk(|chunk| {
            for index in 0..chunk.len() {
                if let Some(state) = chunk.get(index).filter(|state| state.exited != 0) {
                    frozen.push(state);
                    chunk.free(index);
                    freed += 1;
                }
            }
        });
        if let Err(error) = mapped {
            // Collected at the next call; until then their slots stay taken.
            tracing::warn!("exited threads not collected: {error}");
        }
        for state in &frozen {
            self.keep(state);
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
        self.slots.for_each_chunk(|chunk| {
            for state in (0..chunk.len()).filter_map(|index| chunk.get(index)) {
                state.counts.iter().for_each(|half| add(state.pid, half));
            }
        })?;
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
        let array = counters_array(ebpf)?;
        let mut values = match epoch {
            Some(_) => [0; COUNTER_COUNT as usize],
            None => self.retired,
        };
        for slot in 0..COUNTER_SLOTS {
            let (parity, counter) = (slot / COUNTER_COUNT, slot % COUNTER_COUNT);
            if epoch.is_some_and(|e| (e & 1) as u32 != parity) {
                continue;
            }
            values[counter as usize] += slot_sum(&array, slot)?;
        }
        Ok(values)
    }
}

/// The loaded object's `COUNTERS`, to read.
fn counters_array(ebpf: &Ebpf) -> Result<PerCpuArray<&MapData, u64>, ProbeError> {
    let map = ebpf
        .map("COUNTERS")
        .ok_or_else(|| load_error(missing("COUNTERS")))?;
    PerCpuArray::try_from(map).map_err(map_error("COUNTERS"))
}

/// Counter slot `slot` of `COUNTERS`, summed over CPUs.
fn slot_sum(array: &PerCpuArray<&MapData, u64>, slot: u32) -> Result<u64, ProbeError> {
    Ok(array
        .get(&slot, 0)
        .map_err(map_error("COUNTERS"))?
        .iter()
        .sum())
}
