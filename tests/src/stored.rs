//! What a stored profile of the agent says, for the budget tests: its process, its
//! estimate, its samples and the share of its interval observed.

use std::path::Path;

use allocbpf_export::pprof::decode_file;

use crate::agent::parse_stored_name;

/// What one stored profile says.
pub struct Stored {
    /// Its process's command name.
    pub comm: String,
    /// Its process.
    pub pid: u32,
    /// Its estimated bytes allocated, summed over its stacks.
    pub estimated_bytes: f64,
    /// Its samples, summed over its stacks.
    pub samples: u64,
    /// The share of its interval observed, when time-sampled.
    pub observed_fraction: Option<f64>,
}

/// Reads the stored profile at `path` (its name gives its pid and command).
pub fn read_stored(path: &Path) -> Stored {
    let (_, _, pid, comm) = parse_stored_name(path);
    let profile = decode_file(path).unwrap();
    let s = |i: i64| profile.string_table[i as usize].as_str();
    let space = profile
        .sample_type
        .iter()
        .position(|t| s(t.r#type) == "alloc_space")
        .unwrap();
    let estimated_bytes = profile.sample.iter().map(|x| x.value[space] as f64).sum();
    let samples = profile
        .sample
        .iter()
        .flat_map(|x| x.label.iter())
        .filter(|l| s(l.key) == "samples")
        .map(|l| l.num as u64)
        .sum();
    let observed_fraction = profile
        .comment
        .iter()
        .find_map(|&c| s(c).strip_prefix("observed_fraction="))
        .map(|v| v.parse().unwrap());
    Stored {
        comm,
        pid,
        estimated_bytes,
        samples,
        observed_fraction,
    }
}
