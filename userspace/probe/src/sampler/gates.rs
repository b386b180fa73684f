//! The kernel's per-process gates (system-wide mode): probe hits per process, and
//! which processes are not sampled. See `ebpf/allocbpf-ebpf/src/process.rs`.

use std::{
    collections::{HashMap, HashSet},
    sync::atomic::Ordering,
};

use allocbpf_common::{GateState, LiveKey, ProcessCounts, ProcessGate, MAX_COARSENING};
use aya::maps::{HashMap as BpfHashMap, Map, PerCpuHashMap, PerCpuValues};

use super::{map_error, ProbeError, Sampler};

impl Sampler {
    /// Sets `pid`'s gate, keeping the hits counted so far.
    pub fn set_gate(&mut self, pid: u32, state: GateState) -> Result<(), ProbeError> {
        self.update_gate(pid, |gate| gate.state = state as u32)
    }

    /// Sets `pid`'s coarsening (its sampling interval raised `2^coarsening` times, at
    /// most [`MAX_COARSENING`]), keeping the hits counted so far.
    pub fn set_coarsening(&mut self, pid: u32, coarsening: u32) -> Result<(), ProbeError> {
        let coarsening = coarsening.min(MAX_COARSENING);
        self.update_gate(pid, |gate| gate.coarsening = coarsening)
    }

    /// Applies `change` to each CPU's copy of `pid`'s gate (a new gate if it has none).
    fn update_gate(
        &mut self,
        pid: u32,
        change: impl Fn(&mut ProcessGate),
    ) -> Result<(), ProbeError> {
        let map = self
            .ebpf
            .map_mut("PROCESS_GATES")
            .ok_or_else(|| super::load_error(super::missing("PROCESS_GATES")))?;
        let mut gates = PerCpuHashMap::<_, u32, ProcessGate>::try_from(map)
            .map_err(map_error("PROCESS_GATES"))?;
        let cpus = aya::util::nr_cpus().map_err(|(_, e)| super::load_error(e))?;
        // A racing increment on another CPU between this read and the write is lost: a
        // hit or two in the budget estimate, never a sample.
        let mut values: Vec<ProcessGate> = match gates.get(&pid, 0) {
            Ok(current) => current.iter().copied().collect(),
            Err(_) => vec![ProcessGate::default(); cpus],
        };
        values.iter_mut().for_each(change);
        let values = PerCpuValues::try_from(values).map_err(super::load_error)?;
        gates
            .insert(pid, values, 0)
            .map_err(map_error("PROCESS_GATES"))
    }

    /// Attaches the empty program at `offset` of file `path`, for process `pid` only
    /// (the budget's calibration of a single-stepped probe).
    pub fn attach_empty_at(
        &mut self,
        path: &std::path::Path,
        offset: u64,
        pid: u32,
    ) -> Result<super::EmptyLink, ProbeError> {
        use aya::programs::uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeScope};
        let program: &mut aya::programs::UProbe = super::program_of(&mut self.ebpf, "probe_empty")?;
        if program.fd().is_err() {
            program.load().map_err(super::load_error)?;
        }
        let scope = match std::num::NonZeroU32::new(pid) {
            Some(pid) => UProbeScope::OneProcess(pid),
            None => UProbeScope::AllProcesses,
        };
        let point = UProbeAttachPoint {
            location: UProbeAttachLocation::AbsoluteOffset(offset),
            cookie: None,
        };
        program
            .attach(point, path, scope)
            .map_err(|source| ProbeError::Attach {
                symbol: format!("+{offset:#x}"),
                path: path.display().to_string(),
                source: Box::new(source),
            })
    }

    /// Detaches what [`Sampler::attach_empty_at`] attached.
    pub fn detach_empty(&mut self, link: super::EmptyLink) {
        if let Ok(program) =
            super::program_of::<aya::programs::UProbe>(&mut self.ebpf, "probe_empty")
        {
            let _ = program.detach(link);
        }
    }

    /// Probe hits per process counted in the kernel since it was first seen, summed
    /// over CPUs: all of them, those at single-stepped probe points and the time its
    /// sampled hits spent recording samples, with its gate state (the largest).
    pub fn gate_hits(&self) -> Result<HashMap<u32, ProcessGate>, ProbeError> {
        let map = self
            .ebpf
            .map("PROCESS_GATES")
            .ok_or_else(|| super::load_error(super::missing("PROCESS_GATES")))?;
        // Read several times a second with an entry per process: a few batched calls,
        // not two calls an entry.
        let batched = !self.no_batch_lookups.load(Ordering::Relaxed);
        if let (true, Map::PerCpuHashMap(data) | Map::PerCpuLruHashMap(data), Ok(cpus)) =
            (batched, map, aya::util::nr_cpus())
        {
            match super::batch::lookup_per_cpu_hash::<u32, ProcessGate>(data, cpus) {
                Ok(entries) => {
                    return Ok(entries
                        .into_iter()
                        .map(|(pid, values)| (pid, summed(&values)))
                        .collect())
                }
                Err(error) => {
                    // A kernel without batched lookups (before 5.6) refuses every one.
                    tracing::debug!(
                        "PROCESS_GATES: batched lookup failed ({error}): iterating from now on"
                    );
                    self.no_batch_lookups.store(true, Ordering::Relaxed);
                }
            }
        }
        let gates = PerCpuHashMap::<_, u32, ProcessGate>::try_from(map)
            .map_err(map_error("PROCESS_GATES"))?;
        Ok(gates
            .iter()
            .flatten()
            .map(|(pid, values)| (pid, summed(&values)))
            .collect())
    }

    /// `pid`'s gate as [`Sampler::gate_hits`] gives it, by one lookup: for the budget's
    /// readings at every window change (`None`: no entry).
    pub fn gate_hits_of(&self, pid: u32) -> Option<ProcessGate> {
        let map = self.ebpf.map("PROCESS_GATES")?;
        let gates = PerCpuHashMap::<_, u32, ProcessGate>::try_from(map).ok()?;
        Some(summed(&gates.get(&pid, 0).ok()?))
    }

    /// Every process the kernel maps keep an entry for (totals kept without a thread
    /// entry, gates): with [`Sampler::forget_processes`], a backstop for exit events
    /// lost to a full ring buffer, after which those entries would stay for good.
    pub fn kernel_pids(&self) -> HashSet<u32> {
        let mut pids = HashSet::new();
        if let Some(map) = self.ebpf.map("PROCESS_TOTALS") {
            if let Ok(totals) = PerCpuHashMap::<_, u32, ProcessCounts>::try_from(map) {
                pids.extend(totals.keys().flatten());
            }
        }
        if let Some(map) = self.ebpf.map("PROCESS_GATES") {
            if let Ok(gates) = PerCpuHashMap::<_, u32, ProcessGate>::try_from(map) {
                pids.extend(gates.keys().flatten());
            }
        }
        pids
    }

    /// The sample ids of the blocks the kernel tracks as live now (`LIVE`), by pid:
    /// with `Aggregate::forget_lost_frees` (allocbpf-profile), a block userspace
    /// holds live and the kernel does not was freed, and its `Freed` event lost.
    pub fn live_sample_ids(&self) -> HashMap<u32, HashSet<u64>> {
        let mut ids: HashMap<u32, HashSet<u64>> = HashMap::new();
        if let Some(map) = self.ebpf.map("LIVE") {
            if let Ok(live) = BpfHashMap::<_, LiveKey, u64>::try_from(map) {
                for (key, id) in live.iter().flatten() {
                    ids.entry(key.pid).or_default().insert(id);
                }
            }
        }
        ids
    }

    /// Forgets the kernel's live entries of the sampled blocks in `expired` (pid, sample
    /// id pairs): blocks userspace stopped following (a budget window closed), whose
    /// free may never be seen. Without this they would hold `LIVE` entries until their
    /// process exits. Returns how many went.
    pub fn forget_live_blocks(&mut self, expired: &HashSet<(u32, u64)>) -> usize {
        if expired.is_empty() {
            return 0;
        }
        let Some(map) = self.ebpf.map_mut("LIVE") else {
            return 0;
        };
        let Ok(mut live) = BpfHashMap::<_, LiveKey, u64>::try_from(map) else {
            return 0;
        };
        let gone: Vec<LiveKey> = live
            .iter()
            .flatten()
            .filter(|(key, id)| expired.contains(&(key.pid, *id)))
            .map(|(key, _)| key)
            .collect();
        for key in &gone {
            let _ = live.remove(key);
        }
        gone.len()
    }

    /// Forgets processes that exited: their kept totals, gates and tracked live blocks,
    /// so the bounded maps hold running processes only (system-wide mode).
    pub fn forget_processes(&mut self, pids: &HashSet<u32>) {
        if pids.is_empty() {
            return;
        }
        if let Some(map) = self.ebpf.map_mut("PROCESS_TOTALS") {
            if let Ok(mut totals) = PerCpuHashMap::<_, u32, ProcessCounts>::try_from(map) {
                for pid in pids {
                    let _ = totals.remove(pid);
                }
            }
        }
        if let Some(map) = self.ebpf.map_mut("PROCESS_GATES") {
            if let Ok(mut gates) = PerCpuHashMap::<_, u32, ProcessGate>::try_from(map) {
                for pid in pids {
                    let _ = gates.remove(pid);
                }
            }
        }
        for pid in pids {
            self.forget_entries(*pid);
        }
        if let Some(map) = self.ebpf.map_mut("LIVE") {
            if let Ok(mut live) = BpfHashMap::<_, LiveKey, u64>::try_from(map) {
                let stale: Vec<LiveKey> = live
                    .keys()
                    .flatten()
                    .filter(|key| pids.contains(&key.pid))
                    .collect();
                for key in stale {
                    let _ = live.remove(&key);
                }
            }
        }
    }
}

/// A gate's per-CPU copies summed (the state and coarsening: the largest).
fn summed(values: &[ProcessGate]) -> ProcessGate {
    ProcessGate {
        hits: values.iter().map(|g| g.hits).sum(),
        stepped_hits: values.iter().map(|g| g.stepped_hits).sum(),
        sample_ns: values.iter().map(|g| g.sample_ns).sum(),
        state: values.iter().map(|g| g.state).max().unwrap_or(0),
        coarsening: values.iter().map(|g| g.coarsening).max().unwrap_or(0),
    }
}
