//! A real OpenTelemetry Collector for the tests: started on a loopback port with an
//! OTLP receiver and a file exporter, and what it received read back.
//!
//! The collector is built by `cargo xtask setup` from `tests/servers/otelcol/builder.yaml`
//! (see the README.md beside it): its path is `$ALLOCBPF_OTELCOL` (set by xtask), else
//! `target/servers/otelcol-<hash of the manifest>/otelcol-allocbpf`.
//!
//! What the collector (v0.161.0) serves, as verified by running it:
//! - OTLP/HTTP profiles at [`PROFILES_PATH`] (`/v1development/profiles`), bodies
//!   `application/x-protobuf` or `application/json`; only with the feature gate
//!   `service.profilesSupport` (which [`Collector::start`] passes).
//! - Success: 200 with an `ExportProfilesServiceResponse` (protobuf `0a 00`: an empty
//!   partial_success). A missing or wrong bearer token: 401 with a `google.rpc.Status`
//!   (code 16, UNAUTHENTICATED) in the request's content type, whose message is
//!   "missing or empty authorization header: Authorization" or "provided authorization
//!   does not match expected scheme or token".
//!
//! The file exporter writes one `ExportProfilesServiceRequest` in OTLP JSON per line,
//! appending (`append: true`), so a restarted collector keeps what came before.

use std::{
    fs::OpenOptions,
    net::{Ipv4Addr, SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Mutex, PoisonError},
    thread,
    time::{Duration, Instant},
};

use allocbpf_harness::net::free_port;
use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;

use crate::workspace_root;

pub mod received;

use self::received::complete_lines;
pub use self::received::{
    parse_export_request, parse_received, ReceivedFrame, ReceivedProfile, ReceivedSample,
};

/// Where the collector binary is (`cargo xtask` sets it).
pub const OTELCOL_ENV: &str = "ALLOCBPF_OTELCOL";

/// The OTLP/HTTP path the collector's receiver serves profiles at.
pub const PROFILES_PATH: &str = "/v1development/profiles";

/// The feature gate without which a profiles pipeline is a config error.
pub const PROFILES_FEATURE_GATE: &str = "+service.profilesSupport";

/// Where `cargo xtask setup` records the path of the collector it built or found for
/// the manifest as it is (under the workspace root).
pub const OTELCOL_CURRENT: &str = "target/servers/otelcol.current";

/// The collector binary: `$ALLOCBPF_OTELCOL`, else the one `cargo xtask setup` last
/// recorded in [`OTELCOL_CURRENT`].
pub fn otelcol_bin() -> Result<PathBuf> {
    let path = match std::env::var_os(OTELCOL_ENV) {
        Some(path) => PathBuf::from(path),
        None => {
            let current = workspace_root().join(OTELCOL_CURRENT);
            let text = std::fs::read_to_string(&current).with_context(|| {
                format!(
                    "no OpenTelemetry Collector recorded in {}: run `cargo xtask setup` (it \
                     builds one from tests/servers/otelcol/builder.yaml), or set ${OTELCOL_ENV}",
                    current.display()
                )
            })?;
            PathBuf::from(text.trim_end())
        }
    };
    ensure!(
        path.exists(),
        "the OpenTelemetry Collector {} does not exist: run `cargo xtask setup`",
        path.display()
    );
    Ok(path)
}

/// How to run the collector.
#[derive(Clone, Debug)]
pub struct CollectorOptions {
    /// Require `Authorization: Bearer TOKEN` on the OTLP receivers (else 401).
    pub bearer_token: Option<String>,
    /// The OTLP/HTTP port on 127.0.0.1; `None`: a free one.
    pub port: Option<u16>,
    /// Also serve OTLP/gRPC, on another free port ([`Collector::grpc_port`]).
    pub grpc: bool,
    /// Also log every request in detail to the collector's log (the debug exporter).
    pub debug_exporter: bool,
    /// How often the file exporter flushes its buffer (it writes nothing before).
    pub flush_interval: Duration,
}

impl Default for CollectorOptions {
    fn default() -> Self {
        Self {
            bearer_token: None,
            port: None,
            grpc: false,
            debug_exporter: false,
            // A 1 ms or 10 ms flush ticker costs the idle collector ~1.5% of a core (1 s:
            // nothing measurable); 10 ms is quick enough for polling.
            flush_interval: Duration::from_millis(10),
        }
    }
}

/// A running collector. Dropping it kills it.
pub struct Collector {
    binary: PathBuf,
    child: Mutex<Option<Child>>,
    config: PathBuf,
    output: PathBuf,
    log: PathBuf,
    port: u16,
    grpc_port: Option<u16>,
}

impl Collector {
    /// Writes a config into `scratch` and starts the collector; returns once its ports
    /// accept connections. Files in `scratch`: `otelcol.yaml` (the config),
    /// `received.jsonl` (what it received; emptied here), `otelcol.log` (its stderr).
    pub fn start(scratch: &Path, options: CollectorOptions) -> Result<Collector> {
        let binary = otelcol_bin()?;
        std::fs::create_dir_all(scratch)?;
        let output = scratch.join("received.jsonl");
        let _ = std::fs::remove_file(&output);
        let mut last_error = None;
        // A port picked free may be taken before the collector binds it: pick again.
        for _ in 0..if options.port.is_some() { 1 } else { 3 } {
            let port = match options.port {
                Some(port) => port,
                None => free_port()?,
            };
            let grpc_port = if options.grpc {
                Some(free_port()?)
            } else {
                None
            };
            let mut collector = Collector {
                binary: binary.clone(),
                child: Mutex::new(None),
                config: scratch.join("otelcol.yaml"),
                output: output.clone(),
                log: scratch.join("otelcol.log"),
                port,
                grpc_port,
            };
            std::fs::write(
                &collector.config,
                config_yaml(&options, port, grpc_port, &output)?,
            )?;
            match collector.spawn() {
                Ok(()) => return Ok(collector),
                Err(error) => last_error = Some(error),
            }
        }
        Err(last_error.expect("tried at least once"))
    }

    /// Starts the process and waits for its ports.
    fn spawn(&mut self) -> Result<()> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let log_start = log.metadata()?.len();
        let child = Command::new(&self.binary)
            .arg(format!("--config=file:{}", self.config.display()))
            .arg(format!("--feature-gates={PROFILES_FEATURE_GATE}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", self.binary.display()))?;
        *self.child_mut() = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        let ports: Vec<u16> = std::iter::once(self.port).chain(self.grpc_port).collect();
        loop {
            let child = self.child_mut().as_mut().expect("just spawned");
            if let Some(status) = child.try_wait()? {
                *self.child_mut() = None;
                bail!(
                    "the collector exited ({status}) before listening on {ports:?}: {}",
                    log_since(&self.log, log_start)
                );
            }
            if ports.iter().all(|&port| {
                TcpStream::connect_timeout(
                    &SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
                    Duration::from_millis(200),
                )
                .is_ok()
            }) {
                return Ok(());
            }
            if Instant::now() > deadline {
                self.kill();
                bail!(
                    "the collector did not listen on {ports:?} within 30 s: {}",
                    log_since(&self.log, log_start)
                );
            }
            thread::sleep(Duration::from_millis(25));
        }
    }

    /// Stops it (SIGTERM: it flushes and closes the output), waiting up to 10 s, then
    /// kills it.
    pub fn stop(&mut self) -> Result<()> {
        let Some(child) = self.child_mut().take() else {
            return Ok(());
        };
        crate::terminate(child, "the collector", Duration::from_secs(10), || {
            self.log()
        })
    }

    /// Stops it (if running) and starts it again with the same config: the same ports,
    /// the same output file, appended to.
    pub fn restart(&mut self) -> Result<()> {
        self.stop()?;
        self.spawn()
    }

    /// True while the process runs.
    pub fn is_running(&self) -> bool {
        self.child
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_mut()
            .is_some_and(|child| matches!(child.try_wait(), Ok(None)))
    }

    fn child_mut(&mut self) -> &mut Option<Child> {
        self.child.get_mut().unwrap_or_else(PoisonError::into_inner)
    }

    /// The OTLP/HTTP port (on 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The OTLP/gRPC port, if [`CollectorOptions::grpc`].
    pub fn grpc_port(&self) -> Option<u16> {
        self.grpc_port
    }

    /// `http://127.0.0.1:PORT`: the OTLP/HTTP base URL an exporter is given.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The full profiles URL: [`Collector::endpoint`] + [`PROFILES_PATH`].
    pub fn profiles_url(&self) -> String {
        format!("{}{PROFILES_PATH}", self.endpoint())
    }

    /// The file the exporter writes (one JSON request per line).
    pub fn output_path(&self) -> &Path {
        &self.output
    }

    /// The collector's log (stdout and stderr of every run) so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Every export request received so far, as OTLP JSON, in order. A last line still
    /// being written is left out.
    pub fn received_requests(&self) -> Result<Vec<Value>> {
        let text = match std::fs::read_to_string(&self.output) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e).context("reading the collector's output"),
        };
        complete_lines(&text)
            .map(|line| serde_json::from_str(line).context("a line of the collector's output"))
            .collect()
    }

    /// Every profile received so far, resolved through each request's dictionary.
    pub fn received(&self) -> Result<Vec<ReceivedProfile>> {
        let mut profiles = Vec::new();
        for (index, request) in self.received_requests()?.iter().enumerate() {
            profiles.extend(parse_export_request(request, index)?);
        }
        Ok(profiles)
    }

    /// Polls [`Collector::received`] until `predicate` holds for what was received, and
    /// returns that; fails after `timeout`, or as soon as the collector is gone.
    pub fn wait_for(
        &self,
        mut predicate: impl FnMut(&[ReceivedProfile]) -> bool,
        timeout: Duration,
    ) -> Result<Vec<ReceivedProfile>> {
        let deadline = Instant::now() + timeout;
        loop {
            let received = self.received()?;
            if predicate(&received) {
                return Ok(received);
            }
            ensure!(
                self.is_running(),
                "the collector is not running (received {} profiles): {}",
                received.len(),
                self.log()
            );
            if Instant::now() > deadline {
                bail!(
                    "not received within {timeout:?}: {} profiles in {} requests so far",
                    received.len(),
                    received.last().map_or(0, |p| p.request + 1)
                );
            }
            thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child_mut().take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The log from byte `start` on (this run's part), for errors.
fn log_since(log: &Path, start: u64) -> String {
    let text = std::fs::read(log).unwrap_or_default();
    let start = usize::try_from(start).unwrap_or(0).min(text.len());
    String::from_utf8_lossy(&text[start..]).into_owned()
}

/// A string for the collector's YAML config: a JSON string (valid YAML) with `$`
/// doubled (the config resolver expands `${...}`).
fn yaml_string(s: &str) -> Result<String> {
    Ok(serde_json::to_string(s)?.replace('$', "$$"))
}

/// The collector's config.
fn config_yaml(
    options: &CollectorOptions,
    port: u16,
    grpc_port: Option<u16>,
    output: &Path,
) -> Result<String> {
    let auth = if options.bearer_token.is_some() {
        "        auth:\n          authenticator: bearertokenauth\n"
    } else {
        ""
    };
    let mut yaml = String::new();
    if let Some(token) = &options.bearer_token {
        yaml.push_str(&format!(
            "extensions:\n  bearertokenauth:\n    token: {}\n",
            yaml_string(token)?
        ));
    }
    yaml.push_str("receivers:\n  otlp:\n    protocols:\n");
    yaml.push_str(&format!(
        "      http:\n        endpoint: 127.0.0.1:{port}\n{auth}"
    ));
    if let Some(grpc_port) = grpc_port {
        yaml.push_str(&format!(
            "      grpc:\n        endpoint: 127.0.0.1:{grpc_port}\n{auth}"
        ));
    }
    let output = yaml_string(output.to_str().context("non-UTF-8 scratch path")?)?;
    let flush_ms = options.flush_interval.as_millis().max(1);
    yaml.push_str(&format!(
        "exporters:\n  file:\n    path: {output}\n    format: json\n    append: true\n    \
         flush_interval: {flush_ms}ms\n"
    ));
    if options.debug_exporter {
        yaml.push_str("  debug:\n    verbosity: detailed\n");
    }
    let exporters = if options.debug_exporter {
        "[file, debug]"
    } else {
        "[file]"
    };
    if options.bearer_token.is_some() {
        yaml.push_str("service:\n  extensions: [bearertokenauth]\n");
    } else {
        yaml.push_str("service:\n");
    }
    // No internal metrics endpoint (it would take port 8888 in every collector).
    yaml.push_str(&format!(
        "  telemetry:\n    metrics:\n      level: none\n  pipelines:\n    profiles:\n      \
         receivers: [otlp]\n      exporters: {exporters}\n"
    ));
    Ok(yaml)
}

#[cfg(test)]
mod tests {
    use super::{received::tests::REAL_LINE, *};

    /// POSTs `body` as OTLP JSON to the collector's profiles path over plain HTTP/1.1;
    /// returns the status and body. No `Connection: close`: with it, the collector closes
    /// a refused (401) request's connection with its body unread, and the client may see
    /// a reset instead of the response (seen: 2 runs in 6).
    fn post_json(collector: &Collector, token: Option<&str>, body: &str) -> (u16, String) {
        use std::io::{BufRead, BufReader, Read, Write};
        let mut stream = TcpStream::connect(("127.0.0.1", collector.port())).unwrap();
        let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
        write!(
            stream,
            "POST {PROFILES_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\n\
             Content-Type: application/json\r\n{auth}Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        let status = line[9..12].parse().unwrap();
        let mut length = 0;
        loop {
            line.clear();
            reader.read_line(&mut line).unwrap();
            if line.trim().is_empty() {
                break;
            }
            if let Some((name, value)) = line.split_once(':') {
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.trim().parse().unwrap();
                }
            }
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body).unwrap();
        (status, String::from_utf8(body).unwrap())
    }

    /// The real collector (built by `cargo xtask setup`; no root needed): the captured
    /// request sent back comes out the same, a wrong token is refused, and a restart
    /// appends.
    #[test]
    fn collector_receives_refuses_and_restarts() {
        let scratch = crate::scratch_dir("otelcol-harness");
        let mut collector = Collector::start(
            &scratch,
            CollectorOptions {
                bearer_token: Some("right".into()),
                grpc: true,
                ..CollectorOptions::default()
            },
        )
        .unwrap();
        let sent = parse_received(REAL_LINE).unwrap();
        let line = REAL_LINE.trim_end();

        let (status, body) = post_json(&collector, Some("wrong"), line);
        assert_eq!(status, 401, "{body}");
        assert!(body.contains("does not match"), "{body}");
        let (status, body) = post_json(&collector, None, line);
        assert_eq!(status, 401, "{body}");
        assert!(
            body.contains("missing or empty authorization header"),
            "{body}"
        );
        let (status, body) = post_json(&collector, Some("right"), line);
        assert_eq!(status, 200, "{body}");

        let received = collector
            .wait_for(|p| !p.is_empty(), Duration::from_secs(10))
            .unwrap();
        assert_eq!(received, sent);

        let port = collector.port();
        collector.restart().unwrap();
        assert_eq!(collector.port(), port);
        assert_eq!(post_json(&collector, Some("right"), line).0, 200);
        let received = collector
            .wait_for(|p| p.len() == 4, Duration::from_secs(10))
            .unwrap();
        assert_eq!(received[3].request, 1);
        collector.stop().unwrap();
        assert!(!collector.is_running());
        let _ = std::fs::remove_dir_all(&scratch);
    }

    #[test]
    fn config_has_auth_and_the_profiles_pipeline() {
        let options = CollectorOptions {
            bearer_token: Some("t$k".into()),
            grpc: true,
            ..CollectorOptions::default()
        };
        let yaml = config_yaml(&options, 4318, Some(4317), Path::new("/s/r.jsonl")).unwrap();
        assert!(yaml.contains("token: \"t$$k\""), "{yaml}");
        assert_eq!(yaml.matches("authenticator: bearertokenauth").count(), 2);
        assert!(yaml.contains("endpoint: 127.0.0.1:4318"));
        assert!(yaml.contains("path: \"/s/r.jsonl\""));
        assert!(yaml.contains("exporters: [file]"));
    }
}
