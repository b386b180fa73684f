//! A TCP proxy in front of a real server that holds every answer back once: the server
//! as a slow or distant one looks to the agent, with everything else real.

use std::{
    io::{Read, Write},
    net::{Shutdown, TcpListener, TcpStream},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    thread,
    time::Duration,
};

use anyhow::Result;

/// A running proxy; dropping it stops accepting (connections open finish).
pub struct SlowProxy {
    port: u16,
    stop: Arc<AtomicBool>,
    delay_ms: Arc<AtomicU64>,
}

impl SlowProxy {
    /// Listens on a free loopback port and forwards to `127.0.0.1:upstream`, every
    /// answer held back `delay` before its first byte (once per answer, however many
    /// reads it arrives in).
    pub fn start(upstream: u16, delay: Duration) -> Result<SlowProxy> {
        let listener = TcpListener::bind(("127.0.0.1", 0))?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let stop = Arc::new(AtomicBool::new(false));
        let delay_ms = Arc::new(AtomicU64::new(delay.as_millis() as u64));
        {
            let stop = stop.clone();
            let delay_ms = delay_ms.clone();
            thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((client, _)) => {
                            let delay_ms = delay_ms.clone();
                            thread::spawn(move || {
                                let _ = relay(client, upstream, &delay_ms);
                            });
                        }
                        Err(_) => thread::sleep(Duration::from_millis(10)),
                    }
                }
            });
        }
        Ok(SlowProxy {
            port,
            stop,
            delay_ms,
        })
    }

    /// The port the agent should use.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Changes the delay from now on.
    pub fn set_delay(&self, delay: Duration) {
        self.delay_ms
            .store(delay.as_millis() as u64, Ordering::Relaxed);
    }
}

impl Drop for SlowProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Copies client to server as it comes, and server to client late: the first bytes
/// after each request bytes wait `delay_ms`.
fn relay(client: TcpStream, upstream: u16, delay_ms: &AtomicU64) -> Result<()> {
    let server = TcpStream::connect(("127.0.0.1", upstream))?;
    client.set_nonblocking(false)?;
    // Set when request bytes went up, cleared when the answer's first bytes come down.
    let awaiting = Arc::new(AtomicBool::new(false));
    let (mut client_read, mut server_write) = (client.try_clone()?, server.try_clone()?);
    let forward = {
        let awaiting = awaiting.clone();
        thread::spawn(move || {
            let mut buf = [0u8; 65536];
            while let Ok(n) = client_read.read(&mut buf) {
                if n == 0 || server_write.write_all(&buf[..n]).is_err() {
                    break;
                }
                awaiting.store(true, Ordering::Relaxed);
            }
            let _ = server_write.shutdown(Shutdown::Write);
        })
    };
    let (mut server_read, mut client_write) = (server, client);
    let mut buf = [0u8; 65536];
    while let Ok(n) = server_read.read(&mut buf) {
        if n == 0 {
            break;
        }
        if awaiting.swap(false, Ordering::Relaxed) {
            thread::sleep(Duration::from_millis(delay_ms.load(Ordering::Relaxed)));
        }
        if client_write.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = client_write.shutdown(Shutdown::Both);
    let _ = forward.join();
    Ok(())
}
