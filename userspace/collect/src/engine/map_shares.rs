//! Each user's share of the kernel's per-process runtime maps.
//!
//! The runtimes' maps (one entry per Python, Java or Node.js process) are host-wide
//! and bounded. Without shares, one user forking a forged "JVM" could fill a map, and a
//! real JVM arriving later would never get its entry (never be walked). So every entry
//! is charged to its process's owner, and a user holding [`ENTRIES_PER_USER`] entries of
//! a map gets no more there: that process is profiled through its native frames, the
//! refusal logged and counted (`runtime_entries_refused_total`), and other users keep
//! the rest of the map.

use std::collections::HashMap;

use allocbpf_runtime::{RuntimeMapError, RuntimeMaps};

/// Entries of one runtime map one user may hold: a quarter of the smallest runtime
/// map's capacity (allocbpf-common's `MAX_*_PROCESSES`), so that three other users'
/// processes always fit beside a user who fills their share.
pub(crate) const ENTRIES_PER_USER: usize = 1024;

/// Who holds which entry: (map, pid) to the process's owner.
#[derive(Debug, Default)]
pub(crate) struct MapShares {
    owners: HashMap<(&'static str, u32), u32>,
    /// Entries refused for a user over its share, since start.
    pub refused: u64,
}

/// The owner of a live process, `None` if it is gone (`procfs::process_owner` in the
/// agent).
pub(crate) type OwnerOf = fn(u32) -> Option<u32>;

/// The kernel's runtime maps with each user held to its share.
pub(crate) struct SharedMaps<'a> {
    pub inner: &'a mut dyn RuntimeMaps,
    pub shares: &'a mut MapShares,
    pub owner_of: OwnerOf,
}

impl MapShares {
    /// Entries of `map` charged to `uid`, after dropping those of processes gone or
    /// owned by someone else now (a pid reused).
    /// The processes are looked at only when the count reaches the share.
    fn held(&mut self, map: &'static str, uid: u32, owner_of: OwnerOf) -> usize {
        let count = |owners: &HashMap<(&'static str, u32), u32>| {
            (owners.iter())
                .filter(|(&(m, _), &owner)| m == map && owner == uid)
                .count()
        };
        if count(&self.owners) < ENTRIES_PER_USER {
            return count(&self.owners);
        }
        self.owners
            .retain(|&(m, pid), &mut owner| m != map || owner != uid || owner_of(pid) == Some(uid));
        count(&self.owners)
    }
}

impl RuntimeMaps for SharedMaps<'_> {
    fn set_entry(
        &mut self,
        map: &'static str,
        pid: u32,
        value: &[u8],
    ) -> Result<(), RuntimeMapError> {
        if !self.shares.owners.contains_key(&(map, pid)) {
            let uid = (self.owner_of)(pid)
                .ok_or_else(|| RuntimeMapError(format!("pid {pid} is gone")))?;
            let held = self.shares.held(map, uid, self.owner_of);
            if held >= ENTRIES_PER_USER {
                self.shares.refused += 1;
                let why = format!(
                    "user {uid} holds {held} entries of {map}, its share of that kernel map: \
                     pid {pid} is profiled through its native frames"
                );
                if self.shares.refused.is_power_of_two() {
                    tracing::warn!("{why} (refusals so far: {})", self.shares.refused);
                }
                return Err(RuntimeMapError(why));
            }
            self.inner.set_entry(map, pid, value)?;
            self.shares.owners.insert((map, pid), uid);
            return Ok(());
        }
        self.inner.set_entry(map, pid, value)
    }

    fn forget_entry(&mut self, map: &'static str, pid: u32) {
        self.shares.owners.remove(&(map, pid));
        self.inner.forget_entry(map, pid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kernel maps that hold everything.
    #[derive(Default)]
    struct Unbounded(HashMap<(&'static str, u32), Vec<u8>>);

    impl RuntimeMaps for Unbounded {
        fn set_entry(
            &mut self,
            map: &'static str,
            pid: u32,
            value: &[u8],
        ) -> Result<(), RuntimeMapError> {
            self.0.insert((map, pid), value.to_vec());
            Ok(())
        }
        fn forget_entry(&mut self, map: &'static str, pid: u32) {
            self.0.remove(&(map, pid));
        }
    }

    /// Pids below 100,000 are user 1000's (a forger's forks), above it user 0's; pids
    /// above 900,000 are gone.
    fn owner(pid: u32) -> Option<u32> {
        match pid {
            0..100_000 => Some(1000),
            100_000..900_000 => Some(0),
            _ => None,
        }
    }

    #[test]
    fn a_user_who_fills_its_share_leaves_the_map_to_others() {
        let mut kernel = Unbounded::default();
        let mut shares = MapShares::default();
        let mut maps = SharedMaps {
            inner: &mut kernel,
            shares: &mut shares,
            owner_of: owner,
        };
        for pid in 1..=ENTRIES_PER_USER as u32 {
            maps.set_entry("JAVA", pid, &[1]).unwrap();
        }
        let refused = maps.set_entry("JAVA", 5000, &[1]);
        assert!(refused.is_err(), "over its share");
        // Its entries are updated, another map is its own share, another user is in.
        maps.set_entry("JAVA", 1, &[2]).unwrap();
        maps.set_entry("NODE", 5000, &[1]).unwrap();
        maps.set_entry("JAVA", 100_001, &[1]).unwrap();
        // One of its processes goes: one more fits.
        maps.forget_entry("JAVA", 1);
        maps.set_entry("JAVA", 5000, &[1]).unwrap();
        assert_eq!(shares.refused, 1);
        assert_eq!(kernel.0.len(), ENTRIES_PER_USER + 2);
    }

    #[test]
    fn entries_of_processes_gone_are_not_charged() {
        let mut kernel = Unbounded::default();
        let mut shares = MapShares::default();
        // Charged to user 1000 while alive; the pids now read as gone.
        for pid in 0..ENTRIES_PER_USER as u32 {
            shares.owners.insert(("JAVA", 900_000 + pid), 1000);
        }
        let mut maps = SharedMaps {
            inner: &mut kernel,
            shares: &mut shares,
            owner_of: owner,
        };
        maps.set_entry("JAVA", 7, &[1]).unwrap();
        assert!(maps.set_entry("JAVA", 950_000, &[1]).is_err(), "a pid gone");
    }
}
