//! Running `allocbpf agent` in tests and the soak bench, and reading what it produced.

use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex, MutexGuard},
    thread,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result};

use crate::{allocbpf_bin, compile_workload, go_pprof, require_root, scratch_dir, Lines};

static ONE_AGENT_AT_A_TIME: Mutex<()> = Mutex::new(());

/// What every agent test starts with: root, the one-agent lock (held until the guard
/// drops: the agent is system-wide, so its tests run one at a time), and a scratch
/// directory named `name` (canonical: the maps show real paths) with the store path
/// under it.
pub fn one_agent_test(name: &str) -> (MutexGuard<'static, ()>, PathBuf, PathBuf) {
    require_root();
    let guard = ONE_AGENT_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let scratch = std::fs::canonicalize(scratch_dir(name)).unwrap();
    let store = scratch.join("store");
    (guard, scratch, store)
}

/// The agent tests' workload (`workloads/agentwl.c`: its comm is what they filter on).
pub fn agent_workload() -> PathBuf {
    compile_workload("agentwl", &["-O1", "-g", "-fno-omit-frame-pointer"]).unwrap()
}

/// Now, in Unix milliseconds.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// `go tool pprof -raw` of a gzipped profile.
pub fn raw_pprof(profile: &Path, scratch: &Path) -> String {
    go_pprof(&["-raw"], profile, scratch)
}

/// An agent with `config` storing into `store`, cutting every `interval`, with `extra`
/// flags and `env` variables.
pub fn start_filtered(
    config: &Path,
    store: &Path,
    interval: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> AgentProcess {
    let mut args = vec![
        "--config",
        config.to_str().unwrap(),
        "--store",
        store.to_str().unwrap(),
        "--interval",
        interval,
    ];
    args.extend_from_slice(extra);
    AgentProcess::start(&args, env).unwrap()
}

/// A running agent.
pub struct AgentProcess {
    /// The process.
    pub child: Child,
    /// Its stderr (logs), line by line.
    pub stderr: Lines,
}

impl AgentProcess {
    /// Starts `allocbpf agent` with `args` (and `config` written to `store/../agent.toml`
    /// if given); waits for "agent started".
    pub fn start(args: &[&str], env: &[(&str, &str)]) -> Result<AgentProcess> {
        let mut child = Command::new(allocbpf_bin())
            .arg("agent")
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting allocbpf agent")?;
        let mut stderr = Lines::spawn(child.stderr.take().unwrap());
        if let Err(error) = stderr.wait_for("agent started", Duration::from_secs(60)) {
            let _ = child.kill();
            return Err(error);
        }
        Ok(AgentProcess { child, stderr })
    }

    /// Starts `allocbpf agent` at its defaults but its store (`store`) and metrics
    /// address (`metrics`): the agent a user starts.
    pub fn start_default(store: &Path, metrics: &str) -> Result<AgentProcess> {
        let store = store.to_str().context("a store path in UTF-8")?;
        Self::start(&["--store", store, "--metrics-address", metrics], &[])
    }

    /// Starts `allocbpf agent` storing into `store`, cutting every `interval` and
    /// serving its metrics on `metrics`, with no other flag.
    pub fn start_storing(store: &Path, interval: &str, metrics: &str) -> Result<AgentProcess> {
        let store = store.to_str().context("a store path in UTF-8")?;
        Self::start(
            &[
                "--store",
                store,
                "--interval",
                interval,
                "--metrics-address",
                metrics,
            ],
            &[],
        )
    }

    /// Sends SIGHUP and returns the agent's verdict: its next `SIGHUP: config ...` line.
    pub fn reload(&mut self, timeout: Duration) -> Result<String> {
        // SAFETY: plain kill(2) on our child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGHUP) };
        self.stderr.wait_for("SIGHUP: config", timeout)
    }

    /// Sends SIGTERM and waits for the exit; returns all of stderr.
    pub fn terminate(mut self, timeout: Duration) -> Result<String> {
        // SAFETY: plain kill(2) on our child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let rest = self.stderr.rest(timeout);
        let status = self.child.wait()?;
        anyhow::ensure!(status.success(), "agent exited with {status}: {rest}");
        Ok(rest)
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Writes an agent config file into `dir` and returns its path.
pub fn write_config(dir: &Path, text: &str) -> PathBuf {
    let path = dir.join("agent.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// The stored profiles under `store` (`profiles/DAY/START-END-PID-COMM.pb.gz`).
pub fn stored_profiles(store: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(days) = std::fs::read_dir(store.join("profiles")) else {
        return out;
    };
    for day in days.flatten() {
        for file in std::fs::read_dir(day.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            if file.path().to_string_lossy().ends_with(".pb.gz") {
                out.push(file.path());
            }
        }
    }
    out.sort();
    out
}

/// (start_ms, end_ms, pid, comm) from a stored profile's file name.
pub fn parse_stored_name(path: &Path) -> (u64, u64, u32, String) {
    let name = path.file_name().unwrap().to_str().unwrap();
    let name = name.strip_suffix(".pb.gz").unwrap();
    let parts: Vec<&str> = name.splitn(4, '-').collect();
    (
        parts[0].parse().unwrap(),
        parts[1].parse().unwrap(),
        parts[2].parse().unwrap(),
        parts[3].to_string(),
    )
}

/// One request a [`Receiver`] got.
#[derive(Clone, Debug)]
pub struct Received {
    /// The request line's target (path and query).
    pub target: String,
    /// The headers, lowercased names.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
    /// The status it was answered with.
    pub status: u16,
}

impl Received {
    /// A query parameter, percent-decoded.
    pub fn query(&self, key: &str) -> Option<String> {
        let query = self.target.split_once('?')?.1;
        query.split('&').find_map(|pair| {
            let (k, v) = pair.split_once('=')?;
            (k == key).then(|| percent_decode(v))
        })
    }

    /// The profile: the `profile` part of a multipart/form-data body, or the whole
    /// body of another content type (`/ingest?format=pprof` sends it raw).
    pub fn profile_part(&self) -> Option<Vec<u8>> {
        let content_type = self
            .headers
            .iter()
            .find(|(k, _)| k == "content-type")?
            .1
            .clone();
        if !content_type.starts_with("multipart/") {
            return Some(self.body.clone());
        }
        let boundary = content_type.split("boundary=").nth(1)?.trim();
        let delimiter = format!("--{boundary}");
        let body = &self.body;
        let start = find(body, delimiter.as_bytes())?;
        let after = &body[start..];
        if !String::from_utf8_lossy(&after[..after.len().min(300)]).contains("name=\"profile\"") {
            return None;
        }
        let data_start = find(after, b"\r\n\r\n")? + 4;
        let data = &after[data_start..];
        let end = find(data, format!("\r\n{delimiter}").as_bytes())?;
        Some(data[..end].to_vec())
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("00");
                out.push(u8::from_str_radix(hex, 16).unwrap_or(b'?'));
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A minimal HTTP/1.1 server standing in for Pyroscope: answers every request 200 and
/// keeps it. Dropping it closes the port (the "store is down").
pub struct Receiver {
    /// Requests received so far.
    pub received: Arc<Mutex<Vec<Received>>>,
    stop: Arc<Mutex<bool>>,
    status: Arc<std::sync::atomic::AtomicU16>,
    /// (part of the `name` parameter, status): requests whose name contains the part
    /// are answered with the status instead.
    rules: Arc<Mutex<Vec<(String, u16)>>>,
    port: u16,
}

impl Receiver {
    /// Listens on `port` (0: any free port).
    pub fn start(port: u16) -> Result<Receiver> {
        let listener = TcpListener::bind(("127.0.0.1", port))?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let received = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(Mutex::new(false));
        let status = Arc::new(std::sync::atomic::AtomicU16::new(200));
        let rules: Arc<Mutex<Vec<(String, u16)>>> = Arc::default();
        {
            let received = received.clone();
            let stop = stop.clone();
            let status = status.clone();
            let rules = rules.clone();
            thread::spawn(move || loop {
                if *stop.lock().unwrap() {
                    return;
                }
                match listener.accept() {
                    Ok((stream, _)) => {
                        let code = |target: &str| {
                            let name = Received {
                                target: target.to_string(),
                                headers: Vec::new(),
                                body: Vec::new(),
                                status: 0,
                            }
                            .query("name")
                            .unwrap_or_default();
                            rules
                                .lock()
                                .unwrap()
                                .iter()
                                .find(|(part, _)| name.contains(part.as_str()))
                                .map_or_else(
                                    || status.load(std::sync::atomic::Ordering::Relaxed),
                                    |(_, code)| *code,
                                )
                        };
                        if let Ok(request) = read_request(stream, code) {
                            received.lock().unwrap().push(request);
                        }
                    }
                    Err(_) => thread::sleep(Duration::from_millis(20)),
                }
            });
        }
        Ok(Receiver {
            received,
            stop,
            status,
            rules,
            port,
        })
    }

    /// Answers every request from now on with `code` (200 at start).
    pub fn answer(&self, code: u16) {
        self.status
            .store(code, std::sync::atomic::Ordering::Relaxed);
    }

    /// Answers the requests whose `name` parameter (the series, `app{k=v,...}`)
    /// contains `part` with `code` from now on, whatever [`Receiver::answer`] says.
    pub fn answer_when(&self, part: &str, code: u16) {
        self.rules.lock().unwrap().push((part.to_string(), code));
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        *self.stop.lock().unwrap() = true;
        thread::sleep(Duration::from_millis(50));
    }
}

fn read_request(mut stream: TcpStream, status_for: impl Fn(&str) -> u16) -> Result<Received> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut data = Vec::new();
    let mut buf = [0u8; 65536];
    let header_end = loop {
        let n = stream.read(&mut buf)?;
        anyhow::ensure!(n > 0, "connection closed in headers");
        data.extend_from_slice(&buf[..n]);
        if let Some(end) = find(&data, b"\r\n\r\n") {
            break end;
        }
    };
    let head = String::from_utf8_lossy(&data[..header_end]).into_owned();
    let mut lines = head.split("\r\n");
    let target = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .unwrap_or("")
        .to_string();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_lowercase(), v.trim().to_string()))
        .collect();
    let length: usize = headers
        .iter()
        .find(|(k, _)| k == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let status = status_for(&target);
    let mut body = data[header_end + 4..].to_vec();
    while body.len() < length {
        let n = stream.read(&mut buf)?;
        anyhow::ensure!(n > 0, "connection closed in body");
        body.extend_from_slice(&buf[..n]);
    }
    let reason = if status == 200 { "OK" } else { "Test" };
    stream.write_all(
        format!("HTTP/1.1 {status} {reason}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    )?;
    Ok(Received {
        target,
        headers,
        body,
        status,
    })
}

/// `GET http://addr/metrics`, every read and write bounded by 10 s.
pub fn scrape(address: &str) -> Result<String> {
    scrape_within(address, Duration::from_secs(10))
}

/// `GET http://addr/metrics`, every read and write bounded by `timeout`.
pub fn scrape_within(address: &str, timeout: Duration) -> Result<String> {
    let mut stream = TcpStream::connect(address)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")?;
    let mut text = String::new();
    stream.read_to_string(&mut text)?;
    Ok(text)
}

/// The value of an unlabelled metric in a Prometheus text exposition.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// What an agent stored of one runtime workload's run ([`profile_workload_under_agent`]).
pub struct AgentRun {
    /// Its stored profiles merged by `allocbpf report` (JSON), the workload's stacks
    /// only.
    pub profile: serde_json::Value,
    /// Its stored profiles as `go tool pprof -raw` prints them (their labels).
    pub pprof: String,
    /// What the workload printed.
    pub output: String,
}

/// Runs `workload` (started, waiting for its go) under an agent that profiles only the
/// processes whose command matches `comm`, with its budget off (the estimates are then
/// full-time sampling's), once the agent has said `found` of it at its start-up scan
/// (or later); stops the agent after the workload's exit. `name` names the scratch
/// directory. The caller holds the profilers' lock.
pub fn profile_workload_under_agent(
    name: &str,
    comm: &str,
    mut workload: crate::Workload,
    found: &str,
) -> Result<AgentRun> {
    let (_one, scratch, store) = one_agent_test(name);
    let config = write_config(
        &scratch,
        &format!("comm = \"{comm}\"\nmetrics_address = \"off\"\n[budget]\nenabled = false\n"),
    );
    let mut agent = start_filtered(&config, &store, "2s", &[], &[]);
    if !agent.stderr.seen.iter().any(|line| line.contains(found)) {
        agent.stderr.wait_for(found, Duration::from_secs(30))?;
    }
    workload.go()?;
    workload.wait(Duration::from_secs(180))?;
    let output = workload.stdout.rest(Duration::from_secs(5));
    thread::sleep(Duration::from_secs(3));
    let pid = workload.pid;
    agent.terminate(Duration::from_secs(30))?;
    let mine: Vec<PathBuf> = (stored_profiles(&store).into_iter())
        .filter(|p| parse_stored_name(p).2 == pid)
        .collect();
    anyhow::ensure!(
        !mine.is_empty(),
        "no profile of pid {pid} in {}",
        store.display()
    );
    let pprof: String = mine.iter().map(|p| raw_pprof(p, &scratch)).collect();
    let store_path = store.to_str().context("path")?;
    let merged = crate::run_allocbpf(
        &[
            "report", "--store", store_path, "--comm", comm, "--format", "json",
        ],
        Duration::from_secs(60),
    )?;
    anyhow::ensure!(merged.code == Some(0), "{}", merged.stderr);
    let mut profile: serde_json::Value = serde_json::from_str(&merged.stdout)?;
    if let Some(stacks) = profile["stacks"].as_array_mut() {
        stacks.retain(|s| s["pid"].as_u64() == Some(u64::from(pid)));
    }
    Ok(AgentRun {
        profile,
        pprof,
        output,
    })
}
