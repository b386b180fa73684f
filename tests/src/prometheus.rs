//! Debian's prometheus (a real Go server nobody here wrote) as a test target: started
//! on loopback scraping itself, and loaded with scrapes and queries.

use std::{
    path::Path,
    process::{Child, Command},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
};

use allocbpf_harness::net::http_get;
use anyhow::Result;

/// Starts `prometheus` on `127.0.0.1:port`, scraping itself every second, its data
/// and log under `scratch`.
pub fn start_prometheus(prometheus: &Path, scratch: &Path, port: u16) -> Result<Child> {
    let config = scratch.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: self\n    \
             static_configs:\n      - targets: [\"127.0.0.1:{port}\"]\n"
        ),
    )?;
    let server = Command::new(prometheus)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            scratch.join("data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(scratch.join("prometheus.log"))?)
        .spawn()?;
    Ok(server)
}

/// Loads the server on `port` with scrapes of its metrics and queries until `stop`.
pub fn query_load(port: u16, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            let _ = http_get(port, "/metrics");
            let _ = http_get(
                port,
                "/api/v1/query?query=rate(prometheus_http_requests_total%5B1m%5D)",
            );
        }
    })
}
