//! The unwinder's file cache: each file's unwind sections, shared by every process that
//! maps it, bounded in bytes.
//!
//! A long-running agent sees many files over its life; what it needs is the files the
//! current workload maps. So the cache holds at most [`MAX_CACHED_BYTES`] of sections
//! and evicts the least recently used file first (a process that still maps it keeps
//! its own reference). The index by device and inode, which spares reading a file
//! again to learn its build id, holds keys only and is bounded by count.

use std::{collections::HashMap, hash::Hash, sync::Arc};

/// Bytes of sections kept at most (`.eh_frame`, `.eh_frame_hdr`, `.debug_frame`):
/// Debian's libc has 182 KB of them (1.57 MB more when `.text` was copied too), a
/// large C++ program a few MB. Part of the agent's memory budget (docs/operations.md,
/// "Overhead and sizing").
pub const MAX_CACHED_BYTES: u64 = 32 << 20;

/// Device-and-inode index entries kept at most (keys only).
const MAX_INODES: usize = 4096;

/// A value that knows its size.
pub trait ByteSize {
    /// Bytes it holds.
    fn bytes(&self) -> u64;
}

/// Values by key, least recently used evicted beyond a byte budget, with a secondary
/// index by device and inode.
#[derive(Debug)]
pub struct LruCache<K, V> {
    entries: HashMap<K, (Arc<V>, u64)>,
    by_inode: HashMap<(u64, u64), K>,
    budget: u64,
    bytes: u64,
    tick: u64,
    /// Entries evicted so far.
    pub evicted: u64,
}

impl<K: Clone + Eq + Hash, V: ByteSize> LruCache<K, V> {
    /// An empty cache holding at most `budget` bytes.
    pub fn new(budget: u64) -> Self {
        Self {
            entries: HashMap::new(),
            by_inode: HashMap::new(),
            budget,
            bytes: 0,
            tick: 0,
            evicted: 0,
        }
    }

    /// The value of the file with this device and inode, if cached.
    pub fn by_inode(&mut self, inode: (u64, u64)) -> Option<Arc<V>> {
        let key = self.by_inode.get(&inode)?.clone();
        self.get(&key)
    }

    /// The value for `key`, if cached; marks it used.
    pub fn get(&mut self, key: &K) -> Option<Arc<V>> {
        self.tick += 1;
        let (value, used) = self.entries.get_mut(key)?;
        *used = self.tick;
        Some(value.clone())
    }

    /// Remembers that the file with this device and inode is `key`.
    pub fn index(&mut self, inode: (u64, u64), key: K) {
        if self.by_inode.len() >= MAX_INODES {
            // Keys only: dropping them costs a re-read of the build id, never a value.
            self.by_inode.retain(|_, k| self.entries.contains_key(k));
            if self.by_inode.len() >= MAX_INODES {
                self.by_inode.clear();
            }
        }
        self.by_inode.insert(inode, key);
    }

    /// Adds `value` under `key`, evicting the least recently used until it fits; false,
    /// with nothing added or evicted, if it is larger than the whole budget. Such a value
    /// used to be kept alone, over the budget: one hostile file then held any amount of
    /// memory, and emptied the cache of every other file.
    #[must_use]
    pub fn insert(&mut self, key: K, value: Arc<V>) -> bool {
        let size = value.bytes();
        if size > self.budget {
            return false;
        }
        while self.bytes + size > self.budget {
            let Some(oldest) = self
                .entries
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            if let Some((old, _)) = self.entries.remove(&oldest) {
                self.bytes -= old.bytes();
                self.evicted += 1;
            }
        }
        self.tick += 1;
        if let Some((old, _)) = self.entries.insert(key, (value, self.tick)) {
            self.bytes -= old.bytes();
        }
        self.bytes += size;
        true
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Blob(u64);

    impl ByteSize for Blob {
        fn bytes(&self) -> u64 {
            self.0
        }
    }

    #[test]
    fn the_least_recently_used_goes_first_and_the_budget_holds() {
        let mut cache = LruCache::new(100);
        assert!(cache.insert("a", Arc::new(Blob(40))));
        assert!(cache.insert("b", Arc::new(Blob(40))));
        cache.index((1, 1), "a");
        // "a" used since "b" was inserted: "b" is the one evicted.
        assert!(cache.by_inode((1, 1)).is_some());
        assert!(cache.insert("c", Arc::new(Blob(40))));
        assert!(cache.get(&"b").is_none());
        assert!(cache.get(&"a").is_some() && cache.get(&"c").is_some());
        assert_eq!(cache.bytes(), 80);
        assert_eq!(cache.evicted, 1);
        // Larger than the whole budget: refused, and nothing else evicted for it.
        assert!(!cache.insert("d", Arc::new(Blob(101))));
        assert!(cache.get(&"d").is_none());
        assert_eq!(cache.bytes(), 80);
        assert_eq!(cache.evicted, 1);
        assert!(cache.by_inode((1, 1)).is_some());
        // Exactly the budget fits, alone.
        assert!(cache.insert("e", Arc::new(Blob(100))));
        assert_eq!(cache.bytes(), 100);
        assert!(cache.get(&"a").is_none());
        // An evicted file's inode entry no longer finds anything.
        assert!(cache.by_inode((1, 1)).is_none());
    }
}
