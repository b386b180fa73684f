//! `cargo xtask accuracy`: the statistics harness (tests/src/accuracy), with figures.

use anyhow::Result;

use crate::{
    setup,
    util::{build_allocbpf, cargo, is_root, root, run},
};

/// Runs the harness binary; as root it adds the end-to-end coverage run.
pub fn accuracy(plots: bool) -> Result<()> {
    setup::ensure()?;
    let allocbpf = build_allocbpf()?;
    let mut command = cargo();
    command
        .args([
            "run",
            "--release",
            "-p",
            "allocbpf-e2e",
            "--bin",
            "accuracy",
            "--",
        ])
        .env("ALLOCBPF_BIN", &allocbpf);
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
