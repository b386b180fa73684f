//! The push spool: a bounded on-disk queue of undelivered profiles (`STORE/spool/`).
//!
//! One file per profile, `NNNNNNNNNNNNNNNN.spool` (a JSON line of metadata, then the
//! gzipped pprof), written under a `.tmp` name, synced and renamed. Bounded in bytes:
//! when a new profile does not fit, the oldest are dropped (and counted by the caller).
//! It survives restarts; `.tmp` files a crash left behind are removed at open, and a
//! spool directory deleted under a running agent is created again at the next write.
//!
//! One `Spool` serves the agent's whole life (opened once, shared by every pusher a
//! reload starts, its bound adjusted in place): two would number records from the same
//! sequence and overwrite each other's files, and the second's open would remove the
//! first's `.tmp` in progress.
//!
//! A record that failed on its own (the server took others meanwhile, or may) carries
//! its [`Retry`] state: the delivery skips it until `not_before`, so the records
//! behind it go on.

use std::{
    collections::VecDeque,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Mutex,
    },
    time::Instant,
};

use anyhow::{Context, Result};

use super::PushMeta;
use crate::store::{create_private_dir, remove_temporary_files, sync_directory, write_private};

/// The bounded on-disk queue of undelivered profiles.
#[derive(Debug)]
pub(crate) struct Spool {
    dir: PathBuf,
    max_bytes: AtomicU64,
    queue: Mutex<Queue>,
    next: AtomicU64,
    /// A record was added or removed since the directory was last synced.
    dirty: AtomicBool,
}

/// The records, oldest first, and their total size.
#[derive(Debug, Default)]
struct Queue {
    entries: VecDeque<Entry>,
    bytes: u64,
}

#[derive(Debug)]
struct Entry {
    path: PathBuf,
    bytes: u64,
    retry: Option<Retry>,
}

/// How a record that failed on its own is retried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Retry {
    /// Its failures so far.
    pub failures: u32,
    /// Failures after which other records had been delivered: evidence that the
    /// record, not the server, is the problem.
    pub strikes: u32,
    /// Profiles delivered in all (any record) at its last failure.
    pub delivered_at_failure: u64,
    /// Not tried again before this.
    pub not_before: Instant,
}

/// What the delivery should do next.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Send this record (with its retry state, if it failed before).
    Ready(PathBuf, Option<Retry>),
    /// Every record waits for its retry time; the earliest.
    Later(Instant),
    /// Nothing spooled.
    Empty,
}

impl Spool {
    pub(crate) fn open(dir: &Path, max_bytes: u64) -> Result<Spool> {
        create_private_dir(dir)
            .with_context(|| format!("creating the spool directory {}", dir.display()))?;
        // A crash between write and rename leaves a .tmp: never delivered, so removed.
        remove_temporary_files(dir);
        let mut files: Vec<(PathBuf, u64)> = std::fs::read_dir(dir)?
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "spool"))
            .map(|e| (e.path(), e.metadata().map(|m| m.len()).unwrap_or(0)))
            .collect();
        files.sort();
        let next = files
            .last()
            .and_then(|(p, _)| p.file_stem()?.to_str()?.parse::<u64>().ok())
            .map_or(0, |n| n + 1);
        let bytes = files.iter().map(|f| f.1).sum();
        let entries = files
            .into_iter()
            .map(|(path, bytes)| Entry {
                path,
                bytes,
                retry: None,
            })
            .collect();
        Ok(Spool {
            dir: dir.to_path_buf(),
            max_bytes: AtomicU64::new(max_bytes),
            queue: Mutex::new(Queue { entries, bytes }),
            next: AtomicU64::new(next),
            dirty: AtomicBool::new(false),
        })
    }

    /// Changes the bound (a reload); drops the oldest while the spool is larger.
    /// Returns how many were dropped.
    pub(crate) fn set_max_bytes(&self, max_bytes: u64) -> u64 {
        self.max_bytes.store(max_bytes, Ordering::Relaxed);
        let mut queue = self.queue.lock().expect("spool lock");
        self.trim(&mut queue)
    }

    /// Drops the oldest records while the spool is over its bound (keeping the newest).
    fn trim(&self, queue: &mut Queue) -> u64 {
        let max_bytes = self.max_bytes.load(Ordering::Relaxed);
        let mut dropped = 0;
        while queue.bytes > max_bytes && queue.entries.len() > 1 {
            let oldest = queue.entries.pop_front().expect("non-empty");
            let _ = std::fs::remove_file(&oldest.path);
            queue.bytes -= oldest.bytes;
            dropped += 1;
        }
        if dropped > 0 {
            self.dirty.store(true, Ordering::Relaxed);
        }
        dropped
    }

    /// Adds a profile; drops the oldest while it does not fit. Returns how many were
    /// dropped.
    pub(crate) fn push(&self, meta: &PushMeta, gzipped: &[u8]) -> Result<u64> {
        let mut record = serde_json::to_vec(meta)?;
        record.push(b'\n');
        record.extend_from_slice(gzipped);
        let seq = self.next.fetch_add(1, Ordering::Relaxed);
        let path = self.dir.join(format!("{seq:016}.spool"));
        let temp = self.dir.join(format!("{seq:016}.tmp"));
        let written = write_private(&temp, &path, &record).or_else(|error| {
            if error.kind() != std::io::ErrorKind::NotFound {
                return Err(error);
            }
            // The directory was deleted under us: create it again.
            create_private_dir(&self.dir)?;
            write_private(&temp, &path, &record)
        });
        written.with_context(|| format!("writing {}", path.display()))?;
        self.dirty.store(true, Ordering::Relaxed);
        let mut queue = self.queue.lock().expect("spool lock");
        queue.entries.push_back(Entry {
            path,
            bytes: record.len() as u64,
            retry: None,
        });
        queue.bytes += record.len() as u64;
        Ok(self.trim(&mut queue))
    }

    /// The oldest record.
    #[cfg(test)]
    pub(crate) fn front(&self) -> Option<PathBuf> {
        let queue = self.queue.lock().expect("spool lock");
        queue.entries.front().map(|e| e.path.clone())
    }

    /// The record to send at `now`: the oldest that never failed; else the oldest of
    /// those that failed on their own whose retry time has come. A failed record goes
    /// behind every other, so it never holds them back.
    pub(crate) fn next(&self, now: Instant) -> Next {
        let queue = self.queue.lock().expect("spool lock");
        let mut retried: Option<&Entry> = None;
        let mut earliest: Option<Instant> = None;
        for entry in &queue.entries {
            match entry.retry {
                None => return Next::Ready(entry.path.clone(), None),
                Some(retry) if retry.not_before > now => {
                    earliest = Some(earliest.map_or(retry.not_before, |t| t.min(retry.not_before)));
                }
                Some(_) => {
                    retried.get_or_insert(entry);
                }
            }
        }
        match (retried, earliest) {
            (Some(entry), _) => Next::Ready(entry.path.clone(), entry.retry),
            (None, Some(at)) => Next::Later(at),
            (None, None) => Next::Empty,
        }
    }

    /// Records `retry` for `path` (if it is still spooled).
    pub(crate) fn set_retry(&self, path: &Path, retry: Retry) {
        let mut queue = self.queue.lock().expect("spool lock");
        if let Some(entry) = queue.entries.iter_mut().find(|e| e.path == path) {
            entry.retry = Some(retry);
        }
    }

    /// Removes `path` (delivered, or dropped) and deletes its file. False if it was no
    /// longer spooled (dropped meanwhile to keep the bound: counted then).
    pub(crate) fn remove(&self, path: &Path) -> bool {
        let mut queue = self.queue.lock().expect("spool lock");
        let Some(at) = queue.entries.iter().position(|e| e.path == path) else {
            return false;
        };
        let entry = queue.entries.remove(at).expect("found");
        queue.bytes -= entry.bytes;
        drop(queue);
        let _ = std::fs::remove_file(path);
        self.dirty.store(true, Ordering::Relaxed);
        true
    }

    /// (records, bytes) spooled.
    pub(crate) fn sizes(&self) -> (u64, u64) {
        let queue = self.queue.lock().expect("spool lock");
        (queue.entries.len() as u64, queue.bytes)
    }

    /// Makes the records added and removed since the last call durable: fsyncs the
    /// directory (a renamed or deleted file is only sure to stay so after that). Once
    /// per cut, not per record.
    pub(crate) fn sync_dir(&self) -> std::io::Result<()> {
        if !self.dirty.swap(false, Ordering::Relaxed) {
            return Ok(());
        }
        sync_directory(&self.dir).inspect_err(|_| self.dirty.store(true, Ordering::Relaxed))
    }
}
