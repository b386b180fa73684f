//! Re-reading the maps of the processes already followed, round-robin, for allocator
//! images they mapped since they were examined (`dlopen`): the `/proc` walk only looks
//! at new pids, and a process that maps a file raises no event. The kernel's mapping
//! query tells first whether any executable file is new; only then are the maps read.

use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

use allocbpf_images::{
    image::{candidate_mappings, ImageKey},
    procfs,
};

use super::Collector;

/// How often each admitted process's `/proc/PID/maps` is re-read (both scopes), spread
/// over the housekeeping ticks of the period.
///
/// Reading one process's maps costs about a microsecond per line (docs/benchmarks.md has
/// the figures); parsing and comparing the executable mappings with those known add
/// little. At this period a host of hundreds of processes costs well under 1% of one
/// CPU, read a few processes per housekeeping tick (no pause); a library
/// `dlopen`ed after its process was examined is probed within about 5 s (within 10 s of
/// the examination for a process admitted in the middle of a round), or within
/// `MAX_ROUNDS_SKIPPED + 1` periods for a process that has long mapped nothing new. 30 s (the `/proc`
/// walk's period) would lose up to half a minute of a late allocator's calls, a whole
/// agent interval; 1 s would cost five times as much for a rare event.
pub const MAPS_RESCAN_INTERVAL: Duration = Duration::from_secs(5);

/// A process whose executable files were the same at its last re-reads sits out one
/// round more after each (from the second), up to this many: on a host of hundreds of long-lived
/// processes the re-reads were a tenth of the agent's CPU, for a rare event. A process
/// that maps a new file is back to every round.
const MAX_ROUNDS_SKIPPED: u32 = 4;

/// One round over the admitted processes: each has its maps re-read once, at an even
/// pace over [`MAPS_RESCAN_INTERVAL`], but processes whose files have not changed for
/// a while, whose turn comes every few rounds.
#[derive(Default)]
pub(crate) struct MapsRescan {
    /// The pids of this round (admitted and alive when it began).
    round: Vec<u32>,
    /// How many of them were re-read.
    done: usize,
    /// When this round began.
    started: Option<Instant>,
    /// Per process: re-reads in a row that found nothing new (at most
    /// [`MAX_ROUNDS_SKIPPED`] + 1), and rounds it sits out before its next turn.
    quiet: HashMap<u32, (u32, u32)>,
}

impl MapsRescan {
    /// The pids whose turn has come by `now`. A new round (of `pids()`) begins once the
    /// last one is done and a period has passed since it began.
    pub fn due(&mut self, now: Instant, pids: impl FnOnce() -> Vec<u32>) -> Vec<u32> {
        let over =
            |started: Instant| now.saturating_duration_since(started) >= MAPS_RESCAN_INTERVAL;
        if self.done >= self.round.len() && self.started.is_none_or(over) {
            let mut round = pids();
            let before = std::mem::take(&mut self.quiet);
            // Sitting out: left out of this round, one round fewer to wait.
            round.retain(|pid| match before.get(pid) {
                Some(&(quiet, wait)) if wait > 0 => {
                    self.quiet.insert(*pid, (quiet, wait - 1));
                    false
                }
                Some(&quiet) => {
                    self.quiet.insert(*pid, quiet);
                    true
                }
                None => true,
            });
            self.round = round;
            self.done = 0;
            self.started = Some(now);
        }
        let elapsed = now.saturating_duration_since(self.started.unwrap_or(now));
        let share = (elapsed.as_secs_f64() / MAPS_RESCAN_INTERVAL.as_secs_f64()).min(1.0);
        // Rounded up: the first turn comes at the first tick, the last by the period's end.
        let due = ((self.round.len() as f64 * share).ceil() as usize).min(self.round.len());
        let from = self.done;
        self.done = due.max(from);
        self.round[from..self.done].to_vec()
    }

    /// `pid` exec'd or exited: a new program (or a later process with its pid) is
    /// re-read every round again.
    pub fn forget(&mut self, pid: u32) {
        self.quiet.remove(&pid);
    }

    /// `pid`'s re-read found a new file (`changed`) or none: from its second quiet
    /// re-read in a row it waits one round more after each, up to
    /// [`MAX_ROUNDS_SKIPPED`], and none after a change.
    pub fn reread(&mut self, pid: u32, changed: bool) {
        let quiet = match changed {
            true => 0,
            false => (self.quiet.get(&pid).map_or(0, |q| q.0) + 1).min(MAX_ROUNDS_SKIPPED + 1),
        };
        self.quiet.insert(pid, (quiet, quiet.saturating_sub(1)));
    }
}

impl Collector {
    /// Re-reads the maps of the admitted processes whose turn has come
    /// ([`MAPS_RESCAN_INTERVAL`]).
    pub(super) fn rescan_maps_due(&mut self, now: Instant) {
        let tracked = &self.processes.tracked;
        let due = self.chores.maps_rescan.due(now, || {
            let mut pids: Vec<u32> = tracked
                .iter()
                .filter(|(_, t)| t.admitted && !t.exited)
                .map(|(pid, _)| *pid)
                .collect();
            // In pid order: a process keeps about its place from round to round, so
            // its re-reads stay about a period apart.
            pids.sort_unstable();
            pids
        });
        for pid in due {
            let changed = self.rescan_maps(pid);
            self.chores.maps_rescan.reread(pid, changed);
        }
    }

    /// Re-reads `pid`'s maps; if it maps an executable file it did not map when last
    /// examined, attaches its images as a first look does (the new files are examined,
    /// allocator images among them probed, and its images and mapped files updated:
    /// the budget places its samples by them). True if it maps a new file.
    fn rescan_maps(&mut self, pid: u32) -> bool {
        if self.kernel.is_none() {
            return false;
        }
        let Some(tracked) = self.processes.tracked.get(&pid) else {
            return false;
        };
        if !tracked.admitted || tracked.exited {
            return false;
        }
        let known: HashSet<&ImageKey> = tracked.mapped.iter().collect();
        // The kernel lists its executable files without the text of its maps: a
        // few ioctls where the text costs a line per mapping, on every process every
        // period. Nothing new there, nothing new to look at.
        if let Ok(files) = procfs::procmap::executable_files(pid) {
            let unknown =
                |&(device, inode): &(u64, u64)| !known.contains(&ImageKey { device, inode });
            if !files.iter().any(unknown) {
                return false;
            }
        }
        // Empty if it exited meanwhile: its exit event follows.
        let maps = procfs::read_maps_counting_cuts(pid, &mut self.processes.maps_cut);
        let new = candidate_mappings(&maps)
            .into_iter()
            .any(|mapping| !known.contains(&ImageKey::of(mapping)));
        if new {
            tracing::debug!("pid {pid} maps files it did not when examined: attaching");
            self.attach_images_of(pid, &maps);
        }
        new
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TICK: Duration = Duration::from_millis(100);

    #[test]
    fn each_process_once_per_period_spread_over_the_ticks() {
        let start = Instant::now();
        let mut rescan = MapsRescan::default();
        let pids: Vec<u32> = (1..=120).collect();
        let ticks = (MAPS_RESCAN_INTERVAL.as_millis() / TICK.as_millis()) as u32;
        let mut seen = Vec::new();
        let mut most = 0;
        // The round's first call, then one per tick up to the period's end.
        for tick in 0..=ticks {
            let due = rescan.due(start + TICK * tick, || pids.clone());
            most = most.max(due.len());
            seen.extend(due);
        }
        assert_eq!(seen, pids, "every pid once, in order");
        assert!(most <= 120usize.div_ceil(ticks as usize), "{most} at once");
        // The next round begins after the period, with the pids then.
        let next = start + MAPS_RESCAN_INTERVAL + TICK;
        assert!(rescan.due(next, || vec![7]).is_empty());
        assert_eq!(rescan.due(next + MAPS_RESCAN_INTERVAL, Vec::new), [7]);
    }

    #[test]
    fn a_process_whose_files_stay_the_same_waits_longer_up_to_a_bound() {
        let start = Instant::now();
        let mut rescan = MapsRescan::default();
        let round_at = |n: u32| start + (MAPS_RESCAN_INTERVAL + TICK) * n;
        // Rounds in which pid 1 (quiet every time) and pid 2 (changed every time) came.
        let (mut ones, mut twos) = (Vec::new(), Vec::new());
        for n in 0..30 {
            rescan.due(round_at(n), || vec![1, 2]);
            for pid in rescan.due(round_at(n) + MAPS_RESCAN_INTERVAL, Vec::new) {
                rescan.reread(pid, pid == 2);
                match pid {
                    1 => ones.push(n),
                    _ => twos.push(n),
                }
            }
        }
        assert_eq!(
            twos,
            (0..30).collect::<Vec<_>>(),
            "a changing process every round"
        );
        // Every round twice, then waits of 1, 2, 3, 4 rounds, then every 5th round.
        assert_eq!(ones, [0, 1, 3, 6, 10, 15, 20, 25]);
    }

    #[test]
    fn a_process_that_execs_is_re_read_every_round_again() {
        let start = Instant::now();
        let mut rescan = MapsRescan::default();
        let round_at = |n: u32| start + (MAPS_RESCAN_INTERVAL + TICK) * n;
        for n in 0..2 {
            rescan.due(round_at(n), || vec![1]);
            for pid in rescan.due(round_at(n) + MAPS_RESCAN_INTERVAL, Vec::new) {
                rescan.reread(pid, false);
            }
        }
        // Two quiet re-reads: it would sit out the next round, but it exec'd.
        rescan.forget(1);
        rescan.due(round_at(2), || vec![1]);
        assert_eq!(
            rescan.due(round_at(2) + MAPS_RESCAN_INTERVAL, Vec::new),
            [1]
        );
    }

    #[test]
    fn a_round_waits_for_its_period() {
        let start = Instant::now();
        let mut rescan = MapsRescan::default();
        assert!(rescan.due(start, || vec![1]).is_empty());
        assert_eq!(rescan.due(start + TICK, || vec![2]), [1]);
        // Done early: nothing more (and no new round) until the period has passed.
        assert!(rescan.due(start + 2 * TICK, || vec![3]).is_empty());
        let next = start + MAPS_RESCAN_INTERVAL;
        assert!(rescan.due(next, || vec![4]).is_empty());
        assert_eq!(rescan.due(next + TICK, || vec![5]), [4]);
    }
}
