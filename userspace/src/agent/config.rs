//! The agent's configuration: a TOML file (every key optional), overridden by flags.
//! docs/operations.md is the reference for every key.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use crate::{
    stacks::UnwindMode,
    system::{budget::BudgetOptions, filter::FilterOptions},
    units::{parse_duration, parse_size, MAX_DURATION, MAX_RATE},
};

/// What the command line sets over the config file (each `None`: the file's value,
/// else the default).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AgentOverrides {
    /// Directory of the local profile store.
    pub store: Option<PathBuf>,
    /// How often one profile per process is cut.
    pub interval: Option<Duration>,
    /// Pyroscope base URL.
    pub push: Option<String>,
    /// Metrics address, or "off".
    pub metrics_address: Option<String>,
    /// Mean sampling interval in bytes.
    pub rate: Option<u64>,
}

/// Default `retention.max_files`: with ~100 bytes of index per file, ~10 MB of the
/// agent's memory at most; 100,000 files of a few KiB fit the default `max_bytes`.
pub const DEFAULT_MAX_FILES: u64 = 100_000;

/// The config file as written (strings for sizes and durations: "512KiB", "60s").
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    store: Option<PathBuf>,
    interval: Option<String>,
    rate: Option<String>,
    live: Option<bool>,
    unwind: Option<String>,
    allocator_symbols: Option<Vec<String>>,
    comm: Option<String>,
    exclude_comm: Option<String>,
    cgroup: Option<String>,
    metrics_address: Option<String>,
    retention: Option<RetentionFile>,
    push: Option<PushFile>,
    budget: Option<BudgetFile>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RetentionFile {
    max_age: Option<String>,
    max_bytes: Option<String>,
    max_files: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PushFile {
    url: Option<String>,
    application: Option<String>,
    credentials_file: Option<PathBuf>,
    tenant: Option<String>,
    timeout: Option<String>,
    spool_max_bytes: Option<String>,
    allow_insecure_http: Option<bool>,
    ca_file: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct BudgetFile {
    enabled: Option<bool>,
    cpu_percent: Option<f64>,
    detach_cpu_percent: Option<f64>,
    check_interval: Option<String>,
    backoff_initial: Option<String>,
    backoff_max: Option<String>,
}

/// Retention of the local store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retention {
    /// Profiles older than this are deleted.
    pub max_age: Duration,
    /// The oldest profiles are deleted while the store is larger than this.
    pub max_bytes: u64,
    /// ... or holds more files than this (which bounds the store's index in memory).
    pub max_files: u64,
}

/// Where and how profiles are pushed.
#[derive(Clone, Debug, PartialEq)]
pub struct PushConfig {
    /// Base URL of the Pyroscope server (`/ingest` is appended).
    pub url: String,
    /// Application name: the metric name in Pyroscope (`allocbpf`).
    pub application: String,
    /// File holding `Bearer TOKEN` or `USER:PASSWORD` (else the environment).
    pub credentials_file: Option<PathBuf>,
    /// `X-Scope-OrgID` for multi-tenant servers.
    pub tenant: Option<String>,
    /// Per-request timeout.
    pub timeout: Duration,
    /// Bound of the on-disk spool of undelivered profiles.
    pub spool_max_bytes: u64,
    /// Credentials may be sent over plain `http://` (off by default).
    pub allow_insecure_http: bool,
    /// PEM certificates trusted besides the public roots (a private CA).
    pub ca_file: Option<PathBuf>,
}

/// The agent's effective configuration.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// Local store directory.
    pub store: PathBuf,
    /// Profile interval.
    pub interval: Duration,
    /// Mean sampling interval in bytes.
    pub rate: u64,
    /// Track live blocks (inuse profiles).
    pub live: bool,
    /// Stack unwinding.
    pub unwind: UnwindMode,
    /// `--allocator-symbol` prefixes.
    pub allocator_symbols: Vec<String>,
    /// Process filters.
    pub filter: FilterOptions,
    /// Prometheus endpoint (`None`: off).
    pub metrics_address: Option<SocketAddr>,
    /// Store retention.
    pub retention: Retention,
    /// Pyroscope push, if configured.
    pub push: Option<PushConfig>,
    /// The overhead budget (`None`: disabled).
    pub budget: Option<BudgetOptions>,
}

fn duration(key: &str, text: Option<&str>, default: Duration) -> Result<Duration> {
    match text {
        None => Ok(default),
        Some(t) => parse_duration(t, MAX_DURATION).with_context(|| format!("config key {key}")),
    }
}

fn size(key: &str, text: Option<&str>, default: u64, max: u64) -> Result<u64> {
    match text {
        None => Ok(default),
        Some(t) => parse_size(t, max).with_context(|| format!("config key {key}")),
    }
}

impl AgentConfig {
    /// Reads the config file (if any) and applies the flags over it.
    pub fn load(config_file: Option<&Path>, args: &AgentOverrides) -> Result<AgentConfig> {
        let file: File = match config_file {
            None => File::default(),
            Some(path) => parse_file(path)?,
        };
        let retention = file.retention.unwrap_or_default();
        let budget = file.budget.unwrap_or_default();
        let defaults = BudgetOptions::default();
        let push_file = file.push.unwrap_or_default();
        let push_url = args.push.clone().or(push_file.url);
        let push = match push_url {
            None => None,
            Some(url) => {
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    bail!("push URL {url:?} must start with http:// or https://");
                }
                let authority = url
                    .split_once("://")
                    .map_or("", |(_, rest)| rest.split('/').next().unwrap_or(""));
                if authority.contains('@') {
                    // Not echoed: the URL holds a secret.
                    bail!(
                        "the push URL must not carry credentials (user:password@host): they \
                         would show in logs and in the process list; put them in \
                         push.credentials_file (mode 0600) or ALLOCBPF_PUSH_TOKEN"
                    );
                }
                Some(PushConfig {
                    url: url.trim_end_matches('/').to_string(),
                    application: push_file.application.unwrap_or_else(|| "allocbpf".into()),
                    credentials_file: push_file.credentials_file,
                    tenant: push_file.tenant,
                    timeout: duration(
                        "push.timeout",
                        push_file.timeout.as_deref(),
                        Duration::from_secs(10),
                    )?,
                    spool_max_bytes: size(
                        "push.spool_max_bytes",
                        push_file.spool_max_bytes.as_deref(),
                        256 << 20,
                        1 << 40,
                    )?,
                    allow_insecure_http: push_file.allow_insecure_http.unwrap_or(false),
                    ca_file: push_file.ca_file,
                })
            }
        };
        let metrics = args
            .metrics_address
            .clone()
            .or(file.metrics_address)
            .unwrap_or_else(|| "127.0.0.1:9464".into());
        let metrics_address =
            match metrics.as_str() {
                "off" | "" => None,
                addr => Some(addr.parse().with_context(|| {
                    format!("metrics address {addr:?} (example: 127.0.0.1:9464)")
                })?),
            };
        let unwind = match file.unwind.as_deref() {
            None | Some("auto") => UnwindMode::Auto,
            Some("dwarf") => UnwindMode::Dwarf,
            Some("fp") => UnwindMode::Fp,
            Some(other) => bail!("config key unwind: {other:?} is not auto, dwarf or fp"),
        };
        let percent = |key: &str, value: Option<f64>, default: f64| -> Result<f64> {
            match value {
                None => Ok(default / 100.0),
                Some(p) if p > 0.0 && p <= 100.0 => Ok(p / 100.0),
                Some(p) => bail!("config key budget.{key}: {p} is not in (0, 100]"),
            }
        };
        let config = AgentConfig {
            store: args
                .store
                .clone()
                .or(file.store)
                .unwrap_or_else(|| PathBuf::from("/var/lib/allocbpf")),
            interval: match args.interval {
                Some(i) => i,
                None => duration(
                    "interval",
                    file.interval.as_deref(),
                    Duration::from_secs(60),
                )?,
            },
            rate: match args.rate {
                Some(r) => r,
                None => size("rate", file.rate.as_deref(), 512 << 10, MAX_RATE)?,
            },
            live: file.live.unwrap_or(true),
            unwind,
            allocator_symbols: file.allocator_symbols.unwrap_or_default(),
            filter: FilterOptions {
                comm: file.comm,
                exclude_comm: file.exclude_comm,
                cgroup: file.cgroup,
            },
            metrics_address,
            retention: Retention {
                max_age: duration(
                    "retention.max_age",
                    retention.max_age.as_deref(),
                    Duration::from_secs(7 * 24 * 3600),
                )?,
                max_bytes: size(
                    "retention.max_bytes",
                    retention.max_bytes.as_deref(),
                    1 << 30,
                    1 << 50,
                )?,
                max_files: match retention.max_files {
                    Some(0) => bail!("retention.max_files must be at least 1"),
                    Some(n) => n,
                    None => DEFAULT_MAX_FILES,
                },
            },
            push,
            budget: if budget.enabled.unwrap_or(true) {
                Some(BudgetOptions {
                    cpu_fraction: percent(
                        "cpu_percent",
                        budget.cpu_percent,
                        defaults.cpu_fraction * 100.0,
                    )?,
                    detach_fraction: percent(
                        "detach_cpu_percent",
                        budget.detach_cpu_percent,
                        defaults.detach_fraction * 100.0,
                    )?,
                    check_every: duration(
                        "budget.check_interval",
                        budget.check_interval.as_deref(),
                        defaults.check_every,
                    )?,
                    backoff_initial: duration(
                        "budget.backoff_initial",
                        budget.backoff_initial.as_deref(),
                        defaults.backoff_initial,
                    )?,
                    backoff_max: duration(
                        "budget.backoff_max",
                        budget.backoff_max.as_deref(),
                        defaults.backoff_max,
                    )?,
                })
            } else {
                None
            },
        };
        if config.interval < Duration::from_secs(1) {
            bail!("interval must be at least 1s");
        }
        Ok(config)
    }
}

fn parse_file(path: &Path) -> Result<File> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the config file {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("parsing the config file {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_override_the_file_and_defaults_fill_the_rest() {
        let dir = std::env::temp_dir().join(format!("allocbpf-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("agent.toml");
        std::fs::write(
            &path,
            r#"
store = "/srv/profiles"
interval = "30s"
rate = "1MiB"
comm = "^nginx"
[retention]
max_bytes = "10MiB"
[push]
url = "http://pyroscope:4040/"
[budget]
cpu_percent = 2.5
"#,
        )
        .unwrap();
        let args = AgentOverrides {
            interval: Some(Duration::from_secs(5)),
            ..AgentOverrides::default()
        };
        let config = AgentConfig::load(Some(&path), &args).unwrap();
        assert_eq!(config.store, PathBuf::from("/srv/profiles"));
        assert_eq!(config.interval, Duration::from_secs(5));
        assert_eq!(config.rate, 1 << 20);
        assert_eq!(config.retention.max_bytes, 10 << 20);
        assert_eq!(config.retention.max_age, Duration::from_secs(7 * 24 * 3600));
        assert_eq!(config.push.unwrap().url, "http://pyroscope:4040");
        assert_eq!(config.budget.unwrap().cpu_fraction, 0.025);
        assert_eq!(config.filter.comm.as_deref(), Some("^nginx"));
        assert!(config.live);

        std::fs::write(&path, "rate = \"lots\"\n").unwrap();
        let error = format!("{:#}", AgentConfig::load(Some(&path), &args).unwrap_err());
        assert!(error.contains("config key rate"), "{error}");
        std::fs::write(&path, "colour = \"blue\"\n").unwrap();
        let error = format!("{:#}", AgentConfig::load(Some(&path), &args).unwrap_err());
        assert!(error.contains("unknown field"), "{error}");
        // Credentials in the URL are refused, and the secret is not echoed.
        std::fs::write(&path, "[push]\nurl = \"https://joe:hunter2@p:4040/\"\n").unwrap();
        let error = format!("{:#}", AgentConfig::load(Some(&path), &args).unwrap_err());
        assert!(error.contains("must not carry credentials"), "{error}");
        assert!(!error.contains("hunter2"), "{error}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn no_flags_no_file_just_works() {
        let config = AgentConfig::load(None, &AgentOverrides::default()).unwrap();
        assert_eq!(config.store, PathBuf::from("/var/lib/allocbpf"));
        assert_eq!(config.interval, Duration::from_secs(60));
        assert!(config.push.is_none());
        let budget = config.budget.unwrap();
        assert_eq!(budget, BudgetOptions::default());
    }
}
