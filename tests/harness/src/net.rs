//! Local network helpers for tests that start servers on this machine's loopback.

use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    time::Duration,
};

use anyhow::{ensure, Context, Result};

/// A free local port (bound, then released for the server to take).
pub fn free_port() -> Result<u16> {
    Ok(TcpListener::bind(("127.0.0.1", 0))?.local_addr()?.port())
}

/// `GET path` on `127.0.0.1:port`: the body of a 200 response (HTTP/1.0, the server
/// closes).
pub fn http_get(port: u16, path: &str) -> Result<Vec<u8>> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response)?;
    let split = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("HTTP response without headers")?;
    ensure!(
        response.starts_with(b"HTTP/1.0 200") || response.starts_with(b"HTTP/1.1 200"),
        "GET {path}: {}",
        String::from_utf8_lossy(&response[..split])
    );
    Ok(response[split + 4..].to_vec())
}
