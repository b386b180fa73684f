//! What Pyroscope holds compared with the agent's local store: per process (the
//! merged profile of each sample type over the run) and per stored profile (its
//! interval alone), totals and every stack exactly.

use std::{
    collections::BTreeMap,
    thread,
    time::{Duration, Instant},
};

use anyhow::{ensure, Context, Result};

use super::{profile_type_id, Pyroscope};
use crate::stores::{sum_stored, Stack, StoredProfile};

impl Pyroscope {
    /// Compares, per process of `stored`, what Pyroscope holds with the sum of the
    /// process's stored profiles: for every sample type of the store, the merged
    /// profile of `{name}:{type}:{unit}:space:bytes` over `selector(pid)` and the
    /// profiles' time range has the same total, the same five heaviest stacks, and
    /// indeed every stack with the same value.
    /// Returns how many (process, type) pairs were compared.
    pub fn check_matches_store(
        &self,
        stored: &[StoredProfile],
        name: &str,
        selector: &dyn Fn(u32) -> String,
        tenant: Option<&str>,
    ) -> Result<usize> {
        let mut pids: Vec<u32> = stored.iter().map(|p| p.pid).collect();
        pids.sort_unstable();
        pids.dedup();
        let mut compared = 0;
        for pid in pids {
            let mine: Vec<&StoredProfile> = stored.iter().filter(|p| p.pid == pid).collect();
            let (start_ms, end_ms) = time_range(&mine);
            let sum = sum_stored(mine.iter().copied());
            for (sample_type, total) in &sum.totals {
                let type_id = profile_type_id(name, sample_type);
                let got =
                    self.select_merge_profile(&type_id, &selector(pid), start_ms, end_ms, tenant)?;
                ensure!(
                    got.total == *total,
                    "pid {pid} {type_id}: Pyroscope has {} where the {} stored profiles sum \
                     to {total} ({:+})",
                    got.total,
                    mine.len(),
                    got.total - total
                );
                ensure!(
                    got.top(5) == sum.top(sample_type, 5),
                    "pid {pid} {type_id}: top stacks differ:\nPyroscope {:?}\nstored {:?}",
                    got.top(5),
                    sum.top(sample_type, 5)
                );
                same_stacks(&got.stacks, sum.stacks.get(sample_type))
                    .with_context(|| format!("pid {pid} {type_id}"))?;
                compared += 1;
            }
        }
        Ok(compared)
    }

    /// Compares each stored profile on its own: the profiles of `selector(pid)`
    /// stamped with its start (to the millisecond; the process's next one starts an
    /// interval later) have, for every sample type of it, its total and its stacks
    /// (the five heaviest first, for the message). One profile missing, sent twice, or altered (differenced
    /// against the one before, say) fails here. Returns how many (profile, type) pairs
    /// were compared.
    pub fn check_each_profile(
        &self,
        stored: &[StoredProfile],
        name: &str,
        selector: &dyn Fn(u32) -> String,
        tenant: Option<&str>,
    ) -> Result<usize> {
        let mut compared = 0;
        for profile in stored {
            let ms = profile.time_nanos / 1_000_000;
            for (sample_type, total) in &profile.totals {
                let type_id = profile_type_id(name, sample_type);
                let got = self.select_merge_profile(
                    &type_id,
                    &selector(profile.pid),
                    ms,
                    ms + 1,
                    tenant,
                )?;
                ensure!(
                    got.total == *total,
                    "{} {type_id}: Pyroscope has {} at {ms} ms where the store has {total}",
                    profile.path.display(),
                    got.total
                );
                ensure!(
                    got.top(5) == profile.top(sample_type, 5),
                    "{} {type_id}: top stacks differ:\nPyroscope {:?}\nstored {:?}",
                    profile.path.display(),
                    got.top(5),
                    profile.top(sample_type, 5)
                );
                same_stacks(&got.stacks, profile.stacks.get(sample_type))
                    .with_context(|| format!("{} {type_id}", profile.path.display()))?;
                compared += 1;
            }
        }
        Ok(compared)
    }

    /// Polls [`Pyroscope::check_matches_store`] until it holds (what was pushed may
    /// take a moment to be queryable); fails with its last error after `timeout`.
    pub fn wait_matches_store(
        &self,
        stored: &[StoredProfile],
        name: &str,
        selector: &dyn Fn(u32) -> String,
        tenant: Option<&str>,
        timeout: Duration,
    ) -> Result<usize> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.check_matches_store(stored, name, selector, tenant) {
                Ok(compared) => return Ok(compared),
                Err(error) if Instant::now() > deadline => {
                    return Err(error.context(format!("after {timeout:?}")))
                }
                Err(_) => thread::sleep(Duration::from_millis(500)),
            }
        }
    }
}

/// Every stack (by function names) has the same value on both sides, not only the
/// heaviest: a light stack with inlined frames or unsymbolized addresses is where
/// a store's representation would differ.
fn same_stacks(got: &BTreeMap<Stack, i64>, stored: Option<&BTreeMap<Stack, i64>>) -> Result<()> {
    let empty = BTreeMap::new();
    let stored = stored.unwrap_or(&empty);
    let differ: Vec<(&Stack, Option<&i64>, Option<&i64>)> = got
        .keys()
        .chain(stored.keys())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .map(|stack| (stack, got.get(stack), stored.get(stack)))
        .filter(|(_, a, b)| a != b)
        .collect();
    ensure!(
        differ.is_empty(),
        "{} of {} stacks differ (stack, Pyroscope, stored): {:?}",
        differ.len(),
        stored.len(),
        &differ[..differ.len().min(5)]
    );
    Ok(())
}

/// `[start, end]` in ms covering `profiles` (their timestamps are their starts),
/// with a second of slack each side: the range a query selects them all with.
pub fn time_range(profiles: &[&StoredProfile]) -> (u64, u64) {
    let start = profiles
        .iter()
        .map(|p| (p.time_nanos / 1_000_000).min(p.start_ms))
        .min()
        .unwrap_or(0);
    let end = profiles.iter().map(|p| p.end_ms).max().unwrap_or(0);
    (start.saturating_sub(1000), end + 1000)
}
