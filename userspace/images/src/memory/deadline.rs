//! Reads of another process's memory that cannot stall the agent.
//!
//! `process_vm_readv` faults in the pages it reads, and a fault can wait as long as
//! someone else likes: a page of a file on FUSE whose daemon is stopped, or on a network
//! file system whose server is gone, is read only when that server answers, and the
//! wait can be interrupted by nothing short of SIGKILL. The addresses read are chosen
//! by the target (a structure's pointer), so any process could park the agent's thread
//! there, and every process's profiling with it.
//!
//! So every read runs on a reader thread and is waited for at most [`READ_DEADLINE`].
//! A read that does not come back sets its process aside: the reader is abandoned
//! (it ends when its read does) and a new one serves the others; the process's memory
//! is not read again while that read is stuck, nor is that of its user's processes
//! once [`STUCK_PER_USER`] of theirs are (FUSE mounts are their mounter's). At most
//! [`MAX_STUCK`] readers are ever abandoned at once: past that, no memory is read until
//! one returns. A stuck read that returns clears its process.

use std::{
    io,
    sync::{
        atomic::{AtomicU64, Ordering},
        mpsc, Mutex,
    },
    time::Duration,
};

/// How long one read may take before its process is set aside. A read of resident
/// memory takes microseconds; a page swapped out to a local disk, milliseconds.
pub const READ_DEADLINE: Duration = Duration::from_millis(250);

/// Stuck reads of one user's processes before every process of that user is set aside.
pub const STUCK_PER_USER: usize = 2;

/// Readers abandoned at once, host-wide, before no memory is read at all.
pub const MAX_STUCK: usize = 32;

/// Reads that have not come back, by reader.
static STUCK: Mutex<Vec<StuckRead>> = Mutex::new(Vec::new());

/// The reader serving reads now (started at the first read).
static READER: Mutex<Option<Reader>> = Mutex::new(None);

/// Reads that outlived the deadline since start (for metrics).
static STALLED_TOTAL: AtomicU64 = AtomicU64::new(0);

/// Reads refused because their process or user was set aside (for metrics).
static REFUSED_TOTAL: AtomicU64 = AtomicU64::new(0);

/// Reader threads started since start.
static READERS_STARTED: AtomicU64 = AtomicU64::new(0);

/// A read abandoned to its reader.
#[derive(Clone, Copy, Debug)]
struct StuckRead {
    reader: u64,
    pid: u32,
    uid: Option<u32>,
}

/// One read asked of a reader.
struct Request {
    /// The raw read (`process_vm_readv`; a test's own in tests).
    read: RawRead,
    pid: u32,
    address: u64,
    len: usize,
}

/// One read of process memory, on the calling thread.
pub type RawRead = fn(u32, u64, &mut [u8]) -> io::Result<()>;

/// The two ends of a reader thread's channels.
struct Reader {
    id: u64,
    requests: mpsc::Sender<Request>,
    replies: mpsc::Receiver<io::Result<Vec<u8>>>,
}

/// What the reads of other processes' memory went through, since start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadFigures {
    /// Reads that outlived [`READ_DEADLINE`] (each set its process aside).
    pub stalled: u64,
    /// Reads refused because their process, or its user, was set aside.
    pub refused: u64,
    /// Reads stuck now (their readers abandoned).
    pub stuck_now: usize,
}

/// The figures of reads so far.
pub fn figures() -> ReadFigures {
    ReadFigures {
        stalled: STALLED_TOTAL.load(Ordering::Relaxed),
        refused: REFUSED_TOTAL.load(Ordering::Relaxed),
        stuck_now: lock(&STUCK).len(),
    }
}

/// Locks `mutex`, whatever a panicking holder left (the data stays consistent: every
/// holder only pushes, removes or replaces whole values).
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Why a read of `pid` is refused now, if it is.
fn refusal(pid: u32) -> Option<String> {
    let stuck = lock(&STUCK);
    if stuck.is_empty() {
        return None;
    }
    if stuck.len() >= MAX_STUCK {
        return Some(format!(
            "{} reads of other processes' memory are stuck: none is read until one returns",
            stuck.len()
        ));
    }
    if stuck.iter().any(|s| s.pid == pid) {
        return Some(format!(
            "a read of pid {pid}'s memory has not returned: its memory is set aside"
        ));
    }
    let uid = crate::procfs::process_owner(pid)?;
    let of_user = stuck.iter().filter(|s| s.uid == Some(uid)).count();
    (of_user >= STUCK_PER_USER).then(|| {
        format!("{of_user} reads of user {uid}'s processes are stuck: their memory is set aside")
    })
}

/// Fills `buffer` from `address` in process `pid` on this thread through `read`, unless
/// the process is set aside (memory known not to stall: [`super::mappings`]).
pub fn read_unless_set_aside(
    pid: u32,
    address: u64,
    buffer: &mut [u8],
    read: RawRead,
) -> io::Result<()> {
    refuse_if_set_aside(pid)?;
    read(pid, address, buffer)
}

/// `Err` (`WouldBlock`, why) if reads of `pid` are refused now; counted.
fn refuse_if_set_aside(pid: u32) -> io::Result<()> {
    match refusal(pid) {
        Some(why) => {
            REFUSED_TOTAL.fetch_add(1, Ordering::Relaxed);
            Err(io::Error::new(io::ErrorKind::WouldBlock, why))
        }
        None => Ok(()),
    }
}

/// Fills `buffer` from `address` in process `pid` within [`READ_DEADLINE`], through
/// `read` (the raw read) on a reader thread.
pub fn read_within_deadline(
    pid: u32,
    address: u64,
    buffer: &mut [u8],
    read: RawRead,
) -> io::Result<()> {
    refuse_if_set_aside(pid)?;
    let mut reader = lock(&READER);
    let request = Request {
        read,
        pid,
        address,
        len: buffer.len(),
    };
    let current = match reader.take() {
        Some(current) => current,
        None => start_reader()?,
    };
    if current.requests.send(request).is_err() {
        // The reader is gone (it cannot be, short of a panic in a read): start anew.
        return Err(io::Error::other("the memory reader thread ended"));
    }
    match current.replies.recv_timeout(READ_DEADLINE) {
        Ok(reply) => {
            *reader = Some(current);
            let bytes = reply?;
            buffer.copy_from_slice(&bytes);
            Ok(())
        }
        Err(_) => {
            // Set the process aside before the reader is dropped: the reader clears
            // its entry when the read returns and it finds nobody waiting.
            let uid = crate::procfs::process_owner(pid);
            lock(&STUCK).push(StuckRead {
                reader: current.id,
                pid,
                uid,
            });
            STALLED_TOTAL.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                "pid {pid} (uid {uid:?}): a read of its memory at {address:#x} has not returned in \
                 {READ_DEADLINE:?} (a page of a FUSE or network file whose server does not \
                 answer?): its memory is set aside until it does"
            );
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("reading pid {pid}'s memory took longer than {READ_DEADLINE:?}"),
            ))
        }
    }
}

/// Starts a reader thread.
fn start_reader() -> io::Result<Reader> {
    let (requests, incoming) = mpsc::channel::<Request>();
    let (outgoing, replies) = mpsc::channel();
    let id = READERS_STARTED.fetch_add(1, Ordering::Relaxed);
    std::thread::Builder::new()
        .name("allocbpf-read".into())
        .spawn(move || {
            for request in incoming {
                let mut bytes = vec![0u8; request.len];
                let reply = (request.read)(request.pid, request.address, &mut bytes);
                let reply = reply.map(|()| bytes);
                if outgoing.send(reply).is_err() {
                    break;
                }
            }
            // Abandoned (or the agent is stopping): whatever this reader held stuck is
            // over now.
            lock(&STUCK).retain(|stuck| stuck.reader != id);
        })?;
    Ok(Reader {
        id,
        requests,
        replies,
    })
}

#[cfg(test)]
mod tests {
    use std::{
        sync::atomic::AtomicBool,
        time::{Duration, Instant},
    };

    use super::*;

    /// A pid no process has (above the kernel's pid_max limit), so no user either.
    const NO_SUCH_PID: u32 = 0x7fff_fff0;

    /// Lets [`blocked_read`] return.
    static RELEASE: AtomicBool = AtomicBool::new(false);

    /// A read that waits like one of a page on a stopped FUSE daemon, until released.
    fn blocked_read(_: u32, _: u64, buffer: &mut [u8]) -> io::Result<()> {
        while !RELEASE.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(5));
        }
        buffer.fill(7);
        Ok(())
    }

    /// A read that answers at once.
    fn prompt_read(_: u32, _: u64, buffer: &mut [u8]) -> io::Result<()> {
        buffer.fill(9);
        Ok(())
    }

    #[test]
    fn a_stuck_read_sets_its_process_aside_and_others_are_read_meanwhile() {
        let mut word = [0u8; 8];
        let started = Instant::now();
        let error = read_within_deadline(NO_SUCH_PID, 0x1000, &mut word, blocked_read)
            .expect_err("the read never returns");
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert!(
            started.elapsed() < READ_DEADLINE * 4,
            "{:?}",
            started.elapsed()
        );

        // Set aside: refused at once, without a read.
        let started = Instant::now();
        let error = read_within_deadline(NO_SUCH_PID, 0x1000, &mut word, prompt_read)
            .expect_err("set aside");
        assert_eq!(error.kind(), io::ErrorKind::WouldBlock);
        assert!(started.elapsed() < READ_DEADLINE / 2);
        assert!(figures().stuck_now >= 1 && figures().stalled >= 1);

        // Another process is read meanwhile, through a new reader.
        let value: u64 = 0x0123_4567_89ab_cdef;
        let mut read = [0u8; 8];
        let own = std::process::id();
        read_within_deadline(
            own,
            &value as *const u64 as u64,
            &mut read,
            super::super::read_unguarded,
        )
        .unwrap();
        assert_eq!(u64::from_le_bytes(read), value);

        // The stuck read returns: the process is read again.
        RELEASE.store(true, Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_secs(10);
        while read_within_deadline(NO_SUCH_PID, 0x1000, &mut word, prompt_read).is_err() {
            assert!(
                Instant::now() < deadline,
                "the returned read still sets it aside"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(word, [9; 8]);
    }
}
