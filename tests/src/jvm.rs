//! The JVM workload (`workloads/java/AllocSites.java`) shared by the JVM tests and the
//! JVM benchmark: where the JDKs are, its classes compiled once, and how it starts.

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::OnceLock,
};

use anyhow::{ensure, Context, Result};

pub use crate::truth::{output_value, parse_sites, Site};
use crate::{scratch_dir, workload_source, Workload};

/// Debian's OpenJDK 17 (its `javac` compiles the workload for both JDKs).
pub const JDK17: &str = "/usr/lib/jvm/java-17-openjdk-amd64";

/// The Temurin 25 JDK.
pub const JDK25: &str = "/usr/lib/jvm/temurin-25-jdk-amd64";

/// The workload's classes, compiled once per process.
pub fn classes() -> &'static Path {
    static CLASSES: OnceLock<PathBuf> = OnceLock::new();
    CLASSES.get_or_init(|| {
        let dir = scratch_dir("jvm-classes");
        let status = Command::new(format!("{JDK17}/bin/javac"))
            .arg("-d")
            .arg(&dir)
            .arg(workload_source("java/AllocSites.java"))
            .status()
            .expect("javac (cargo xtask setup installs openjdk-17-jdk-headless)");
        assert!(status.success(), "javac failed");
        dir
    })
}

/// Starts the workload on the JDK at `home` with `options` (the workload protocol: it
/// waits for "go"): `iterations` of its main loop with `seed`, and `big_arrays` on its
/// second thread.
pub fn start_alloc_sites(
    home: &str,
    options: &[&str],
    iterations: &str,
    seed: &str,
    big_arrays: &str,
) -> Result<Workload> {
    Workload::spawn(
        Command::new(format!("{home}/bin/java"))
            .args(options)
            .arg("-cp")
            .arg(classes())
            .args(["AllocSites", iterations, seed, big_arrays]),
    )
}

/// The workload's truth: its sites and the garbage collections during its run.
pub fn truth(output: &str) -> Result<(Vec<Site>, f64)> {
    let sites = parse_sites(output)?;
    ensure!(sites.len() == 3, "workload output: {output}");
    let collections = output_value(output, "collections").context("no collections line")?;
    Ok((sites, collections))
}
