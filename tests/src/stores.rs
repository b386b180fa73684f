//! What a profile store should show, from the agent's local store: each stored
//! profile's totals per sample type and its heaviest stacks, to compare with what a
//! real store (a Collector, Pyroscope) returns.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use allocbpf_export::pprof;

use crate::agent::{parse_stored_name, stored_profiles};

/// A stack by function names, leaf first (inlined frames before their caller).
pub type Stack = Vec<String>;

/// One profile of the local store.
#[derive(Clone, Debug)]
pub struct StoredProfile {
    /// Its file.
    pub path: PathBuf,
    /// The process.
    pub pid: u32,
    /// Interval start, Unix nanoseconds (the pprof's `time_nanos`).
    pub time_nanos: u64,
    /// Interval start and end, Unix milliseconds (from the file name).
    pub start_ms: u64,
    /// Interval end, Unix milliseconds.
    pub end_ms: u64,
    /// Sum of values per sample type (`alloc_space`, ...).
    pub totals: BTreeMap<String, i64>,
    /// Per sample type, each stack's value (stacks with equal names summed).
    pub stacks: BTreeMap<String, BTreeMap<Stack, i64>>,
    /// The probe's exact byte count for the interval (the `exact_bytes=` comment).
    pub exact_bytes: Option<u64>,
}

impl StoredProfile {
    /// Whether it holds no sample (a process that exited early in its last interval):
    /// a Collector's OTLP receiver passes nothing of such a request on.
    pub fn is_empty(&self) -> bool {
        self.stacks.values().all(BTreeMap::is_empty)
    }

    /// The `n` heaviest stacks of `sample_type`, heaviest first (ties by name).
    pub fn top(&self, sample_type: &str, n: usize) -> Vec<(Stack, i64)> {
        top(self.stacks.get(sample_type), n)
    }
}

/// The `n` heaviest of `stacks`, heaviest first, ties broken by the stack.
pub fn top(stacks: Option<&BTreeMap<Stack, i64>>, n: usize) -> Vec<(Stack, i64)> {
    let mut all: Vec<(Stack, i64)> = stacks
        .map(|s| s.iter().map(|(k, v)| (k.clone(), *v)).collect())
        .unwrap_or_default();
    all.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    all.truncate(n);
    all
}

/// Several stored profiles summed, as a store that merges them shows them.
#[derive(Clone, Debug, Default)]
pub struct SummedProfiles {
    /// How many profiles.
    pub count: usize,
    /// Sum of values per sample type.
    pub totals: BTreeMap<String, i64>,
    /// Per sample type, each stack's value summed over the profiles.
    pub stacks: BTreeMap<String, BTreeMap<Stack, i64>>,
}

impl SummedProfiles {
    /// The `n` heaviest stacks of `sample_type`, heaviest first (ties by name).
    pub fn top(&self, sample_type: &str, n: usize) -> Vec<(Stack, i64)> {
        top(self.stacks.get(sample_type), n)
    }
}

/// The sum of `profiles`: totals and stacks per sample type.
pub fn sum_stored<'a>(profiles: impl IntoIterator<Item = &'a StoredProfile>) -> SummedProfiles {
    let mut sum = SummedProfiles::default();
    for profile in profiles {
        sum.count += 1;
        for (sample_type, total) in &profile.totals {
            *sum.totals.entry(sample_type.clone()).or_insert(0) += total;
        }
        for (sample_type, stacks) in &profile.stacks {
            let summed = sum.stacks.entry(sample_type.clone()).or_default();
            for (stack, value) in stacks {
                *summed.entry(stack.clone()).or_insert(0) += value;
            }
        }
    }
    sum
}

/// Every profile of the store under `store`, of processes in `pids` (all if empty).
pub fn read_store(store: &Path, pids: &[u32]) -> Vec<StoredProfile> {
    stored_profiles(store)
        .into_iter()
        .filter_map(|path| {
            let (start_ms, end_ms, pid, _) = parse_stored_name(&path);
            if !pids.is_empty() && !pids.contains(&pid) {
                return None;
            }
            let profile = pprof::decode_file(&path).ok()?;
            Some(summarize(path, pid, start_ms, end_ms, &profile))
        })
        .collect()
}

fn summarize(
    path: PathBuf,
    pid: u32,
    start_ms: u64,
    end_ms: u64,
    profile: &pprof::proto::Profile,
) -> StoredProfile {
    let string = |i: i64| -> String {
        profile
            .string_table
            .get(i as usize)
            .cloned()
            .unwrap_or_default()
    };
    let functions: BTreeMap<u64, String> = profile
        .function
        .iter()
        .map(|f| (f.id, string(f.name)))
        .collect();
    let locations: BTreeMap<u64, Vec<String>> = profile
        .location
        .iter()
        .map(|l| {
            let names: Vec<String> = if l.line.is_empty() {
                vec![format!("{:#x}", l.address)]
            } else {
                l.line
                    .iter()
                    .map(|line| {
                        functions
                            .get(&line.function_id)
                            .cloned()
                            .unwrap_or_default()
                    })
                    .collect()
            };
            (l.id, names)
        })
        .collect();
    let types: Vec<String> = profile
        .sample_type
        .iter()
        .map(|t| string(t.r#type))
        .collect();
    let mut totals = BTreeMap::new();
    let mut stacks: BTreeMap<String, BTreeMap<Stack, i64>> = BTreeMap::new();
    for sample in &profile.sample {
        let stack: Stack = sample
            .location_id
            .iter()
            .flat_map(|id| locations.get(id).cloned().unwrap_or_default())
            .collect();
        for (t, value) in types.iter().zip(&sample.value) {
            *totals.entry(t.clone()).or_insert(0) += value;
            if *value != 0 {
                *stacks
                    .entry(t.clone())
                    .or_default()
                    .entry(stack.clone())
                    .or_insert(0) += value;
            }
        }
    }
    let exact_bytes = profile.comment.iter().find_map(|&i| {
        string(i)
            .strip_prefix("exact_bytes=")
            .and_then(|v| v.parse().ok())
    });
    StoredProfile {
        path,
        pid,
        time_nanos: u64::try_from(profile.time_nanos).unwrap_or(0),
        start_ms,
        end_ms,
        totals,
        stacks,
        exact_bytes,
    }
}

/// The service name the agent gives a process by default (as its push does): the
/// systemd unit its cgroup names, else its command name.
pub fn default_service_name(pid: u32) -> String {
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let unit = cgroup
        .lines()
        .find_map(|line| line.strip_prefix("0::"))
        .and_then(|path| path.rsplit('/').next())
        .and_then(|last| last.strip_suffix(".service"))
        .map(|unit| unit.split('@').next().unwrap_or(unit).to_string())
        .filter(|unit| !unit.is_empty());
    unit.unwrap_or_else(|| {
        std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .unwrap_or_default()
            .trim_end()
            .to_string()
    })
}

/// A received OTLP profile's stacks, by names (equal stacks summed).
fn received_stacks(profile: &crate::otelcol::ReceivedProfile) -> BTreeMap<Stack, i64> {
    let mut stacks = BTreeMap::new();
    for sample in &profile.samples {
        let value: i64 = sample.values.iter().sum();
        if value != 0 {
            *stacks.entry(sample.stack.clone()).or_insert(0) += value;
        }
    }
    stacks
}

/// Checks that `received` holds every profile of `stored` that has samples exactly
/// once per sample type, with the same totals and the same five heaviest stacks, and
/// returns how many (profile, type) pairs were compared.
pub fn check_otlp_matches_store(
    stored: &[StoredProfile],
    received: &[crate::otelcol::ReceivedProfile],
) -> anyhow::Result<usize> {
    let mut compared = 0;
    for profile in stored.iter().filter(|p| !p.is_empty()) {
        for (sample_type, total) in &profile.totals {
            let matching: Vec<_> = received
                .iter()
                .filter(|r| {
                    r.resource.get("process.pid") == Some(&profile.pid.to_string())
                        && r.time_unix_nano == profile.time_nanos
                        && &r.sample_type == sample_type
                })
                .collect();
            anyhow::ensure!(
                matching.len() == 1,
                "{} {sample_type}: received {} times",
                profile.path.display(),
                matching.len()
            );
            let got = matching[0];
            anyhow::ensure!(
                got.total() == *total,
                "{} {sample_type}: received total {} where the store has {total}",
                profile.path.display(),
                got.total()
            );
            let stacks = received_stacks(got);
            anyhow::ensure!(
                top(Some(&stacks), 5) == profile.top(sample_type, 5),
                "{} {sample_type}: top stacks differ:\nreceived {:?}\nstored {:?}",
                profile.path.display(),
                top(Some(&stacks), 5),
                profile.top(sample_type, 5)
            );
            compared += 1;
        }
    }
    Ok(compared)
}

/// How far an estimate of bytes may be from the exact count over `calls` calls of
/// `size` bytes at sampling rate `rate`: at rate R every call of size S is sampled with
/// probability p = 1 - exp(-S/R) and weighted 1/p, so the estimated count over N
/// calls has relative standard deviation sqrt((1-p)/(pN)); the bytes estimate is that
/// count times S. Both sides cover the same intervals (probed full time, the exact
/// count is of every call the estimate stands for): six standard deviations, a chance
/// of about 2e-9 per check.
pub fn truth_bound(size: f64, rate: f64, calls: f64) -> f64 {
    let p = 1.0 - (-size / rate).exp();
    6.0 * ((1.0 - p) / (p * calls)).sqrt()
}
