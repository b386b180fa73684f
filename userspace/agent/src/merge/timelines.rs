//! Timelines of stored profiles: per process (pid and command name), one point per
//! stored profile, merged pairwise past [`MAX_POINTS`] as a recorded timeline's are, and
//! the peak: the profile that ended holding most, with the stacks it held then.

use std::collections::BTreeMap;

use allocbpf_profile::aggregate::StackStats;
use allocbpf_profile::report::{Location, ProcessTimeline, StackReport};
use allocbpf_profile::timeline::{PeakCopy, Timeline, TimelinePoint, MAX_POINTS};

/// One process's points (times in Unix nanoseconds) and peak.
#[derive(Default)]
struct Stored {
    points: Vec<TimelinePoint>,
    /// Some profile was time-sampled (an overhead budget).
    time_sampled: bool,
    peak: Option<PeakCopy<Vec<Location>>>,
}

impl Stored {
    /// Halves the points by merging neighbours.
    fn merge_pairs(&mut self) {
        self.points = self
            .points
            .chunks(2)
            .map(|pair| match pair {
                [a, b] => a.then(b),
                [a] => *a,
                _ => unreachable!("chunks of two"),
            })
            .collect();
    }
}

/// Bytes held, as a timeline's `StackStats` carries them (without interval inputs:
/// the store keeps none for bytes in use).
fn held(bytes: f64, objects: f64) -> StackStats {
    StackStats {
        estimated_bytes: bytes,
        estimated_objects: objects,
        ..StackStats::default()
    }
}

/// The timelines of the stored profiles merged so far.
#[derive(Default)]
pub(super) struct StoredTimelines {
    processes: BTreeMap<(u32, String), Stored>,
}

impl StoredTimelines {
    /// Adds the profile of process `pid` named `comm` that covered `start_ns` to
    /// `end_ns` (Unix nanoseconds; a time before 1970 counts as 1970) with `stacks`.
    pub fn add(
        &mut self,
        pid: u32,
        comm: &str,
        (start_ns, end_ns): (i64, i64),
        stacks: &[StackReport],
        time_sampled: bool,
    ) {
        let (start_ns, end_ns) = (start_ns.max(0) as u64, end_ns.max(0) as u64);
        let mut alloc = StackStats::default();
        let mut inuse_bytes = 0.0;
        for stack in stacks {
            alloc.merge(&StackStats {
                inuse_bytes: 0.0,
                inuse_objects: 0.0,
                ..stack.stats
            });
            inuse_bytes += stack.stats.inuse_bytes;
        }
        let stored = self.processes.entry((pid, comm.to_string())).or_default();
        let highest = stored
            .peak
            .as_ref()
            .map_or(0.0, |p| p.inuse.estimated_bytes);
        if inuse_bytes > highest {
            let stacks = stacks
                .iter()
                .filter(|s| s.stats.inuse_bytes > 0.0)
                .map(|s| {
                    (
                        s.locations.clone(),
                        held(s.stats.inuse_bytes, s.stats.inuse_objects),
                    )
                })
                .collect();
            let inuse = held(inuse_bytes, 0.0);
            stored.peak = Some(PeakCopy::of_largest(end_ns, inuse, stacks));
        }
        stored.time_sampled |= time_sampled;
        stored.points.push(TimelinePoint {
            start_ns,
            end_ns,
            alloc,
            inuse: held(inuse_bytes, 0.0),
            inuse_high: inuse_bytes,
        });
        if stored.points.len() >= 2 * MAX_POINTS {
            stored.merge_pairs();
        }
    }

    /// The timelines, times relative to `origin_ns`; `live`: in-use bytes were stored.
    /// A process's points have no interval if any was time-sampled; the bytes in use
    /// have none (the store keeps no in-use interval inputs).
    pub fn finish(self, origin_ns: i64, live: bool) -> Vec<ProcessTimeline> {
        self.processes
            .into_iter()
            .map(|((pid, name), mut stored)| {
                if stored.points.len() > MAX_POINTS {
                    stored.merge_pairs();
                }
                let peak = stored.peak.filter(|_| live);
                let mut timeline = Timeline {
                    points: stored.points,
                    live,
                    time_sampled: false,
                    high: peak.as_ref().map(|p| (p.at_ns, p.inuse.estimated_bytes)),
                    peak,
                }
                .map(origin_ns.max(0) as u64, |stack| stack);
                if stored.time_sampled {
                    timeline.observed_part_time();
                }
                ProcessTimeline {
                    pid,
                    name: Some(name),
                    timeline,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use allocbpf_profile::frame::{Frame, FunctionFrame};

    fn stack(name: &str, allocated: f64, inuse: f64) -> StackReport {
        StackReport {
            pid: 7,
            locations: vec![Location {
                frame: Frame::Unknown(0),
                functions: vec![FunctionFrame {
                    name: name.into(),
                    file: None,
                    line: None,
                    shown: None,
                }]
                .into(),
            }],
            stats: StackStats {
                samples: 1,
                estimated_bytes: allocated,
                observed_bytes: allocated,
                inuse_bytes: inuse,
                ..StackStats::default()
            },
        }
    }

    /// The peak is the profile that ended holding most, with the stacks it held then
    /// (not the latest profile's).
    #[test]
    fn the_peak_keeps_the_stacks_of_its_own_profile() {
        let mut timelines = StoredTimelines::default();
        let s = 1_000_000_000i64;
        timelines.add(7, "app", (0, s), &[stack("early", 10.0, 10.0)], false);
        timelines.add(
            7,
            "app",
            (s, 2 * s),
            &[stack("peak_site", 50.0, 40.0)],
            false,
        );
        timelines.add(7, "app", (2 * s, 3 * s), &[stack("late", 5.0, 1.0)], false);
        // The same pid reused by another program: a timeline of its own.
        timelines.add(7, "other", (3 * s, 4 * s), &[stack("x", 1.0, 0.0)], false);
        let done = timelines.finish(0, true);
        assert_eq!(done.len(), 2);
        let app = done
            .iter()
            .find(|t| t.name.as_deref() == Some("app"))
            .unwrap();
        let peak = app.timeline.peak.as_ref().unwrap();
        assert_eq!(peak.inuse.estimated_bytes, 40.0);
        assert_eq!(peak.at_ns, 2_000_000_000);
        assert_eq!(peak.stacks.len(), 1);
        assert_eq!(peak.stacks[0].0[0].functions[0].name, "peak_site");
        assert_eq!(app.timeline.points.len(), 3);
        assert_eq!(app.timeline.points[1].inuse.estimated_bytes, 40.0);
    }

    /// A long store merges its points pairwise and keeps their sums.
    #[test]
    fn many_profiles_merge_to_a_bounded_timeline() {
        let mut timelines = StoredTimelines::default();
        let n = 5 * MAX_POINTS as i64 + 3;
        for i in 0..n {
            timelines.add(7, "app", (i, i + 1), &[stack("s", 2.0, 0.0)], i == 9);
        }
        let done = timelines.finish(0, false);
        let points = &done[0].timeline.points;
        assert!(points.len() <= MAX_POINTS && points.len() > MAX_POINTS / 4);
        let sum: f64 = points.iter().map(|p| p.alloc.estimated_bytes).sum();
        assert_eq!(sum, 2.0 * n as f64);
        assert_eq!(points.last().unwrap().end_ns, n as u64);
        assert!(
            done[0].timeline.time_sampled,
            "one time-sampled profile marks it"
        );
    }
}
