//! The systemd notify protocol: `READY=1` once probes are attached, `WATCHDOG=1` while
//! the agent works, `STOPPING=1` at SIGTERM.
//!
//! Why a watchdog: an agent whose main thread hangs (a file operation that blocks despite
//! every bound, a kernel call that never returns) stops sampling silently; systemd
//! restarts one that stops feeding (`WatchdogSec=` in the unit). The main loop feeds it,
//! and only while the writer thread is not stuck on one profile (or job) for longer than
//! the watchdog period, so a store on a hung disk is seen too.
//!
//! Without `NOTIFY_SOCKET` (not started by systemd) nothing is sent.

use std::{
    os::{
        linux::net::SocketAddrExt,
        unix::{
            ffi::OsStrExt,
            net::{SocketAddr, UnixDatagram},
        },
    },
    time::{Duration, Instant},
};

/// The notify socket and, when the unit sets `WatchdogSec=`, the watchdog period.
pub struct Notifier {
    socket: UnixDatagram,
    address: SocketAddr,
    watchdog: Option<Duration>,
    last_feed: Option<Instant>,
}

impl Notifier {
    /// The notifier systemd asked for through `NOTIFY_SOCKET` (and `WATCHDOG_USEC`,
    /// `WATCHDOG_PID`), or `None` when there is none or it is unusable (logged).
    pub fn from_env() -> Option<Notifier> {
        let path = std::env::var_os("NOTIFY_SOCKET")?;
        let watchdog = watchdog_period(
            std::env::var("WATCHDOG_USEC").ok().as_deref(),
            std::env::var("WATCHDOG_PID").ok().as_deref(),
            std::process::id(),
        );
        match Notifier::connect(path.as_encoded_bytes(), watchdog) {
            Ok(notifier) => Some(notifier),
            Err(error) => {
                tracing::warn!("NOTIFY_SOCKET unusable, systemd will not be notified: {error}");
                None
            }
        }
    }

    /// A notifier sending to the socket at `path` (`@name`: abstract namespace).
    pub fn connect(path: &[u8], watchdog: Option<Duration>) -> std::io::Result<Notifier> {
        let address = match path.strip_prefix(b"@") {
            Some(name) => SocketAddr::from_abstract_name(name)?,
            None => SocketAddr::from_pathname(std::ffi::OsStr::from_bytes(path))?,
        };
        Ok(Notifier {
            socket: UnixDatagram::unbound()?,
            address,
            watchdog,
            last_feed: None,
        })
    }

    /// Tells systemd start-up is over.
    pub fn ready(&self) {
        self.send("READY=1");
    }

    /// Tells systemd the agent is stopping (the flush may take the push timeout).
    pub fn stopping(&self) {
        self.send("STOPPING=1");
    }

    /// Feeds the watchdog (at most every twentieth of the period: a main-loop step may
    /// then take up to 95% of the period) unless `stalled_for`, the time the writer
    /// has been on its current profile, exceeds the period: then the agent lets systemd
    /// restart it.
    pub fn feed(&mut self, stalled_for: Duration) {
        let Some(period) = self.watchdog else {
            return;
        };
        if stalled_for > period {
            return;
        }
        let now = Instant::now();
        if self
            .last_feed
            .is_some_and(|last| now.duration_since(last) < period / 20)
        {
            return;
        }
        self.last_feed = Some(now);
        self.send("WATCHDOG=1");
    }

    fn send(&self, message: &str) {
        // Non-blocking in effect: a datagram to a local socket; an error is logged only.
        if let Err(error) = self.socket.send_to_addr(message.as_bytes(), &self.address) {
            tracing::warn!("systemd notification {message:?} not sent: {error}");
        }
    }
}

/// The watchdog period from `WATCHDOG_USEC`, if it is meant for `pid` (`WATCHDOG_PID`
/// unset or equal).
fn watchdog_period(usec: Option<&str>, for_pid: Option<&str>, pid: u32) -> Option<Duration> {
    if for_pid.is_some_and(|p| p.parse::<u32>().ok() != Some(pid)) {
        return None;
    }
    let usec: u64 = usec?.parse().ok()?;
    (usec > 0).then(|| Duration::from_micros(usec))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_period_is_for_this_pid_only() {
        assert_eq!(
            watchdog_period(Some("2000000"), None, 7),
            Some(Duration::from_secs(2))
        );
        assert_eq!(
            watchdog_period(Some("2000000"), Some("7"), 7),
            Some(Duration::from_secs(2))
        );
        assert_eq!(watchdog_period(Some("2000000"), Some("8"), 7), None);
        assert_eq!(watchdog_period(Some("0"), None, 7), None);
        assert_eq!(watchdog_period(Some("x"), None, 7), None);
        assert_eq!(watchdog_period(None, None, 7), None);
    }

    #[test]
    fn feeds_every_half_period_and_not_while_the_writer_is_stuck() {
        // An abstract socket, as systemd itself uses: no file to clean up.
        let name = format!("allocbpf-watchdog-test-{}", std::process::id());
        let systemd =
            UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
        systemd.set_nonblocking(true).unwrap();
        let mut notifier = Notifier::connect(
            format!("@{name}").as_bytes(),
            Some(Duration::from_millis(2000)),
        )
        .unwrap();
        let received = || {
            let mut all = Vec::new();
            let mut buf = [0u8; 64];
            while let Ok(n) = systemd.recv(&mut buf) {
                all.push(String::from_utf8_lossy(&buf[..n]).into_owned());
            }
            all
        };
        notifier.ready();
        notifier.feed(Duration::ZERO);
        notifier.feed(Duration::ZERO); // within a twentieth of the period: not sent again
        assert_eq!(received(), ["READY=1", "WATCHDOG=1"]);
        std::thread::sleep(Duration::from_millis(120));
        notifier.feed(Duration::from_millis(3000)); // writer stuck over the period
        assert!(received().is_empty());
        notifier.feed(Duration::from_millis(10));
        assert_eq!(received(), ["WATCHDOG=1"]);
    }
}
