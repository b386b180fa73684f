//! `cargo xtask soak`: the agent under process churn (tests/src/bin/soak.rs), or, with
//! `--burst`, under a burst of real programs (tests/src/bin/burst.rs).

use anyhow::Result;

use crate::{setup::e2e_bin, util::run};

/// Runs the soak bench for `minutes` at sampling rate `rate`; with `burst`, the burst
/// bench instead (tests/src/bin/burst.rs), three rounds.
pub fn soak(minutes: f64, rate: &str, burst: bool) -> Result<()> {
    if burst {
        let mut command = e2e_bin("burst")?;
        command.args(["--rounds", "3"]);
        return run(&mut command);
    }
    let mut command = e2e_bin("soak")?;
    command.args(["--minutes", &minutes.to_string(), "--rate", rate]);
    run(&mut command)
}
