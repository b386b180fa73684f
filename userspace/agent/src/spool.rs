//! The push spool: a bounded on-disk queue of undelivered profiles (`STORE/spool/`).
//!
//! One file per profile, `NNNNNNNNNNNNNNNN.spool` (a JSON line of metadata, then the
//! gzipped pprof), written under a `.tmp` name, synced and renamed. Bounded in bytes:
//! when a new profile does not fit, the oldest are dropped (and counted by the caller).
//! It survives restarts; `.tmp` files a crash left behind are removed at open, and a
//! spool directory deleted under a running agent is created again at the next write.

use std::{
    collections::VecDeque,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU64, Ordering},
        Mutex,
    },
};

use anyhow::{Context, Result};

use super::{
    push::PushMeta,
    store::{create_private_dir, remove_temporary_files, write_private},
};

/// The bounded on-disk queue of undelivered profiles.
#[derive(Debug)]
pub(super) struct Spool {
    dir: PathBuf,
    max_bytes: u64,
    files: Mutex<(VecDeque<(PathBuf, u64)>, u64)>,
    next: AtomicU64,
}

impl Spool {
    pub(super) fn open(dir: &Path, max_bytes: u64) -> Result<Spool> {
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
        Ok(Spool {
            dir: dir.to_path_buf(),
            max_bytes,
            files: Mutex::new((files.into(), bytes)),
            next: AtomicU64::new(next),
        })
    }

    /// Adds a profile; drops the oldest while it does not fit. Returns how many were
    /// dropped.
    pub(super) fn push(&self, meta: &PushMeta, gzipped: &[u8]) -> Result<u64> {
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
        let mut guard = self.files.lock().expect("spool lock");
        let (files, bytes) = &mut *guard;
        files.push_back((path, record.len() as u64));
        *bytes += record.len() as u64;
        let mut dropped = 0;
        while *bytes > self.max_bytes && files.len() > 1 {
            let (oldest, size) = files.pop_front().expect("non-empty");
            let _ = std::fs::remove_file(oldest);
            *bytes -= size;
            dropped += 1;
        }
        Ok(dropped)
    }

    pub(super) fn front(&self) -> Option<PathBuf> {
        self.files
            .lock()
            .expect("spool lock")
            .0
            .front()
            .map(|f| f.0.clone())
    }

    /// Deletes `path` if it is still the oldest (it may have been dropped meanwhile).
    pub(super) fn delivered(&self, path: &Path) {
        let mut guard = self.files.lock().expect("spool lock");
        let (files, bytes) = &mut *guard;
        if files.front().is_some_and(|f| f.0 == path) {
            let (_, size) = files.pop_front().expect("non-empty");
            *bytes -= size;
            let _ = std::fs::remove_file(path);
        }
    }

    pub(super) fn sizes(&self) -> (u64, u64) {
        let guard = self.files.lock().expect("spool lock");
        (guard.0.len() as u64, guard.1)
    }
}
