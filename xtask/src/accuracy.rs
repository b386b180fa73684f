//! `cargo xtask accuracy`: the statistics harness (tests/src/accuracy), with figures.

use anyhow::Result;

use crate::{
    setup::e2e_bin,
    util::{is_root, root, run},
};

/// Runs the harness binary; as root it adds the end-to-end coverage run.
pub fn accuracy(plots: bool) -> Result<()> {
    let mut command = e2e_bin("accuracy")?;
    if is_root() {
        command.arg("--kernel");
    } else {
        eprintln!("xtask: not root, so no end-to-end coverage run (it attaches uprobes)");
    }
    if plots {
        command.arg("--plots").arg(root().join("docs/img"));
    }
    run(&mut command)
}
