//! Servers the end-to-end tests talk to, built from pinned sources into `target/servers/`.
//!
//! Today one: the OpenTelemetry Collector the fleet agent's OTLP/HTTP profiles export is
//! tested against, built by the collector builder (ocb) from the manifest
//! `tests/servers/otelcol/builder.yaml` (see the README.md beside it). The binary lands in
//! `target/servers/otelcol-<hash of the manifest>/otelcol-allocbpf`, so editing the
//! manifest builds a new collector and never reuses a stale one. The Go module and build
//! caches stay at Go's defaults (`~/go/pkg/mod`, `~/.cache/go-build`): after `cargo clean`
//! a rebuild takes seconds, not minutes.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{bail, Context, Result};

use crate::util::{root, run};

/// Where the tests find the collector (`tests/src/otelcol/mod.rs` reads it).
pub const OTELCOL_ENV: &str = "ALLOCBPF_OTELCOL";

/// The collector's binary name (`dist.name` in the manifest).
const OTELCOL_NAME: &str = "otelcol-allocbpf";

/// The oldest Go the pinned collector modules build with (their go.mod: `go 1.26.0`).
const GO_MIN: (u32, u32) = (1, 26);

/// Builds the collector unless it is there; returns its path and exports it to child
/// processes (`cargo test`) as [`OTELCOL_ENV`].
pub fn ensure_otelcol() -> Result<PathBuf> {
    let manifest_path = root().join("tests/servers/otelcol/builder.yaml");
    let manifest = std::fs::read_to_string(&manifest_path)
        .with_context(|| format!("reading {}", manifest_path.display()))?;
    let servers = root().join("target/servers");
    let dir = servers.join(format!("otelcol-{}", manifest_hash(manifest.as_bytes())));
    let binary = dir.join(OTELCOL_NAME);
    if !binary.exists() {
        build_otelcol(&manifest, &servers, &dir)?;
    }
    // Read by `cargo test` and the e2e binaries this xtask starts after setup (they
    // inherit the environment; xtask is single-threaded here), and recorded for a
    // `cargo test` run by hand.
    std::env::set_var(OTELCOL_ENV, &binary);
    let current = servers.join("otelcol.current");
    std::fs::write(&current, format!("{}\n", binary.display()))
        .with_context(|| format!("writing {}", current.display()))?;
    Ok(binary)
}

fn build_otelcol(manifest: &str, servers: &Path, dir: &Path) -> Result<()> {
    let version = dist_version(manifest).context(
        "tests/servers/otelcol/builder.yaml has no `dist: version:` (the collector release, \
         which is also the builder's version)",
    )?;
    let go = find_go()?;
    eprintln!(
        "xtask: building the OpenTelemetry Collector v{version} for the tests \
         (~3 minutes on a fresh machine) with {}",
        go.display()
    );
    let started = Instant::now();
    let builder = ensure_builder(&go, &servers.join("bin"), &version)?;

    // Built beside its final place, then renamed: an interrupted build leaves no
    // directory that looks finished.
    let partial = dir.with_extension("partial");
    if partial.exists() {
        std::fs::remove_dir_all(&partial)?;
    }
    std::fs::create_dir_all(&partial)?;
    let config = partial.join("builder.yaml");
    std::fs::write(&config, with_dist_paths(manifest, &partial, &go)?)?;
    run(go_env(&mut Command::new(&builder), &go)
        .arg("--config")
        .arg(&config)
        .current_dir(&partial))
    .context("building the collector (tests/servers/otelcol/README.md)")?;
    if !partial.join(OTELCOL_NAME).exists() {
        bail!(
            "the collector builder succeeded but wrote no {}",
            partial.join(OTELCOL_NAME).display()
        );
    }
    if dir.exists() {
        std::fs::remove_dir_all(dir)?;
    }
    std::fs::rename(&partial, dir)?;
    eprintln!(
        "xtask: built {} in {:.0} s",
        dir.join(OTELCOL_NAME).display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Installs the collector builder `v{version}` into `bin` (as GOBIN) unless it is there.
fn ensure_builder(go: &Path, bin: &Path, version: &str) -> Result<PathBuf> {
    let builder = bin.join("builder");
    let installed = Command::new(&builder)
        .arg("version")
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .trim()
                .ends_with(&format!("v{version}"))
        })
        .unwrap_or(false);
    if !installed {
        std::fs::create_dir_all(bin)?;
        run(go_env(&mut Command::new(go), go)
            .arg("install")
            .arg(format!(
                "go.opentelemetry.io/collector/cmd/builder@v{version}"
            ))
            .env("GOBIN", bin))
        .context("installing the collector builder")?;
    }
    Ok(builder)
}

/// `command` with the environment every Go step here runs in.
fn go_env<'a>(command: &'a mut Command, go: &Path) -> &'a mut Command {
    let mut path = std::ffi::OsString::from(go.parent().unwrap_or(Path::new("/")));
    if let Some(rest) = std::env::var_os("PATH") {
        path.push(":");
        path.push(rest);
    }
    // -buildvcs=false: the generated module sits inside this git work tree, and under
    // `sudo` git refuses a tree another user owns ("dubious ownership"), which fails
    // `go build`'s VCS stamping.
    let mut goflags = std::env::var("GOFLAGS").unwrap_or_default();
    if !goflags.contains("-buildvcs") {
        goflags = format!("{goflags} -buildvcs=false").trim().to_string();
    }
    command
        .env("PATH", path)
        .env("GOFLAGS", goflags)
        // The version was checked: never switch to (download) another toolchain.
        .env("GOTOOLCHAIN", "local")
}

/// The Go to build with: `/usr/local/go/bin/go` (the upstream install) when it exists,
/// else `go` on PATH; fails unless it is at least [`GO_MIN`]. Debian's golang-go is too
/// old for the collector.
fn find_go() -> Result<PathBuf> {
    let upstream = Path::new("/usr/local/go/bin/go");
    let go = if upstream.exists() {
        upstream.to_path_buf()
    } else {
        PathBuf::from("go")
    };
    let help = format!(
        "the tests' OpenTelemetry Collector is built from Go sources and needs Go >= {}.{}: \
         install it from https://go.dev/dl/ into /usr/local/go (used first when there) or \
         put it first on PATH (Debian's golang-go is older)",
        GO_MIN.0, GO_MIN.1
    );
    let output = Command::new(&go)
        .args(["env", "GOVERSION"])
        .env("GOTOOLCHAIN", "local")
        .output()
        .with_context(|| format!("cannot run {}: {help}", go.display()))?;
    let version = String::from_utf8_lossy(&output.stdout).trim().to_string();
    match parse_go_version(&version) {
        Some(found) if found >= GO_MIN => Ok(go),
        _ => bail!("{} is {version:?}; {help}", go.display()),
    }
}

/// `go1.26.8` -> (1, 26); `go1.19` -> (1, 19); `devel ...` -> None.
fn parse_go_version(version: &str) -> Option<(u32, u32)> {
    let mut parts = version.strip_prefix("go")?.split(['.', 'r', 'b', '-', ' ']);
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// `dist: version:` of the manifest (e.g. `0.161.0`, no `v`).
fn dist_version(manifest: &str) -> Option<String> {
    let mut in_dist = false;
    for line in manifest.lines() {
        if !line.starts_with([' ', '\t', '#']) && !line.is_empty() {
            in_dist = line.trim_end() == "dist:";
        } else if in_dist {
            if let Some(value) = line.trim().strip_prefix("version:") {
                return Some(
                    value
                        .trim()
                        .trim_matches('"')
                        .trim_start_matches('v')
                        .into(),
                );
            }
        }
    }
    None
}

/// The manifest with `dist.output_path` and `dist.go` set (the builder has no flag for
/// either; its `--output-path` is deprecated).
fn with_dist_paths(manifest: &str, output: &Path, go: &Path) -> Result<String> {
    let quote = |p: &Path| -> Result<String> {
        let s = p.to_str().context("non-UTF-8 path")?;
        Ok(format!(
            "\"{}\"",
            s.replace('\\', "\\\\").replace('"', "\\\"")
        ))
    };
    let mut out = String::new();
    let mut inserted = false;
    for line in manifest.lines() {
        out.push_str(line);
        out.push('\n');
        if line.trim_end() == "dist:" {
            out.push_str(&format!("  output_path: {}\n", quote(output)?));
            out.push_str(&format!("  go: {}\n", quote(go)?));
            inserted = true;
        }
    }
    if !inserted {
        bail!("tests/servers/otelcol/builder.yaml has no top-level `dist:`");
    }
    Ok(out)
}

/// 64-bit FNV-1a of the manifest, 12 hex digits: names the build directory (the tests
/// find the binary through `target/servers/otelcol.current`).
pub fn manifest_hash(bytes: &[u8]) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &byte in bytes {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{:012x}", hash >> 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_versions_parse() {
        assert_eq!(parse_go_version("go1.26.8"), Some((1, 26)));
        assert_eq!(parse_go_version("go1.19"), Some((1, 19)));
        assert_eq!(parse_go_version("go1.27rc1"), Some((1, 27)));
        assert_eq!(parse_go_version("devel go1.27-abc"), None);
        assert!(parse_go_version("go1.19").unwrap() < GO_MIN);
    }

    #[test]
    fn manifest_is_completed() {
        let manifest = "# c\ndist:\n  name: x\n  version: 0.161.0\nreceivers:\n  - gomod: a v1\n";
        assert_eq!(dist_version(manifest).as_deref(), Some("0.161.0"));
        let full = with_dist_paths(manifest, Path::new("/t/o"), Path::new("/g/go")).unwrap();
        assert!(full.contains("dist:\n  output_path: \"/t/o\"\n  go: \"/g/go\"\n  name: x\n"));
        assert_eq!(dist_version("receivers:\n  version: 1\n"), None);
    }

    #[test]
    fn the_committed_manifest_names_its_version() {
        let manifest =
            std::fs::read_to_string(root().join("tests/servers/otelcol/builder.yaml")).unwrap();
        let version = dist_version(&manifest).unwrap();
        // The builder and every collector module are released together.
        assert!(manifest.contains(&format!("otlpreceiver v{version}")));
    }

    #[test]
    fn hash_is_fnv1a() {
        // FNV-1a 64 of "" and "a" (published test vectors), top 48 bits.
        assert_eq!(
            manifest_hash(b""),
            format!("{:012x}", 0xcbf29ce484222325u64 >> 16)
        );
        assert_eq!(
            manifest_hash(b"a"),
            format!("{:012x}", 0xaf63dc4c8601ec8cu64 >> 16)
        );
    }
}
