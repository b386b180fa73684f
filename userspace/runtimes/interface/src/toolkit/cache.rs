//! A cache bounded in bytes: what a runtime keeps of another process (names, line
//! tables, code blobs) is counted by what it holds, not by how many entries, so that a
//! process forging long names or large tables cannot grow the agent past the bound.
//! When full it evicts the entries used least recently, one by one, and keeps the rest
//! (a cache that clears itself when full throws away the hot entries with the cold).

use std::{
    borrow::Borrow,
    collections::{BTreeMap, HashMap},
    hash::Hash,
};

/// What a [`ByteCache`] holds and has done, for figures and logs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheFigures {
    /// Entries held.
    pub entries: usize,
    /// Bytes held, as their inserters counted them.
    pub bytes: usize,
    /// The bound on `bytes`.
    pub max_bytes: usize,
    /// Entries evicted to make room so far.
    pub evictions: u64,
    /// Entries refused for being larger than the whole bound.
    pub refused: u64,
}

/// One entry: its value, its size and when it was last used.
#[derive(Debug)]
struct Entry<V> {
    value: V,
    bytes: usize,
    used: u64,
}

/// A map of at most `max_bytes` (as each entry's inserter counts it), evicting the
/// least recently used entries to make room.
#[derive(Debug)]
pub struct ByteCache<K, V> {
    entries: HashMap<K, Entry<V>>,
    /// Keys by when they were last used: the first is the next to go.
    by_use: BTreeMap<u64, K>,
    clock: u64,
    figures: CacheFigures,
}

/// What an entry costs beyond the bytes its inserter counts: its key, its place in the
/// two maps and their bookkeeping, so that many tiny entries are bounded too.
pub const ENTRY_OVERHEAD: usize = 64;

impl<K: Hash + Eq + Clone, V> ByteCache<K, V> {
    /// An empty cache of at most `max_bytes`.
    pub fn new(max_bytes: usize) -> Self {
        Self {
            entries: HashMap::new(),
            by_use: BTreeMap::new(),
            clock: 0,
            figures: CacheFigures {
                max_bytes,
                ..CacheFigures::default()
            },
        }
    }

    /// The value at `key`, marked as used now.
    pub fn get<Q>(&mut self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.clock += 1;
        let entry = self.entries.get_mut(key)?;
        if let Some(owner) = self.by_use.remove(&entry.used) {
            self.by_use.insert(self.clock, owner);
        }
        entry.used = self.clock;
        Some(&entry.value)
    }

    /// The value at `key`, without marking it used.
    pub fn peek<Q>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.entries.get(key).map(|entry| &entry.value)
    }

    /// Every value, in no order, none marked used.
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.entries.values().map(|entry| &entry.value)
    }

    /// True if `key` has an entry.
    pub fn contains_key<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.entries.contains_key(key)
    }

    /// Changes the bound to `max_bytes`, evicting the least recently used entries
    /// until what is held fits (a bound that follows the workload: what one poll
    /// lists, say).
    pub fn set_max_bytes(&mut self, max_bytes: usize) {
        self.figures.max_bytes = max_bytes;
        self.evict_until(0);
    }

    /// Evicts the least recently used entries until `room` more bytes fit.
    fn evict_until(&mut self, room: usize) {
        while self.figures.bytes + room > self.figures.max_bytes {
            let Some((_, oldest)) = self.by_use.pop_first() else {
                break;
            };
            if let Some(gone) = self.entries.remove(&oldest) {
                self.figures.bytes -= gone.bytes;
                self.figures.evictions += 1;
            }
        }
        self.figures.entries = self.entries.len();
    }

    /// Keeps `value` at `key`, counted as `bytes` (plus [`ENTRY_OVERHEAD`]), evicting
    /// the least recently used entries as needed. Returns false (and keeps nothing) when
    /// the entry alone is larger than the bound.
    pub fn insert(&mut self, key: K, value: V, bytes: usize) -> bool {
        let bytes = bytes.saturating_add(ENTRY_OVERHEAD);
        self.remove(&key);
        if bytes > self.figures.max_bytes {
            self.figures.refused += 1;
            return false;
        }
        self.evict_until(bytes);
        self.clock += 1;
        self.by_use.insert(self.clock, key.clone());
        self.entries.insert(
            key,
            Entry {
                value,
                bytes,
                used: self.clock,
            },
        );
        self.figures.bytes += bytes;
        self.figures.entries = self.entries.len();
        true
    }

    /// Removes `key`'s entry, returning its value.
    pub fn remove<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let entry = self.entries.remove(key)?;
        self.by_use.remove(&entry.used);
        self.figures.bytes -= entry.bytes;
        self.figures.entries = self.entries.len();
        Some(entry.value)
    }

    /// Drops every entry (what they describe changed: a process's code was replaced).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.by_use.clear();
        self.figures.bytes = 0;
        self.figures.entries = 0;
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// What it holds and has evicted.
    pub fn figures(&self) -> CacheFigures {
        self.figures
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_used_entries_go_first_and_the_rest_stay() {
        let mut cache = ByteCache::new(3 * (100 + ENTRY_OVERHEAD));
        for key in 0..3 {
            assert!(cache.insert(key, key * 10, 100));
        }
        assert_eq!(
            cache.get(&0),
            Some(&0),
            "0 is used again: 1 is now the oldest"
        );
        assert!(cache.insert(3, 30, 100));
        assert_eq!(cache.len(), 3);
        assert!(cache.contains_key(&0) && !cache.contains_key(&1));
        assert!(cache.contains_key(&2) && cache.contains_key(&3));
        let figures = cache.figures();
        assert_eq!(
            (figures.evictions, figures.bytes),
            (1, 3 * (100 + ENTRY_OVERHEAD))
        );
    }

    #[test]
    fn bytes_bound_many_small_entries_and_a_few_large_ones_alike() {
        let max = 10_000;
        let mut cache = ByteCache::new(max);
        for key in 0..1_000u32 {
            cache.insert(key, (), (key as usize % 7) * 300);
            assert!(cache.figures().bytes <= max);
        }
        assert!(
            !cache.insert(u32::MAX, (), max),
            "larger than the whole bound"
        );
        assert_eq!(cache.figures().refused, 1);
        assert!(cache.figures().bytes <= max && !cache.is_empty());
    }

    #[test]
    fn a_lower_bound_evicts_the_oldest_until_what_is_held_fits() {
        let entry = 100 + ENTRY_OVERHEAD;
        let mut cache = ByteCache::new(4 * entry);
        for key in 0..4 {
            cache.insert(key, (), 100);
        }
        cache.get(&0);
        cache.set_max_bytes(2 * entry);
        assert_eq!(cache.len(), 2);
        assert!(cache.contains_key(&0) && cache.contains_key(&3));
        assert_eq!(cache.figures().evictions, 2);
        cache.set_max_bytes(8 * entry);
        assert!(cache.insert(9, (), 100) && cache.len() == 3);
    }

    #[test]
    fn replacing_removing_and_clearing_keep_the_count_right() {
        let mut cache = ByteCache::new(1 << 20);
        cache.insert("a", 1, 10);
        cache.insert("a", 2, 20);
        assert_eq!(
            (cache.peek("a"), cache.figures().bytes),
            (Some(&2), 20 + ENTRY_OVERHEAD)
        );
        assert_eq!(cache.remove("a"), Some(2));
        assert_eq!(cache.figures().bytes, 0);
        cache.insert("b", 3, 5);
        cache.clear();
        assert_eq!((cache.len(), cache.figures().bytes), (0, 0));
    }
}
