//! The agent's configuration: a TOML file (every key optional), overridden by flags.
//! docs/operations.md is the reference for every key.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use serde::Deserialize;

mod push;

use self::push::{push_config, PushFile};
pub use self::push::{Destination, PushConfig, PushTarget};

use allocbpf_collect::options::UnwindMode;
use allocbpf_collect::{budget::BudgetOptions, filter::FilterOptions, options::DEFAULT_RATE};
use allocbpf_profile::units::{parse_duration, parse_size, ParseError, MAX_DURATION, MAX_RATE};

/// What the command line sets over the config file (each `None`: the file's value,
/// else the default).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AgentOverrides {
    /// Directory of the local profile store.
    pub store: Option<PathBuf>,
    /// How often one profile per process is cut.
    pub interval: Option<Duration>,
    /// Pyroscope base URL (`push.url`).
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
struct BudgetFile {
    enabled: Option<bool>,
    cpu_percent: Option<f64>,
    agent_cpu_percent: Option<f64>,
    host_cpu_percent: Option<f64>,
    window_moves_cpu_percent: Option<f64>,
    period: Option<String>,
    min_window: Option<String>,
    check_interval: Option<String>,
    recovery: Option<String>,
    allowance: Option<String>,
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
    /// Symbol prefixes of renamed allocators, probed besides the catalogue.
    pub allocator_symbols: Vec<String>,
    /// Process filters.
    pub filter: FilterOptions,
    /// Prometheus endpoint (`None`: off).
    pub metrics_address: Option<SocketAddr>,
    /// Store retention.
    pub retention: Retention,
    /// Where profiles are pushed (Pyroscope, OTLP), if anywhere.
    pub push: Option<PushConfig>,
    /// The overhead budget (`None`: disabled).
    pub budget: Option<BudgetOptions>,
}

/// A config that cannot be used: the file or a value in it, or a flag's value.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("reading the config file {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid TOML of the known keys.
    #[error("parsing the config file {}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// Why.
        source: toml::de::Error,
    },
    /// A size or duration that does not parse or is out of range.
    #[error("config key {key}")]
    Value {
        /// The key.
        key: &'static str,
        /// Why.
        source: ParseError,
    },
    /// Another value out of its range or set; the message names the key.
    #[error("{0}")]
    Invalid(String),
    /// The push URL carries credentials (not echoed: the URL holds a secret).
    #[error(
        "the push URL must not carry credentials (user:password@host): they would show in \
         logs and in the process list; put them in push.credentials_file (mode 0600) or \
         ALLOCBPF_PUSH_TOKEN"
    )]
    PushCredentials,
    /// The metrics address is not an address.
    #[error("metrics address {address:?} (example: 127.0.0.1:9464)")]
    MetricsAddress {
        /// As written.
        address: String,
        /// Why.
        source: std::net::AddrParseError,
    },
}

type Result<T> = std::result::Result<T, ConfigError>;

fn duration(key: &'static str, text: Option<&str>, default: Duration) -> Result<Duration> {
    match text {
        None => Ok(default),
        Some(t) => {
            parse_duration(t, MAX_DURATION).map_err(|source| ConfigError::Value { key, source })
        }
    }
}

/// [`duration`], where a zero (`0`, `0s`, `0ms`) turns the setting off.
fn duration_or_zero(key: &'static str, text: Option<&str>, default: Duration) -> Result<Duration> {
    match text.map(str::trim) {
        Some("0" | "0s" | "0ms") => Ok(Duration::ZERO),
        _ => duration(key, text, default),
    }
}

fn size(key: &'static str, text: Option<&str>, default: u64, max: u64) -> Result<u64> {
    match text {
        None => Ok(default),
        Some(t) => parse_size(t, max).map_err(|source| ConfigError::Value { key, source }),
    }
}

impl AgentConfig {
    /// Reads the config file (if any) and applies the overrides over it.
    pub fn load(config_file: Option<&Path>, args: &AgentOverrides) -> Result<AgentConfig> {
        let file: File = match config_file {
            None => File::default(),
            Some(path) => parse_file(path)?,
        };
        // Checked in this order, so a file with several bad values names the same
        // first one as before.
        let push = push_config(args.push.clone(), file.push.unwrap_or_default())?;
        let metrics_address =
            metrics_address(args.metrics_address.clone().or(file.metrics_address))?;
        let unwind = unwind_mode(file.unwind.as_deref())?;
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
                None => size("rate", file.rate.as_deref(), DEFAULT_RATE, MAX_RATE)?,
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
            retention: retention(file.retention.unwrap_or_default())?,
            push,
            budget: budget_options(file.budget.unwrap_or_default())?,
        };
        if config.interval < Duration::from_secs(1) {
            return Err(ConfigError::Invalid("interval must be at least 1s".into()));
        }
        Ok(config)
    }
}

fn unwind_mode(text: Option<&str>) -> Result<UnwindMode> {
    match text {
        None | Some("auto") => Ok(UnwindMode::Auto),
        Some("dwarf") => Ok(UnwindMode::Dwarf),
        Some("fp") => Ok(UnwindMode::Fp),
        Some(other) => Err(ConfigError::Invalid(format!(
            "config key unwind: {other:?} is not auto, dwarf or fp"
        ))),
    }
}

fn metrics_address(address: Option<String>) -> Result<Option<SocketAddr>> {
    let address = address.unwrap_or_else(|| "127.0.0.1:9464".into());
    match address.as_str() {
        "off" | "" => Ok(None),
        text => text
            .parse()
            .map(Some)
            .map_err(|source| ConfigError::MetricsAddress { address, source }),
    }
}

fn retention(file: RetentionFile) -> Result<Retention> {
    Ok(Retention {
        max_age: duration(
            "retention.max_age",
            file.max_age.as_deref(),
            Duration::from_secs(7 * 24 * 3600),
        )?,
        max_bytes: size(
            "retention.max_bytes",
            file.max_bytes.as_deref(),
            1 << 30,
            1 << 50,
        )?,
        max_files: match file.max_files {
            Some(0) => {
                return Err(ConfigError::Invalid(
                    "retention.max_files must be at least 1".into(),
                ))
            }
            Some(n) => n,
            None => DEFAULT_MAX_FILES,
        },
    })
}

/// The overhead budget, unless disabled; percentages in (0, 100].
fn budget_options(file: BudgetFile) -> Result<Option<BudgetOptions>> {
    if !file.enabled.unwrap_or(true) {
        return Ok(None);
    }
    let defaults = BudgetOptions::default();
    let percent = |key: &str, value: Option<f64>, default: f64| -> Result<f64> {
        match value {
            None => Ok(default / 100.0),
            Some(p) if p > 0.0 && p <= 100.0 => Ok(p / 100.0),
            Some(p) => Err(ConfigError::Invalid(format!(
                "config key budget.{key}: {p} is not in (0, 100]"
            ))),
        }
    };
    let options = BudgetOptions {
        process_cpu: percent(
            "cpu_percent",
            file.cpu_percent,
            defaults.process_cpu * 100.0,
        )?,
        agent_cpu: (file.agent_cpu_percent)
            .map(|p| percent("agent_cpu_percent", Some(p), 0.0))
            .transpose()?,
        host_share: percent(
            "host_cpu_percent",
            file.host_cpu_percent,
            defaults.host_share * 100.0,
        )?,
        window_moves_cpu: percent(
            "window_moves_cpu_percent",
            file.window_moves_cpu_percent,
            defaults.window_moves_cpu * 100.0,
        )?,
        period: duration("budget.period", file.period.as_deref(), defaults.period)?,
        min_window: duration(
            "budget.min_window",
            file.min_window.as_deref(),
            defaults.min_window,
        )?,
        check_every: duration(
            "budget.check_interval",
            file.check_interval.as_deref(),
            defaults.check_every,
        )?,
        recovery: duration(
            "budget.recovery",
            file.recovery.as_deref(),
            defaults.recovery,
        )?,
        allowance: duration_or_zero(
            "budget.allowance",
            file.allowance.as_deref(),
            defaults.allowance,
        )?,
    };
    if options.min_window > options.period || options.min_window.is_zero() {
        return Err(ConfigError::Invalid(format!(
            "config keys budget.min_window ({:?}) and budget.period ({:?}): the window must be longer than 0 and fit in the period",
            options.min_window, options.period
        )));
    }
    Ok(Some(options))
}

fn parse_file(path: &Path) -> Result<File> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    toml::from_str(&text).map_err(|source| ConfigError::Parse {
        path: path.to_path_buf(),
        source,
    })
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
agent_cpu_percent = 0.5
allowance = "0s"
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
        let push = config.push.unwrap();
        assert_eq!(push.targets.len(), 1);
        assert_eq!(push.targets[0].url, "http://pyroscope:4040");
        assert_eq!(push.targets[0].destination, Destination::PyroscopePush);
        let budget = config.budget.unwrap();
        assert_eq!(budget.process_cpu, 0.025);
        assert_eq!(budget.agent_cpu, Some(0.005));
        assert_eq!(budget.agent_cap(), 0.005);
        assert_eq!(budget.allowance, Duration::ZERO);
        assert_eq!(config.filter.comm.as_deref(), Some("^nginx"));
        assert!(config.live);

        std::fs::write(&path, "rate = \"lots\"\n").unwrap();
        let error = format!(
            "{:#}",
            anyhow::Error::from(AgentConfig::load(Some(&path), &args).unwrap_err())
        );
        assert!(error.contains("config key rate"), "{error}");
        std::fs::write(&path, "colour = \"blue\"\n").unwrap();
        let error = format!(
            "{:#}",
            anyhow::Error::from(AgentConfig::load(Some(&path), &args).unwrap_err())
        );
        assert!(error.contains("unknown field"), "{error}");
        // Credentials in the URL are refused, and the secret is not echoed.
        std::fs::write(&path, "[push]\nurl = \"https://joe:hunter2@p:4040/\"\n").unwrap();
        let error = format!(
            "{:#}",
            anyhow::Error::from(AgentConfig::load(Some(&path), &args).unwrap_err())
        );
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
