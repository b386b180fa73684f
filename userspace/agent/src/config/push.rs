//! The `[push]` section: where profiles are pushed (Grafana Pyroscope, an OpenTelemetry
//! endpoint, or both) and how.

use std::{path::PathBuf, time::Duration};

use serde::Deserialize;

use super::{duration, size, ConfigError, Result};

/// The `[push]` section as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PushFile {
    url: Option<String>,
    protocol: Option<String>,
    otlp_endpoint: Option<String>,
    service_name: Option<String>,
    application: Option<String>,
    credentials_file: Option<PathBuf>,
    tenant: Option<String>,
    timeout: Option<String>,
    spool_max_bytes: Option<String>,
    max_series: Option<usize>,
    allow_insecure_http: Option<bool>,
    ca_file: Option<PathBuf>,
}

/// A kind of profile store, and the protocol spoken to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Destination {
    /// Pyroscope's Connect API, `push.v1.PusherService/Push` (the default).
    PyroscopePush,
    /// Pyroscope's legacy HTTP API, `/ingest`.
    PyroscopeIngest,
    /// OTLP/HTTP profiles (protobuf), `/v1development/profiles`.
    Otlp,
}

impl Destination {
    /// The spool directory's name under the store: one spool per store, so a profile
    /// delivered to one is never sent again because another failed. Both Pyroscope
    /// protocols share one (switching protocol keeps what waits).
    pub fn spool_dir(self) -> &'static str {
        match self {
            Destination::PyroscopePush | Destination::PyroscopeIngest => "spool",
            Destination::Otlp => "spool-otlp",
        }
    }

    /// For messages and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Destination::PyroscopePush | Destination::PyroscopeIngest => "pyroscope",
            Destination::Otlp => "otlp",
        }
    }
}

/// One store profiles are pushed to.
#[derive(Clone, Debug, PartialEq)]
pub struct PushTarget {
    /// What it is.
    pub destination: Destination,
    /// Its base URL, without a trailing `/` (the protocol's path is appended).
    pub url: String,
}

/// Where and how profiles are pushed.
#[derive(Clone, Debug, PartialEq)]
pub struct PushConfig {
    /// The stores (at most one Pyroscope and one OTLP endpoint).
    pub targets: Vec<PushTarget>,
    /// `service_name` of every profile; `None`: each process's own (its systemd unit,
    /// else its command name).
    pub service_name: Option<String>,
    /// File holding `Bearer TOKEN` or `USER:PASSWORD` (else the environment).
    pub credentials_file: Option<PathBuf>,
    /// `X-Scope-OrgID` for multi-tenant servers.
    pub tenant: Option<String>,
    /// Per-request timeout.
    pub timeout: Duration,
    /// Bound of each store's on-disk spool of undelivered profiles.
    pub spool_max_bytes: u64,
    /// Most distinct label sets pushed to Pyroscope within an hour (its per-tenant
    /// series limit): a profile of a new one beyond it is dropped and counted.
    pub max_series: usize,
    /// Credentials may be sent over plain `http://` (off by default).
    pub allow_insecure_http: bool,
    /// PEM certificates trusted besides the public roots (a private CA).
    pub ca_file: Option<PathBuf>,
}

/// Pyroscope's default `max_global_series_per_tenant`.
pub const DEFAULT_MAX_SERIES: usize = 5000;

/// A base URL as the config may hold it: http(s), without credentials.
fn base_url(key: &str, url: String) -> Result<String> {
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(ConfigError::Invalid(format!(
            "{key} {url:?} must start with http:// or https://"
        )));
    }
    let authority = url
        .split_once("://")
        .map_or("", |(_, rest)| rest.split('/').next().unwrap_or(""));
    if authority.contains('@') {
        return Err(ConfigError::PushCredentials);
    }
    Ok(url.trim_end_matches('/').to_string())
}

/// The push settings, if a Pyroscope URL (the override's, else the file's) or an OTLP
/// endpoint is set.
pub(super) fn push_config(url: Option<String>, file: PushFile) -> Result<Option<PushConfig>> {
    let mut targets = Vec::new();
    if let Some(url) = url.or(file.url) {
        let destination = match file.protocol.as_deref() {
            None | Some("push") => Destination::PyroscopePush,
            Some("ingest") => Destination::PyroscopeIngest,
            Some(other) => {
                return Err(ConfigError::Invalid(format!(
                    "config key push.protocol: {other:?} is not push or ingest"
                )))
            }
        };
        targets.push(PushTarget {
            destination,
            url: base_url("push URL", url)?,
        });
    } else if file.protocol.is_some() {
        return Err(ConfigError::Invalid(
            "config key push.protocol is set but push.url is not".into(),
        ));
    }
    if let Some(endpoint) = file.otlp_endpoint {
        targets.push(PushTarget {
            destination: Destination::Otlp,
            url: base_url("push.otlp_endpoint", endpoint)?,
        });
    }
    if targets.is_empty() {
        return Ok(None);
    }
    for (key, value) in [
        ("push.service_name", &file.service_name),
        ("push.application", &file.application),
    ] {
        if value.as_ref().is_some_and(|name| name.trim().is_empty()) {
            return Err(ConfigError::Invalid(format!(
                "config key {key} is empty (leave it out for each process's own service name)"
            )));
        }
    }
    Ok(Some(PushConfig {
        targets,
        // `application` (the name of the series before service names) is a fixed
        // service name: that is what Pyroscope makes of it.
        service_name: file.service_name.or(file.application),
        credentials_file: file.credentials_file,
        tenant: file.tenant,
        timeout: duration(
            "push.timeout",
            file.timeout.as_deref(),
            Duration::from_secs(10),
        )?,
        spool_max_bytes: size(
            "push.spool_max_bytes",
            file.spool_max_bytes.as_deref(),
            256 << 20,
            1 << 40,
        )?,
        max_series: match file.max_series {
            Some(0) => {
                return Err(ConfigError::Invalid(
                    "config key push.max_series must be at least 1".into(),
                ))
            }
            Some(n) => n,
            None => DEFAULT_MAX_SERIES,
        },
        allow_insecure_http: file.allow_insecure_http.unwrap_or(false),
        ca_file: file.ca_file,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Option<PushConfig>> {
        push_config(None, toml::from_str(text).unwrap())
    }

    #[test]
    fn targets_from_the_section() {
        let config = parse(
            "url = \"http://p:4040/\"\notlp_endpoint = \"https://c:4318\"\nprotocol = \"ingest\"",
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            config.targets,
            vec![
                PushTarget {
                    destination: Destination::PyroscopeIngest,
                    url: "http://p:4040".into()
                },
                PushTarget {
                    destination: Destination::Otlp,
                    url: "https://c:4318".into()
                }
            ]
        );
        assert_eq!(config.max_series, DEFAULT_MAX_SERIES);
        let otlp_only = parse("otlp_endpoint = \"http://c:4318\"").unwrap().unwrap();
        assert_eq!(otlp_only.targets[0].destination, Destination::Otlp);
        assert!(parse("").unwrap().is_none());
    }

    #[test]
    fn bad_values_are_named() {
        for (text, expected) in [
            ("url = \"http://p\"\nprotocol = \"grpc\"", "push.protocol"),
            ("protocol = \"push\"", "push.url is not"),
            ("otlp_endpoint = \"c:4318\"", "push.otlp_endpoint"),
            ("otlp_endpoint = \"http://u:p@c:4318\"", "credentials"),
            ("url = \"http://p\"\nservice_name = \" \"", "service_name"),
            ("url = \"http://p\"\napplication = \"\"", "push.application"),
            ("url = \"http://p\"\nmax_series = 0", "max_series"),
        ] {
            let error = parse(text).unwrap_err().to_string();
            assert!(error.contains(expected), "{text}: {error}");
        }
    }
}
