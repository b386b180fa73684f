//! `cargo xtask soak`: the agent under process churn (tests/src/bin/soak.rs).

use anyhow::Result;

use crate::util::{e2e_bin, run};

/// Runs the soak bench for `minutes` at sampling rate `rate`.
pub fn soak(minutes: f64, rate: &str) -> Result<()> {
    let mut command = e2e_bin("soak")?;
    command.args(["--minutes", &minutes.to_string(), "--rate", rate]);
    run(&mut command)
}
