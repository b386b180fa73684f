//! The embedded default profile store: a local directory of gzipped pprof files.
//!
//! Layout (docs/operations.md):
//!
//! ```text
//! STORE/profiles/YYYY-MM-DD/START_MS-END_MS-PID-COMM.pb.gz
//! ```
//!
//! one file per process per interval; START/END are the interval's Unix times in
//! milliseconds (UTC), COMM the command name with `/` and non-printable characters
//! replaced by `_`. Every profile also carries its labels as `key=value` comments.
//! Retention deletes profiles older than `max_age`, then the oldest while the store is
//! larger than `max_bytes` or holds more than `max_files`. Files are written to a
//! temporary name, synced and renamed, so a reader never sees a partial profile, even
//! after a crash; a write that fails removes its temporary file.
//!
//! A full file system (a store on a disk smaller than `max_bytes`) does not stop the
//! store: the oldest profiles are deleted until the new one fits, as retention would
//! (but no more than about twice its size: the disk may be full of something else),
//! and each deletion is counted.
//!
//! Memory: the index keeps one [`IndexEntry`] per stored file (~100 bytes with its
//! name), so `max_files` (default 100,000: ~10 MB) bounds it whatever the sizes.
//!
//! Profiles reveal other users' binaries, paths and stacks: directories are created
//! 0700 and files 0600 ([`create_private_dir`], [`write_private`]), whatever the umask.
//!
//! Durability: a file is synced before its rename, and every directory a cut touched
//! (a renamed file, a new day directory, a deletion) is synced once after the cut
//! ([`ProfileStore::sync_dirs`]): until then a crash could lose the rename.
//!
//! Retention ages profiles by a [`RetentionClock`]: the wall clock, except a forward
//! jump beyond the time elapsed (CLOCK_BOOTTIME) is ignored, so a clock set years
//! ahead does not empty the store.

use std::{
    collections::{BTreeSet, VecDeque},
    fs::{DirBuilder, File, OpenOptions, Permissions},
    io::{self, Write},
    os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result};

use super::config::Retention;

/// Creates `dir` and its missing parents with mode 0700, and makes `dir` itself 0700 if
/// it existed with wider permissions.
pub(super) fn create_private_dir(dir: &Path) -> io::Result<()> {
    DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    std::fs::set_permissions(dir, Permissions::from_mode(0o700))
}

/// Writes `bytes` to `temp` (mode 0600, synced) and renames it to `path`; on failure
/// `temp` is removed (a partial file would hold space on a full disk for good).
pub(super) fn write_private(temp: &Path, path: &Path, bytes: &[u8]) -> io::Result<()> {
    let written = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(temp)
        .and_then(|mut file| {
            file.write_all(bytes)?;
            file.sync_all()
        })
        .and_then(|()| std::fs::rename(temp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(temp);
    }
    written
}

/// fsyncs the directory `dir`: the renames, creations and deletions in it become durable.
pub(super) fn sync_directory(dir: &Path) -> io::Result<()> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(dir)
        .and_then(|d: File| d.sync_all())
}

/// True for the errors of a file system (or quota) that is full.
fn is_full(error: &io::Error) -> bool {
    matches!(error.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}

/// One stored profile, as its file name describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredProfile {
    /// The file.
    pub path: PathBuf,
    /// Interval start, Unix ms.
    pub start_ms: u64,
    /// Interval end, Unix ms.
    pub end_ms: u64,
    /// Process id.
    pub pid: u32,
    /// Command name (sanitized).
    pub comm: String,
    /// File size.
    pub bytes: u64,
}

/// What the index keeps of a stored file: enough to delete it, in order.
#[derive(Debug)]
struct IndexEntry {
    end_ms: u64,
    bytes: u64,
    /// `YYYY-MM-DD/NAME.pb.gz`, under `STORE/profiles`.
    relative: Box<str>,
}

/// The store, with an index of its files (oldest first) for retention.
#[derive(Debug)]
pub struct ProfileStore {
    root: PathBuf,
    retention: Retention,
    index: VecDeque<IndexEntry>,
    total_bytes: u64,
    /// Profiles deleted so far, by retention or to make room on a full file system.
    pub deleted: u64,
    /// Directories changed since the last [`ProfileStore::sync_dirs`].
    dirty: BTreeSet<PathBuf>,
}

/// How far the wall clock may run ahead of the time elapsed since it was last trusted
/// before retention stops following it.
pub const CLOCK_JUMP_TOLERANCE: Duration = Duration::from_secs(600);

/// CLOCK_BOOTTIME: time since boot, suspend included, never set.
fn boot_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime with a valid pointer to a local timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// The "now" retention ages profiles by. It follows the wall clock while the wall clock
/// agrees (within [`CLOCK_JUMP_TOLERANCE`]) with the time elapsed since it was last
/// read, and goes back and small steps included; a forward jump beyond the tolerance
/// (a clock set to a wrong date: every profile would look older than `max_age`) is
/// ignored, and the time elapsed since the last trusted reading is used instead,
/// until the wall clock agrees again or the agent restarts. Profiles written meanwhile
/// carry the jumped clock's times and are only bounded by size and count until then.
#[derive(Debug)]
pub struct RetentionClock {
    /// The last trusted wall-clock reading and CLOCK_BOOTTIME then.
    wall: SystemTime,
    boot: Duration,
    /// A forward jump is being ignored (logged once).
    jumped: bool,
}

impl RetentionClock {
    /// Anchored at the current wall clock.
    pub fn new() -> RetentionClock {
        Self::anchored(SystemTime::now(), boot_time())
    }

    fn anchored(wall: SystemTime, boot: Duration) -> RetentionClock {
        RetentionClock {
            wall,
            boot,
            jumped: false,
        }
    }

    /// Now, for retention.
    pub fn now(&mut self) -> SystemTime {
        self.at(SystemTime::now(), boot_time())
    }

    /// Now for retention when the wall clock reads `wall` and CLOCK_BOOTTIME `boot`.
    fn at(&mut self, wall: SystemTime, boot: Duration) -> SystemTime {
        let expected = self.wall + boot.saturating_sub(self.boot);
        if wall > expected + CLOCK_JUMP_TOLERANCE {
            if !self.jumped {
                self.jumped = true;
                tracing::warn!(
                    "retention: the wall clock jumped {}s ahead of the time elapsed; profiles are aged by the time elapsed until it agrees again or the agent restarts (size and count bounds still apply)",
                    wall.duration_since(expected).unwrap_or_default().as_secs()
                );
            }
            return expected;
        }
        if self.jumped {
            self.jumped = false;
            tracing::info!("retention: the wall clock agrees with the time elapsed again");
        }
        self.wall = wall;
        self.boot = boot;
        wall
    }
}

/// Unix milliseconds of a wall-clock time.
pub fn unix_ms(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// `YYYY-MM-DD` (UTC) of a Unix time in ms (Howard Hinnant's civil-from-days).
fn day_of(ms: u64) -> String {
    let days = (ms / 86_400_000) as i64 + 719_468;
    let era = days.div_euclid(146_097);
    let doe = days - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

fn sanitize(comm: &str) -> String {
    let s: String = comm
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._+".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() {
        "_".into()
    } else {
        s
    }
}

/// Parses a stored file's name; `None` for anything else.
fn parse_name(path: &Path, bytes: u64) -> Option<StoredProfile> {
    let name = path.file_name()?.to_str()?.strip_suffix(".pb.gz")?;
    let mut parts = name.splitn(4, '-');
    Some(StoredProfile {
        start_ms: parts.next()?.parse().ok()?,
        end_ms: parts.next()?.parse().ok()?,
        pid: parts.next()?.parse().ok()?,
        comm: parts.next()?.to_string(),
        path: path.to_path_buf(),
        bytes,
    })
}

/// Removes the `.tmp` files in `dir`: what a crash between [`write_private`]'s write and
/// its rename left. They are never read, hold space, and keep the directory from being
/// removed.
pub(super) fn remove_temporary_files(dir: &Path) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.path().extension().is_some_and(|x| x == "tmp") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Why stored profiles could not be read.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store's directory cannot be listed.
    #[error("reading {}", path.display())]
    Listing {
        /// The directory.
        path: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// Every stored profile under `root`, oldest (by end time) first.
pub fn list(root: &Path) -> Result<Vec<StoredProfile>, StoreError> {
    let profiles = root.join("profiles");
    let mut out = Vec::new();
    let days = match std::fs::read_dir(&profiles) {
        Ok(days) => days,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(source) => {
            return Err(StoreError::Listing {
                path: profiles,
                source,
            })
        }
    };
    for day in days.flatten() {
        let Ok(files) = std::fs::read_dir(day.path()) else {
            continue;
        };
        for file in files.flatten() {
            let bytes = file.metadata().map(|m| m.len()).unwrap_or(0);
            if let Some(profile) = parse_name(&file.path(), bytes) {
                out.push(profile);
            }
        }
    }
    out.sort_by_key(|p| (p.end_ms, p.pid));
    Ok(out)
}

impl ProfileStore {
    /// Opens (creating it if needed) the store at `root`; fails early and clearly when
    /// the directory cannot be written.
    pub fn open(root: &Path, retention: Retention) -> Result<ProfileStore> {
        let profiles = root.join("profiles");
        create_private_dir(root)
            .and_then(|()| create_private_dir(&profiles))
            .with_context(|| format!("creating the store directory {}", profiles.display()))?;
        let probe = profiles.join(".write-test");
        std::fs::write(&probe, b"").with_context(|| {
            format!("the store directory {} is not writable", profiles.display())
        })?;
        let _ = std::fs::remove_file(probe);
        for day in std::fs::read_dir(&profiles).into_iter().flatten().flatten() {
            remove_temporary_files(&day.path());
        }
        let index: VecDeque<IndexEntry> = list(root)?
            .into_iter()
            .filter_map(|p| {
                let relative = p.path.strip_prefix(&profiles).ok()?.to_str()?.into();
                Some(IndexEntry {
                    end_ms: p.end_ms,
                    bytes: p.bytes,
                    relative,
                })
            })
            .collect();
        let total_bytes = index.iter().map(|p| p.bytes).sum();
        Ok(ProfileStore {
            root: root.to_path_buf(),
            retention,
            index,
            total_bytes,
            deleted: 0,
            dirty: BTreeSet::new(),
        })
    }

    /// fsyncs every directory changed since the last call (once per cut: a renamed
    /// file survives a crash only once its directory is synced). Directories deleted
    /// meanwhile are skipped.
    pub fn sync_dirs(&mut self) -> io::Result<()> {
        let mut result = Ok(());
        for dir in std::mem::take(&mut self.dirty) {
            match sync_directory(&dir) {
                Err(error) if error.kind() != io::ErrorKind::NotFound => result = Err(error),
                _ => {}
            }
        }
        result
    }

    /// Changes the retention (SIGHUP).
    pub fn set_retention(&mut self, retention: Retention) {
        self.retention = retention;
    }

    /// Bytes stored.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Profiles stored.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.index.len()
    }

    /// Stores one profile (gzipped pprof bytes). On a full file system the oldest
    /// profiles are deleted (counted in [`ProfileStore::deleted`]) until it fits.
    pub fn write(
        &mut self,
        start: SystemTime,
        end: SystemTime,
        pid: u32,
        comm: &str,
        gzipped: &[u8],
    ) -> Result<PathBuf> {
        let (start_ms, end_ms) = (unix_ms(start), unix_ms(end));
        let day = day_of(end_ms);
        let dir = self.root.join("profiles").join(&day);
        let name = format!("{start_ms}-{end_ms}-{pid}-{}.pb.gz", sanitize(comm));
        let path = dir.join(&name);
        let temp = dir.join(format!(".{start_ms}-{pid}.tmp"));
        // On a full file system, the store makes room from its own oldest files, but
        // only about as much as the new profile takes (twice its size, plus a few
        // blocks): the disk may be full of something else, and emptying the store
        // would not help then.
        let len = gzipped.len() as u64;
        let room_needed = 2 * len + (64 << 10);
        let (mut evicted, mut freed) = (0, 0);
        if !dir.is_dir() {
            // A new day directory: an entry of `profiles/`.
            self.dirty.insert(self.root.join("profiles"));
        }
        loop {
            let written =
                create_private_dir(&dir).and_then(|()| write_private(&temp, &path, gzipped));
            let error = match written {
                Ok(()) => break,
                Err(error) => error,
            };
            let may_evict = is_full(&error) && freed < room_needed && evicted < 64;
            match may_evict.then(|| self.delete_oldest()).flatten() {
                Some(bytes) => {
                    evicted += 1;
                    freed += bytes;
                }
                None => {
                    if evicted > 0 {
                        tracing::warn!(
                            "store: the file system is full; {evicted} oldest profile(s) ({freed} bytes) deleted and {name} still does not fit"
                        );
                    }
                    return Err(error).with_context(|| format!("writing {}", path.display()));
                }
            }
        }
        if evicted > 0 {
            tracing::warn!(
                "store: the file system is full; {evicted} oldest profile(s) ({freed} bytes) deleted to write {name} (retention.max_bytes is larger than the disk has room for)"
            );
        }
        self.dirty.insert(dir);
        self.total_bytes += gzipped.len() as u64;
        self.index.push_back(IndexEntry {
            end_ms,
            bytes: gzipped.len() as u64,
            relative: format!("{day}/{name}").into(),
        });
        Ok(path)
    }

    /// Deletes the oldest stored profile (and its day directory once empty); the bytes
    /// freed (0 if the file could not be deleted: it leaves the index all the same, or
    /// retention would stop at it for good), `None` if nothing is stored.
    fn delete_oldest(&mut self) -> Option<u64> {
        let oldest = self.index.pop_front()?;
        let path = self.root.join("profiles").join(&*oldest.relative);
        self.total_bytes -= oldest.bytes;
        self.deleted += 1;
        let freed = match std::fs::remove_file(&path) {
            Ok(()) => oldest.bytes,
            Err(error) if error.kind() == io::ErrorKind::NotFound => 0,
            Err(error) => {
                tracing::warn!("retention: cannot delete {}: {error}", path.display());
                0
            }
        };
        if let Some(day) = path.parent() {
            // Removes the day directory once it is empty (fails harmlessly before).
            if std::fs::remove_dir(day).is_ok() {
                self.dirty.insert(self.root.join("profiles"));
            } else {
                self.dirty.insert(day.to_path_buf());
            }
        }
        Some(freed)
    }

    /// Applies the retention bounds at `now`; returns how many profiles were deleted.
    pub fn enforce_retention(&mut self, now: SystemTime) -> usize {
        let oldest_allowed = unix_ms(now).saturating_sub(self.retention.max_age.as_millis() as u64);
        let mut deleted = 0;
        // The index is sorted by end time at open and appended in time order.
        while let Some(front) = self.index.front() {
            let too_old = front.end_ms < oldest_allowed;
            let too_big = self.total_bytes > self.retention.max_bytes;
            let too_many = self.index.len() as u64 > self.retention.max_files;
            if !too_old && !too_big && !too_many {
                break;
            }
            if self.delete_oldest().is_none() {
                break;
            }
            deleted += 1;
        }
        deleted
    }
}

/// How long ago a stored profile ended, relative to `now`.
pub fn age(profile: &StoredProfile, now: SystemTime) -> Duration {
    Duration::from_millis(unix_ms(now).saturating_sub(profile.end_ms))
}

#[cfg(test)]
mod tests;
