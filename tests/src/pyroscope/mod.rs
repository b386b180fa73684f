//! A real Grafana Pyroscope server for the tests: started on loopback ports in its
//! single-binary mode (`-target=all`) with filesystem storage, and queried back
//! through its Connect API (JSON).
//!
//! Pyroscope is AGPL, and the Go module proxy refuses its modules, so nothing here
//! builds it: the binary is given by `$ALLOCBPF_PYROSCOPE` (see docs/build.md), and the
//! tests that need it are `#[ignore]`d (CI lists them as ignored; run with `--ignored`
//! they fail, never skip, without it).
//!
//! What the server (v1.21.1) does, as verified by running it:
//! - `/ready` answers 503 until the ingester has joined its ring and then waited
//!   `-ingester.min-ready-duration` (1 s here; 15 s by default, then ~17 s after
//!   start): ~2 s after start here.
//! - SIGTERM flushes the ingester's head into a block under `-pyroscopedb.data-path`
//!   (and ships it to the bucket, `-storage.filesystem.dir`): ~1-2 s. A restart on the
//!   same directories serves what came before.
//! - Queries (`querier.v1.QuerierService/*`, Connect unary, `application/json`) take
//!   start and end in Unix milliseconds and select profiles whose timestamp (the
//!   pprof's `time_nanos`) lies in `[start, end]`, both ends included. JSON carries
//!   int64 values as strings.
//! - `SelectMergeProfile` returns the merged pprof (`google.v1.Profile`) of one
//!   profile type: one sample type, locations with their lines (inlined functions
//!   first) and function names, addresses cleared (the distributor zeroes them in
//!   mappings with functions), samples of equal location lists summed.
//! - Series: one per profile type (`__profile_type__`) and label set. A pushed pprof's
//!   string sample labels become series labels, its numeric ones do not; a sample
//!   type whose values are all zero gets no series (and is absent from
//!   `ProfileTypes`). Values are stored as given (int64; no rounding anywhere), so a
//!   merged query's total is the exact sum of what was pushed.
//! - OTLP profiles (`/v1development/profiles`) are filed under `__name__` = their
//!   period type (`space` for ours), with resource attributes as labels (dots made
//!   `_`) and every sample attribute as a series label too.
//! - Multitenancy on: a request without `X-Scope-OrgID` gets 401 (`unauthenticated: no
//!   org id`); off, every request is tenant `anonymous` and the header is ignored.
//!
//! The harness is split by concern: this module runs the server; `query` holds the
//! Connect queries and push and parses their answers; `http` is the small HTTP/1.1
//! client they go through; `compare` checks what the server holds against the
//! agent's local store; [`scenario`] holds the helpers the e2e tests share.

use std::{
    fs::OpenOptions,
    net::{Ipv4Addr, UdpSocket},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use allocbpf_harness::net::free_port;
use anyhow::{bail, ensure, Context, Result};

mod compare;
mod http;
mod query;
pub mod scenario;

pub use self::compare::time_range;
pub use self::http::{base64, http};
pub use self::query::{parse_merged_profile, profile_type_id, MergedProfile, PushSeries, Series};

/// Where the Pyroscope binary is.
pub const PYROSCOPE_ENV: &str = "ALLOCBPF_PYROSCOPE";

/// How long a start may take to answer `/ready` 200.
const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// The Pyroscope binary: `$ALLOCBPF_PYROSCOPE`, which must exist.
pub fn pyroscope_bin() -> Result<PathBuf> {
    let Some(path) = std::env::var_os(PYROSCOPE_ENV) else {
        bail!(
            "${PYROSCOPE_ENV} is not set: these tests need a Grafana Pyroscope server binary \
             (AGPL: the Go module proxy refuses github.com/grafana/pyroscope, so nothing here \
             builds it; see docs/build.md)"
        );
    };
    let path = PathBuf::from(path);
    ensure!(
        path.is_file(),
        "${PYROSCOPE_ENV} is {}, which is not a file",
        path.display()
    );
    Ok(path)
}

/// How to run the server.
#[derive(Clone, Debug, Default)]
pub struct PyroscopeOptions {
    /// `-auth.multitenancy-enabled`: every request needs `X-Scope-OrgID`.
    pub multitenancy: bool,
}

/// A running Pyroscope. Dropping it kills it.
pub struct Pyroscope {
    binary: PathBuf,
    scratch: PathBuf,
    options: PyroscopeOptions,
    child: Option<Child>,
    http_port: u16,
    grpc_port: u16,
    memberlist_port: u16,
    log: PathBuf,
}

impl Pyroscope {
    /// Starts a server with its data under `scratch` (`data/` the ingester's,
    /// `bucket/` the object store, `compactor/`, `sync/`; `pyroscope.log` its output),
    /// on free loopback ports; returns once `/ready` answers 200.
    pub fn start(scratch: &Path, options: PyroscopeOptions) -> Result<Pyroscope> {
        let binary = pyroscope_bin()?;
        std::fs::create_dir_all(scratch)?;
        let scratch = std::fs::canonicalize(scratch)?;
        let mut last_error = None;
        // A port picked free may be taken before the server binds it: pick again.
        for _ in 0..3 {
            let mut server = Pyroscope {
                binary: binary.clone(),
                scratch: scratch.clone(),
                options: options.clone(),
                child: None,
                http_port: free_port()?,
                grpc_port: free_port()?,
                memberlist_port: free_tcp_and_udp_port()?,
                log: scratch.join("pyroscope.log"),
            };
            match server.spawn() {
                Ok(()) => return Ok(server),
                Err(error) => last_error = Some(error),
            }
        }
        Err(last_error.expect("tried at least once"))
    }

    /// The command line: `/tmp`-free, everything on 127.0.0.1, no phoning home (usage
    /// stats), no self-profiling pushes, no tracing.
    fn args(&self) -> Vec<String> {
        let dir = |name: &str| self.scratch.join(name).display().to_string();
        let mut args: Vec<String> = [
            "-target=all".to_string(),
            "-server.http-listen-address=127.0.0.1".into(),
            format!("-server.http-listen-port={}", self.http_port),
            "-server.grpc-listen-address=127.0.0.1".into(),
            format!("-server.grpc-listen-port={}", self.grpc_port),
            "-memberlist.bind-addr=127.0.0.1".into(),
            "-memberlist.advertise-addr=127.0.0.1".into(),
            format!("-memberlist.bind-port={}", self.memberlist_port),
            format!("-memberlist.advertise-port={}", self.memberlist_port),
            "-ingester.lifecycler.addr=127.0.0.1".into(),
            "-distributor.ring.instance-addr=127.0.0.1".into(),
            "-query-scheduler.ring.instance-addr=127.0.0.1".into(),
            "-query-frontend.instance-addr=127.0.0.1".into(),
            "-store-gateway.sharding-ring.instance-addr=127.0.0.1".into(),
            "-compactor.ring.instance-addr=127.0.0.1".into(),
            "-overrides-exporter.ring.instance-addr=127.0.0.1".into(),
            "-storage.backend=filesystem".into(),
            format!("-storage.filesystem.dir={}", dir("bucket")),
            format!("-pyroscopedb.data-path={}", dir("data")),
            format!("-compactor.data-dir={}", dir("compactor")),
            format!("-blocks-storage.bucket-store.sync-dir={}", dir("sync")),
            "-usage-stats.enabled=false".into(),
            "-self-profiling.disable-push=true".into(),
            "-tracing.enabled=false".into(),
            // A single node has no rolling update to slow down: readiness 1 s after
            // the ring says so, not 15 s.
            "-ingester.min-ready-duration=1s".into(),
        ]
        .into();
        if self.options.multitenancy {
            args.push("-auth.multitenancy-enabled=true".into());
        }
        args
    }

    /// Starts the process and waits for `/ready` 200.
    fn spawn(&mut self) -> Result<()> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let log_start = log.metadata()?.len();
        let child = Command::new(&self.binary)
            .args(self.args())
            // Any relative default path lands in the scratch directory.
            .current_dir(&self.scratch)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", self.binary.display()))?;
        self.child = Some(child);
        let started = Instant::now();
        let mut last: String;
        loop {
            let child = self.child.as_mut().expect("just spawned");
            if let Some(status) = child.try_wait()? {
                self.child = None;
                bail!(
                    "pyroscope exited ({status}) before it was ready: {}",
                    tail(&log_since(&self.log, log_start), 40)
                );
            }
            match http(
                self.http_port,
                "GET",
                "/ready",
                &[],
                b"",
                Duration::from_secs(5),
            ) {
                Ok((200, _)) => return Ok(()),
                Ok((status, body)) => {
                    last = format!("{status} {}", String::from_utf8_lossy(&body).trim())
                }
                Err(error) => last = format!("{error:#}"),
            }
            if started.elapsed() > READY_TIMEOUT {
                self.kill();
                bail!(
                    "pyroscope not ready within {READY_TIMEOUT:?} (last answer: {last}): {}",
                    tail(&log_since(&self.log, log_start), 40)
                );
            }
            thread::sleep(Duration::from_millis(250));
        }
    }

    /// Stops it (SIGTERM: it flushes its head to disk), waiting up to 60 s, then kills
    /// it.
    pub fn stop(&mut self) -> Result<()> {
        let Some(child) = self.child.take() else {
            return Ok(());
        };
        crate::terminate(child, "pyroscope", Duration::from_secs(60), || {
            self.log_tail(40)
        })
    }

    /// Stops it (if running) and starts it again: the same ports, the same data
    /// directories.
    pub fn restart(&mut self) -> Result<()> {
        self.stop()?;
        self.spawn()
    }

    /// True while the process runs.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|child| matches!(child.try_wait(), Ok(None)))
    }

    /// The HTTP port (on 127.0.0.1): every API, push and query.
    pub fn port(&self) -> u16 {
        self.http_port
    }

    /// `http://127.0.0.1:PORT`: the base URL the agent's `push.url` (or
    /// `push.otlp_endpoint`) is given.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.http_port)
    }

    /// The server's log (every run) so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `lines` lines of the log.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.log(), lines)
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// POSTs `body` to `path` with `content_type` (and `X-Scope-OrgID: tenant`);
    /// returns the status and body.
    pub fn post(
        &self,
        path: &str,
        content_type: &str,
        body: &[u8],
        tenant: Option<&str>,
    ) -> Result<(u16, Vec<u8>)> {
        let mut headers = vec![("Content-Type", content_type)];
        if let Some(tenant) = tenant {
            headers.push(("X-Scope-OrgID", tenant));
        }
        http(
            self.http_port,
            "POST",
            path,
            &headers,
            body,
            Duration::from_secs(60),
        )
    }
}

impl Drop for Pyroscope {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A port free for both TCP and UDP on 127.0.0.1 (memberlist gossips over both).
fn free_tcp_and_udp_port() -> Result<u16> {
    for _ in 0..20 {
        let port = free_port()?;
        if UdpSocket::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no port free for both TCP and UDP in 20 tries")
}

/// The log from byte `start` on (this run's part).
fn log_since(log: &Path, start: u64) -> String {
    let text = std::fs::read(log).unwrap_or_default();
    let start = usize::try_from(start).unwrap_or(0).min(text.len());
    String::from_utf8_lossy(&text[start..]).into_owned()
}

/// The last `lines` lines of `text`.
fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
