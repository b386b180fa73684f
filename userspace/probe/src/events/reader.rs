//! The ring-buffer reader: a thread of its own moves records from the kernel ring into
//! a bounded queue, so the ring is emptied while its consumer examines an image,
//! symbolizes a cut or refreshes the interval table.
//!
//! Why a thread: the consumer's heavy steps (reading and disassembling a newly mapped
//! allocator, symbolizing every process at a cut) take up to seconds. With the ring read
//! only between them, a burst of samples meanwhile overflowed the kernel ring and was
//! lost. The thread does nothing but copy records out (no decoding, no allocation per
//! record), so it keeps up whatever the consumer does.
//!
//! Bounds: the queue holds at most [`QUEUE_BYTES`] of records, in chunks of up to about
//! [`CHUNK_BYTES`]. When it is full the thread waits, records stay in the kernel ring, and
//! once that is full too the kernel counts what it drops, as before. Chunks are allocated above glibc's mmap
//! threshold (the agent fixes it at 128 KiB), so a drained burst gives its memory back.

use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        mpsc::{self, Receiver, SyncSender, TryRecvError},
        Arc,
    },
    thread::JoinHandle,
    time::Duration,
};

use aya::maps::{MapData, RingBuf};
use tokio::sync::Notify;

use super::{decode, Event};
use crate::sampler::EventRings;

/// The reader looks at the ring at least this often. The kernel side wakes it at most
/// once per [`allocbpf_common::RING_WAKEUP_INTERVAL_NS`] per CPU (a wakeup costs the
/// traced thread microseconds), so records written after a wakeup may wait this long.
pub const RING_POLL_EVERY: Duration = Duration::from_millis(50);

/// A chunk is sent once it holds this many bytes of records (or the ring is empty).
pub const CHUNK_BYTES: usize = 1 << 20;

/// Record bytes queued between the reader thread and the consumer at most: twice what
/// the kernel ring holds. At the default rate a busy host sends a few MB a second, so a
/// stall of the consumer of a few seconds is absorbed; a flood (tens of MB a second) is
/// not. Unlike the kernel ring (resident twice over, for good), the queue is resident
/// only while a burst lasts.
pub const QUEUE_BYTES: u64 = 16 << 20;

/// Messages the channel holds at most: chunks are bounded by [`QUEUE_BYTES`], and while
/// the consumer is behind each is close to [`CHUNK_BYTES`], so this is never the bound
/// that binds (it only keeps the channel's own memory bounded).
const QUEUE_MESSAGES: usize = 4096;

/// Chunks one `read_batch` decodes at most: decoded events take about as much memory
/// as their records, so the consumer holds ~2 MiB of them at a time, not the queue.
pub const BATCH_CHUNKS: usize = 2;

/// How often a reader facing a full queue looks again.
const FULL_QUEUE_RETRY: Duration = Duration::from_millis(1);

/// `BPF_RINGBUF_HDR_SZ`: the kernel ring's bytes per record beyond its data.
const RECORD_HEADER: u64 = 8;

/// Figures of the reader, readable from any thread.
#[derive(Debug, Default)]
pub struct ReaderStats {
    /// The most kernel-ring bytes (records with their 8-byte headers) found waiting at
    /// one read: how much of the ring the workload has needed so far.
    pub ring_peak_bytes: AtomicU64,
    /// Record bytes queued for the consumer now.
    pub queued_bytes: AtomicU64,
    /// The most record bytes queued for the consumer at once.
    pub queue_peak_bytes: AtomicU64,
}

/// What the reader thread sends, in ring order.
enum Message {
    /// Records, each as a native-endian `u32` length and that many bytes.
    Chunk(Vec<u8>),
    /// Everything the ring held when a [`EventReader::drain`] asked has been sent.
    Drained,
    /// Reading the ring failed; the thread has ended.
    Failed(io::Error),
}

/// Reader of the sample ring buffer, fed by its own thread.
pub struct EventReader {
    queue: Option<Receiver<Message>>,
    /// Written to ask the thread for a drain, or (with `stop`) to end it.
    wake: OwnedFd,
    stop: Arc<AtomicBool>,
    arrived: Arc<Notify>,
    thread: Option<JoinHandle<()>>,
    /// Live figures, shared with the thread.
    pub stats: Arc<ReaderStats>,
    /// Records too short to decode (a version mismatch; should stay 0).
    pub malformed: u64,
    /// Set once the thread has reported a read error.
    failed: bool,
    /// A read error met by `drain`, for the next `read_batch` to return.
    pending_error: Option<io::Error>,
    /// A drain was asked for and its answer has not arrived yet.
    draining: bool,
}

impl EventReader {
    /// Starts the reader thread on a sampler's rings.
    pub fn new(rings: EventRings) -> io::Result<Self> {
        // SAFETY: eventfd has no memory-safety preconditions; the result is checked.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a new descriptor that nothing else owns.
        let wake = unsafe { OwnedFd::from_raw_fd(raw) };
        let (sender, queue) = mpsc::sync_channel(QUEUE_MESSAGES);
        let stop = Arc::new(AtomicBool::new(false));
        let arrived = Arc::new(Notify::new());
        let stats = Arc::new(ReaderStats::default());
        let thread = {
            let pump = Pump {
                ring: rings.events,
                lost: rings.lost,
                ring_bytes: u64::from(rings.events_bytes),
                pending: Vec::new(),
                wake: wake.as_raw_fd(),
                sender,
                stop: stop.clone(),
                arrived: arrived.clone(),
                stats: stats.clone(),
            };
            std::thread::Builder::new()
                .name("ring-reader".into())
                .spawn(move || pump.run())?
        };
        Ok(Self {
            queue: Some(queue),
            wake,
            stop,
            arrived,
            thread: Some(thread),
            stats,
            malformed: 0,
            failed: false,
            pending_error: None,
            draining: false,
        })
    }

    /// Waits until records are available, or at most [`RING_POLL_EVERY`], then appends
    /// up to `BATCH_CHUNKS` chunks of queued records to `out` (possibly none). A read
    /// error of the ring is returned once, after the records read before it.
    pub async fn read_batch(&mut self, out: &mut Vec<Event>) -> io::Result<()> {
        if let Some(error) = self.pending_error.take() {
            return Err(error);
        }
        if self.take_queued(out, BATCH_CHUNKS)? == 0 {
            let _ = tokio::time::timeout(RING_POLL_EVERY, self.arrived.notified()).await;
            self.take_queued(out, BATCH_CHUNKS)?;
        }
        Ok(())
    }

    /// Appends every record in the kernel ring now, and everything queued before it,
    /// without waiting for new ones (the final drain of a one-process run). See
    /// [`EventReader::drain_some`] for a drain in bounded steps.
    pub fn drain(&mut self, out: &mut Vec<Event>) {
        while self.drain_some(out) {}
    }

    /// One step of a drain: the first call asks the reader thread for everything in the
    /// kernel ring now; each call appends at most one chunk (~1 MiB of records) to
    /// `out`, and returns false once everything queued before the ask is out. Stepping
    /// lets the caller handle each chunk before decoding the next, so a full queue is
    /// never decoded at once (that would double the queue's memory).
    pub fn drain_some(&mut self, out: &mut Vec<Event>) -> bool {
        if !self.draining {
            if self.failed || self.signal().is_err() {
                let _ = self.take_queued(out, usize::MAX);
                return false;
            }
            self.draining = true;
        }
        let Some(queue) = self.queue.as_ref() else {
            self.draining = false;
            return false;
        };
        // Bounded: the thread answers within one ring read (it never waits on anything
        // but this queue, which is being emptied here).
        let more = match queue.recv() {
            Ok(Message::Chunk(chunk)) => {
                unpack(&self.stats, &mut self.malformed, &chunk, out);
                true
            }
            Ok(Message::Drained) | Err(_) => false,
            Ok(Message::Failed(error)) => {
                // Returned by the next `read_batch`: the caller stops on it.
                self.failed = true;
                self.pending_error = Some(error);
                false
            }
        };
        self.draining = more;
        more
    }

    /// Appends at most `chunks` of what is queued now; the number of chunks taken.
    fn take_queued(&mut self, out: &mut Vec<Event>, chunks: usize) -> io::Result<usize> {
        let mut taken = 0;
        while taken < chunks {
            let Some(queue) = self.queue.as_ref() else {
                break;
            };
            match queue.try_recv() {
                Ok(Message::Chunk(chunk)) => {
                    unpack(&self.stats, &mut self.malformed, &chunk, out);
                    taken += 1;
                }
                // An answer to a drain whose caller already returned (it cannot
                // happen: drains wait for theirs); harmless.
                Ok(Message::Drained) => {}
                Ok(Message::Failed(error)) => {
                    self.failed = true;
                    return Err(error);
                }
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
            }
        }
        Ok(taken)
    }

    fn signal(&self) -> io::Result<()> {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to a descriptor we own.
        let written = unsafe { libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
        if written == 8 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

impl Drop for EventReader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Unblocks a thread waiting for queue space, then wakes one waiting in poll.
        drop(self.queue.take());
        let _ = self.signal();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Decodes a chunk's records into `out`, counting those that do not decode.
fn unpack(stats: &ReaderStats, malformed: &mut u64, chunk: &[u8], out: &mut Vec<Event>) {
    stats
        .queued_bytes
        .fetch_sub(chunk.len() as u64, Ordering::Relaxed);
    let mut rest = chunk;
    while let Some((len, tail)) = rest.split_first_chunk::<4>() {
        let len = (u32::from_ne_bytes(*len) as usize).min(tail.len());
        match decode(&tail[..len]) {
            Some(event) => out.push(event),
            None => *malformed += 1,
        }
        rest = &tail[len..];
    }
}

/// Appends one record (length, then bytes) to `pending`; false once `pending` holds a
/// chunk's worth, to be sent.
fn append(pending: &mut Vec<u8>, record: &[u8]) -> bool {
    pending.extend_from_slice(&(record.len() as u32).to_ne_bytes());
    pending.extend_from_slice(record);
    pending.len() < CHUNK_BYTES
}

/// The reader thread's side.
struct Pump {
    ring: RingBuf<MapData>,
    /// Samples `ring` had no room for: small records, read after `ring` at each pass.
    lost: RingBuf<MapData>,
    /// The ring's size: one pass takes at most this much, so a pass measures what was
    /// waiting (not what producers added while it ran) and the consumer gets chunks
    /// during a flood.
    ring_bytes: u64,
    /// Records read and not sent yet (at most about a chunk).
    pending: Vec<u8>,
    wake: RawFd,
    sender: SyncSender<Message>,
    stop: Arc<AtomicBool>,
    arrived: Arc<Notify>,
    stats: Arc<ReaderStats>,
}

impl Pump {
    fn run(mut self) {
        loop {
            let drain_asked = match self.wait() {
                Ok(asked) => asked,
                Err(error) => {
                    // What was read before the error goes first.
                    let chunk = std::mem::take(&mut self.pending);
                    if chunk.is_empty() || self.send(chunk) {
                        let _ = self.sender.send(Message::Failed(error));
                        self.arrived.notify_one();
                    }
                    return;
                }
            };
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            if !self.move_records() {
                return;
            }
            // While the consumer is behind, a pass's records wait in `pending` for the
            // next pass (up to a chunk): on a host of many CPUs each wakeup would
            // otherwise queue a chunk of its own.
            let behind = self.stats.queued_bytes.load(Ordering::Relaxed) > 0;
            if !self.pending.is_empty() && (drain_asked || !behind) {
                let chunk = std::mem::take(&mut self.pending);
                if !self.send(chunk) {
                    return;
                }
            }
            if drain_asked && self.sender.send(Message::Drained).is_err() {
                return;
            }
        }
    }

    /// Waits for records, a drain request or [`RING_POLL_EVERY`]; true if a drain was
    /// asked for.
    fn wait(&mut self) -> io::Result<bool> {
        let mut fds = [
            libc::pollfd {
                fd: self.ring.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.wake,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.lost.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a live array of three pollfd structs.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), 3, RING_POLL_EVERY.as_millis() as i32) };
        if ready < 0 {
            let error = io::Error::last_os_error();
            return match error.kind() {
                io::ErrorKind::Interrupted => Ok(false),
                _ => Err(error),
            };
        }
        if (fds[0].revents | fds[2].revents) & (libc::POLLERR | libc::POLLNVAL) != 0 {
            return Err(io::Error::other("the ring buffer's descriptor failed"));
        }
        if fds[1].revents & libc::POLLIN == 0 {
            return Ok(false);
        }
        let mut count = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live 8-byte buffer.
        unsafe { libc::read(self.wake, count.as_mut_ptr().cast(), 8) };
        Ok(true)
    }

    /// Moves the records in the ring (up to its size), then those of the lost ring,
    /// into `pending`, sending it each time it reaches [`CHUNK_BYTES`]; false once the
    /// consumer is gone.
    fn move_records(&mut self) -> bool {
        let mut ring_bytes = 0;
        while ring_bytes < self.ring_bytes {
            let Some(item) = self.ring.next() else { break };
            ring_bytes += (item.len() as u64).next_multiple_of(8) + RECORD_HEADER;
            if !append(&mut self.pending, &item) {
                drop(item);
                if !self.send_pending() {
                    return false;
                }
            }
        }
        self.stats
            .ring_peak_bytes
            .fetch_max(ring_bytes, Ordering::Relaxed);
        // The lost ring is small (its records are a few dozen bytes): read it whole.
        loop {
            let Some(item) = self.lost.next() else { break };
            if !append(&mut self.pending, &item) {
                drop(item);
                if !self.send_pending() {
                    return false;
                }
            }
        }
        true
    }

    /// Sends `pending` as a chunk; false once the consumer is gone.
    fn send_pending(&mut self) -> bool {
        let chunk = std::mem::take(&mut self.pending);
        self.send(chunk)
    }

    fn send(&self, chunk: Vec<u8>) -> bool {
        if chunk.is_empty() {
            return true;
        }
        let len = chunk.len() as u64;
        // Bounded in bytes, not chunks: a pass that found little sends a small chunk.
        while self.stats.queued_bytes.load(Ordering::Relaxed) + len > QUEUE_BYTES
            && self.stats.queued_bytes.load(Ordering::Relaxed) > 0
        {
            if self.stop.load(Ordering::Acquire) {
                return false;
            }
            std::thread::sleep(FULL_QUEUE_RETRY);
        }
        let queued = self.stats.queued_bytes.fetch_add(len, Ordering::Relaxed) + len;
        self.stats
            .queue_peak_bytes
            .fetch_max(queued, Ordering::Relaxed);
        let sent = self.sender.send(Message::Chunk(chunk)).is_ok();
        self.arrived.notify_one();
        sent
    }
}
