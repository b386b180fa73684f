//! The delivery thread: the spool, oldest first, through one transport, with
//! back-off (the failure kinds are in the module docs of [`super`]).

use std::{
    io::Read,
    path::Path,
    sync::{atomic::AtomicBool, atomic::Ordering, mpsc},
    time::{Duration, Instant},
};

use anyhow::Context;

use super::spool::{Next, Retry, Spool};
use super::{http::Failure, publish_sizes, Message, PushMeta, PushStats, Transport};

const BACKOFF_INITIAL: Duration = Duration::from_secs(1);
/// The longest back-off.
pub(super) const BACKOFF_MAX: Duration = Duration::from_secs(60);

/// A record that failed on its own this many times, each after other records had been
/// delivered since its previous failure, is dropped (`abandoned`): at least six
/// failures over about half a minute (its back-off) while the server took the rest.
pub const MAX_STRIKES: u32 = 5;

/// The back-off after `failures` failures in a row: 1 s doubling to 60 s.
fn backoff_after(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(6);
    (BACKOFF_INITIAL * (1 << doublings)).min(BACKOFF_MAX)
}

/// The retry state of a record that failed on its own (`retry`: its state before, if
/// it failed before), `delivered` profiles having been delivered in all: a strike if
/// some were delivered since its previous failure, and its next try after its back-off.
pub(super) fn after_failure(retry: Option<Retry>, delivered: u64, now: Instant) -> Retry {
    let mut retry = retry.unwrap_or(Retry {
        failures: 0,
        strikes: 0,
        delivered_at_failure: delivered,
        not_before: now,
    });
    if retry.failures > 0 && delivered > retry.delivered_at_failure {
        retry.strikes += 1;
    }
    retry.failures += 1;
    retry.delivered_at_failure = delivered;
    retry.not_before = now + backoff_after(retry.failures);
    retry
}

/// The delivery thread's loop: sends the spool's records oldest first through
/// `transport`, backs off as the failure kinds say, and ends on `Stop`, on `stop`, or
/// once a `Flush` has delivered what it could by its deadline.
pub(super) fn deliver(
    transport: &dyn Transport,
    url: &str,
    spool: &Spool,
    stats: &PushStats,
    receiver: &mpsc::Receiver<Message>,
    stop: &AtomicBool,
) {
    let mut pacing = Pacing::new();
    loop {
        // Messages first: a thread working through a backlog never waits on the
        // channel, and a flush's deadline must hold all the same.
        if !pacing.take_messages(receiver) {
            return;
        }
        let now = Instant::now();
        if stop.load(Ordering::Relaxed) || pacing.flush_until.is_some_and(|until| now >= until) {
            return;
        }
        // When the next record may be sent (`None`: nothing spooled).
        let due = match spool.next(now) {
            Next::Empty => None,
            Next::Later(at) => Some(at.max(pacing.paused_until)),
            Next::Ready(_, _) if now < pacing.paused_until => Some(pacing.paused_until),
            Next::Ready(path, retry) => {
                let outcome = send_record(transport, &path);
                pacing.settle(outcome, &path, retry, url, spool, stats);
                publish_sizes(spool, stats);
                continue;
            }
        };
        // A flush (stopping) sends what may be sent now, and waits for no back-off:
        // after a server-wide failure, or with only set-aside records left, it ends.
        if pacing.flush_until.is_some() && due.is_none_or(|due| due > now) {
            return;
        }
        let wait = due.map_or(Duration::from_secs(3600), |due| {
            due.saturating_duration_since(now)
        });
        match receiver.recv_timeout(wait) {
            // New profiles wait for the back-off like the others.
            Ok(Message::Wake) | Err(mpsc::RecvTimeoutError::Timeout) => {}
            // One more try of a server backed off from, before the agent stops.
            Ok(Message::Flush(until)) => pacing.flush(until),
            Ok(Message::Stop) | Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// What the delivery loop carries from one record to the next: the server's back-off,
/// the records failing on their own, and the deadline of a flush asked for.
struct Pacing {
    /// Server-wide failures in a row, which the back-off grows with.
    server_failures: u32,
    /// Server-wide back-off: nothing is sent before this.
    paused_until: Instant,
    /// Records that failed on their own since the last delivery.
    failed_in_a_row: u32,
    /// The deadline of a `Flush`, once one came.
    flush_until: Option<Instant>,
}

impl Pacing {
    /// Nothing failed yet, no flush asked for.
    fn new() -> Self {
        Self {
            server_failures: 0,
            paused_until: Instant::now(),
            failed_in_a_row: 0,
            flush_until: None,
        }
    }

    /// A flush until `until`: a server backed off from gets one more try at once.
    fn flush(&mut self, until: Instant) {
        self.flush_until = Some(until);
        self.paused_until = Instant::now();
    }

    /// Takes the messages waiting, without waiting for any; false on `Stop`.
    fn take_messages(&mut self, receiver: &mpsc::Receiver<Message>) -> bool {
        loop {
            match receiver.try_recv() {
                Ok(Message::Wake) => {}
                Ok(Message::Flush(until)) => self.flush(until),
                Ok(Message::Stop) => return false,
                Err(_) => return true,
            }
        }
    }

    /// Acts on the `outcome` of sending the record at `path` (`retry`: its state if it
    /// failed before): removes it when delivered or never deliverable, backs the
    /// server off after a server-wide failure, and sets a record failing on its own
    /// aside, or drops it after [`MAX_STRIKES`].
    fn settle(
        &mut self,
        outcome: Result<(), Failure>,
        path: &Path,
        retry: Option<Retry>,
        url: &str,
        spool: &Spool,
        stats: &PushStats,
    ) {
        let now = Instant::now();
        match outcome {
            Ok(()) => {
                spool.remove(path);
                stats.delivered.fetch_add(1, Ordering::Relaxed);
                self.server_failures = 0;
                self.failed_in_a_row = 0;
            }
            Err(Failure::Permanent(error)) => {
                // Never deliverable: dropped, so the ones behind it go on.
                if spool.remove(path) {
                    stats.rejected.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        "push to {url} rejected {}: {error:#}; dropped",
                        path.display()
                    );
                }
            }
            Err(Failure::Server(error)) => {
                stats.errors.fetch_add(1, Ordering::Relaxed);
                self.server_failures += 1;
                let wait = backoff_after(self.server_failures);
                self.paused_until = now + wait;
                tracing::warn!(
                    "push to {url} failed: {error:#}; retrying in {}s ({} profile(s) spooled)",
                    wait.as_secs(),
                    spool.sizes().0
                );
            }
            Err(Failure::Record(error)) => {
                stats.errors.fetch_add(1, Ordering::Relaxed);
                self.failed_in_a_row += 1;
                let delivered = stats.delivered.load(Ordering::Relaxed);
                let retry = after_failure(retry, delivered, now);
                if retry.strikes >= MAX_STRIKES {
                    if spool.remove(path) {
                        stats.abandoned.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(
                            "push to {url}: {} failed {} times while other profiles were delivered (last: {error:#}); dropped",
                            path.display(),
                            retry.failures
                        );
                    }
                } else {
                    spool.set_retry(path, retry);
                    tracing::warn!(
                        "push to {url} failed for {}: {error:#}; retrying it in {}s, the others go first",
                        path.display(),
                        backoff_after(retry.failures).as_secs()
                    );
                }
                if self.failed_in_a_row >= 2 {
                    // Two records in a row: more likely the server than them.
                    self.server_failures += 1;
                    self.paused_until = now + backoff_after(self.server_failures);
                }
            }
        }
    }
}

/// Reads the spool record at `path` and sends it.
fn send_record(transport: &dyn Transport, path: &Path) -> std::result::Result<(), Failure> {
    let mut record = Vec::new();
    let read = std::fs::File::open(path).and_then(|mut f| f.read_to_end(&mut record));
    match read {
        Ok(_) => {}
        // Deleted under us (the spool directory removed): nothing left to send.
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            return Err(Failure::Permanent(error.into()))
        }
        Err(error) => {
            return Err(Failure::Record(
                anyhow::Error::new(error).context(format!("reading {}", path.display())),
            ))
        }
    }
    let parsed = record
        .iter()
        .position(|&b| b == b'\n')
        .context("spool record without metadata")
        .and_then(|split| {
            let meta: PushMeta =
                serde_json::from_slice(&record[..split]).context("spool record metadata")?;
            Ok((split, meta))
        });
    let (split, meta) = parsed.map_err(Failure::Permanent)?;
    transport.send(&meta, &record[split + 1..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_its_bound() {
        assert_eq!(backoff_after(1), Duration::from_secs(1));
        assert_eq!(backoff_after(3), Duration::from_secs(4));
        assert_eq!(backoff_after(30), BACKOFF_MAX);
    }
}
