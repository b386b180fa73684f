//! The observation windows of time sampling (docs/design.md, "Overhead budget").
//!
//! Time is cut into periods of `P` (1 s by default) counted from an origin. Each period
//! draws one phase `φ`, uniform in `[0, P)` and independent of everything the processes
//! do. An image with duty `d` is probed in the circular window `[φ, φ + d·P)` of each
//! period (wrapping to the period's start), so every instant of the period lies in it
//! with probability exactly `d`. All images share the phase: the window of an image
//! with a smaller duty lies inside those with larger ones, so a process is observed
//! (every allocator image it maps probed) in the window of its smallest duty, and a
//! sample it makes there stands for `1/d` (profile's `estimate::windows`).
//!
//! Probes are attached a lead before a window opens (twice the last attach times of
//! all images together, since every image's window opens at the same phase and they
//! are attached one after another; between [`MIN_LEAD`] and [`MAX_LEAD`]: attaching
//! libc takes 5-16 ms here) and stay attached across gaps shorter than
//! [`KEEP_ATTACHED_GAP`]. Whether an image's probes really were in at a sample's instant
//! is the engine's record (`ImageSet::covered`): a window that opened before them (the
//! engine was late) loses its samples rather than weigh them as observed.

use std::collections::{HashMap, VecDeque};

use allocbpf_images::image::ImageKey;
use allocbpf_profile::estimate::windows::SampleWindow;
use rand::{rngs::StdRng, Rng, SeedableRng};

/// Shortest lead: probes are attached at least this long before their window opens.
pub const MIN_LEAD: u64 = 5_000_000;

/// Longest lead (and the lead of an image never attached yet).
pub const MAX_LEAD: u64 = 40_000_000;

/// Probes stay attached across a gap between windows shorter than this (detaching and
/// attaching again would cost more than the traps of the gap).
pub const KEEP_ATTACHED_GAP: u64 = 100_000_000;

/// How far back phases and duty changes are kept: a sample older than this when it is
/// read cannot be placed and is dropped (the ring buffer is read within milliseconds).
const HISTORY_NS: u64 = 120_000_000_000;

/// Duty changes kept per image (a few per second at most).
const DUTY_CHANGES_KEPT: usize = 1024;

/// Largest window shift: inside its windows an image's probes sample at most
/// `2^MAX_WINDOW_SHIFT` times denser than the configured rate. The bound on what the
/// denser samples cost: a process's expected samples per second stay at most what
/// probing full time would take (`2^shift <= 1/duty`), but the probes' lead before a
/// window (up to 40 ms against a 10 ms window at the floor) samples at the same density
/// for samples that are dropped; 16x keeps that waste within 16 times the lead's share
/// of full-time sampling (docs/statistics.md, "Samples inside windows").
pub const MAX_WINDOW_SHIFT: u8 = 4;

/// The window shift for an image probed `duty` of the time: the largest `k` with
/// `2^k <= 1/duty`, at most [`MAX_WINDOW_SHIFT`] (0 when probed full time). Inside
/// its windows the image's probes then draw countdowns of mean `rate >> k`, and a
/// process observed there gets between half and all of the samples it would get
/// probed full time (down to `2^MAX_WINDOW_SHIFT * duty` of them below duty 1/16).
/// Each sample carries the interval it was drawn at, so the estimator is unchanged.
pub fn window_shift(duty: f64) -> u8 {
    if duty.is_nan() || duty <= 0.0 || duty >= 1.0 {
        return 0;
    }
    let shift = (1.0 / duty).log2().floor();
    shift.clamp(0.0, f64::from(MAX_WINDOW_SHIFT)) as u8
}

/// Why a sample cannot be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unplaced {
    /// Outside its process's window (an image of the process was probed for another
    /// process's sake).
    OutsideWindow,
    /// Its images unknown, its window's probes not in at the time, or older than the
    /// history kept.
    Unknown,
}

/// The schedule of every image's windows. See the module docs.
pub struct WindowSchedule {
    origin_ns: u64,
    period_ns: u64,
    /// `(period, phase)`, oldest first, contiguous.
    phases: VecDeque<(u64, u64)>,
    /// Per image, `(from_ns, duty)` changes, oldest first.
    duties: HashMap<ImageKey, VecDeque<(u64, f64)>>,
    /// Per image, how long attaching its probes took (recently, at most): the lead.
    attach_times: HashMap<ImageKey, u64>,
    rng: StdRng,
}

impl WindowSchedule {
    /// A schedule starting at `origin_ns` (CLOCK_MONOTONIC) with periods of `period_ns`.
    pub fn new(origin_ns: u64, period_ns: u64) -> Self {
        Self::with_rng(origin_ns, period_ns, StdRng::from_os_rng())
    }

    /// The same with a given random source (tests).
    pub fn with_rng(origin_ns: u64, period_ns: u64, rng: StdRng) -> Self {
        Self {
            origin_ns,
            period_ns: period_ns.max(1),
            phases: VecDeque::new(),
            duties: HashMap::new(),
            attach_times: HashMap::new(),
            rng,
        }
    }

    /// The period length.
    pub fn period_ns(&self) -> u64 {
        self.period_ns
    }

    /// The period `t_ns` falls in (0 before the origin).
    pub fn period_of(&self, t_ns: u64) -> u64 {
        t_ns.saturating_sub(self.origin_ns) / self.period_ns
    }

    fn period_start(&self, period: u64) -> u64 {
        self.origin_ns + period * self.period_ns
    }

    /// Draws the phases of every period up to the one after `now_ns`'s, and forgets
    /// those older than the history kept.
    pub fn draw_phases(&mut self, now_ns: u64) {
        let wanted = self.period_of(now_ns) + 1;
        let mut next = self
            .phases
            .back()
            .map_or(self.period_of(now_ns), |&(k, _)| k + 1);
        while next <= wanted {
            let phase = self.rng.random_range(0..self.period_ns);
            self.phases.push_back((next, phase));
            next += 1;
        }
        let oldest = self.period_of(now_ns.saturating_sub(HISTORY_NS));
        while self.phases.front().is_some_and(|&(k, _)| k < oldest) {
            self.phases.pop_front();
        }
    }

    fn phase(&self, period: u64) -> Option<u64> {
        let &(first, _) = self.phases.front()?;
        let index = usize::try_from(period.checked_sub(first)?).ok()?;
        self.phases.get(index).map(|&(_, phase)| phase)
    }

    /// The first instant whose period has no phase drawn yet: a duty change decided
    /// now that depends on what the windows saw takes effect there, so no window's
    /// placement ever depends on its own phase.
    pub fn next_undrawn_ns(&self, now_ns: u64) -> u64 {
        let period = self
            .phases
            .back()
            .map_or(self.period_of(now_ns), |&(k, _)| k + 1);
        self.period_start(period)
    }

    /// `key`'s duty at `t_ns` (1 before any change).
    pub fn duty_at(&self, key: &ImageKey, t_ns: u64) -> f64 {
        self.duties
            .get(key)
            .and_then(|changes| changes.iter().rev().find(|&&(from, _)| from <= t_ns))
            .map_or(1.0, |&(_, duty)| duty)
    }

    /// `key`'s duty from `from_ns` on (later changes already planned are replaced).
    pub fn set_duty(&mut self, key: ImageKey, from_ns: u64, duty: f64) {
        let changes = self.duties.entry(key).or_default();
        while changes.back().is_some_and(|&(from, _)| from >= from_ns) {
            changes.pop_back();
        }
        changes.push_back((from_ns, duty.clamp(0.0, 1.0)));
        while changes.len() > DUTY_CHANGES_KEPT {
            changes.pop_front();
        }
    }

    /// Forgets an image (no process maps it any more).
    pub fn forget(&mut self, key: &ImageKey) {
        self.duties.remove(key);
        self.attach_times.remove(key);
    }

    /// Attaching `key`'s probes took `took_ns`. Its figure becomes that, or a little
    /// less than before if that was longer (attach times vary with the processes
    /// mapping the image: following only the last one often falls short).
    pub fn attached_in(&mut self, key: ImageKey, took_ns: u64) {
        let before = self.attach_times.get(&key).map_or(0, |&took| took * 9 / 10);
        self.attach_times.insert(key, took_ns.max(before));
    }

    /// How long before a window probes go in: twice the attach times of every image
    /// (windows open together and images are attached in turn), bounded; the longest
    /// lead before any attach was timed.
    pub fn lead(&self) -> u64 {
        if self.attach_times.is_empty() {
            return MAX_LEAD;
        }
        (2 * self.attach_times.values().sum::<u64>()).clamp(MIN_LEAD, MAX_LEAD)
    }

    /// True if `t_ns` lies in the window of duty `duty` of its period; `None` if that
    /// period's phase is not known.
    fn in_window(&self, t_ns: u64, duty: f64) -> Option<bool> {
        if duty >= 1.0 {
            return Some(true);
        }
        let period = self.period_of(t_ns);
        let phase = self.phase(period)?;
        let offset = t_ns.saturating_sub(self.period_start(period));
        let since_phase = (offset + self.period_ns - phase) % self.period_ns;
        Some((since_phase as f64) < duty * self.period_ns as f64)
    }

    /// Places a sample taken at `t_ns` by a process mapping `images`: the window it
    /// lies in and its inclusion probability, or why it cannot be used.
    pub fn place(&self, images: &[ImageKey], t_ns: u64) -> Result<SampleWindow, Unplaced> {
        if images.is_empty() {
            // Its images are not known (being examined after an exec, or its maps
            // unreadable): no inclusion can be given.
            return Err(Unplaced::Unknown);
        }
        let duty = self.inclusion_at(images, t_ns);
        if duty <= 0.0 {
            return Err(Unplaced::Unknown);
        }
        match self.in_window(t_ns, duty) {
            Some(true) => Ok(SampleWindow {
                period: self.period_of(t_ns),
                inclusion: duty,
            }),
            Some(false) => Err(Unplaced::OutsideWindow),
            None => Err(Unplaced::Unknown),
        }
    }

    /// The expected fraction of time a process mapping `images` is observed at `t_ns`.
    pub fn inclusion_at(&self, images: &[ImageKey], t_ns: u64) -> f64 {
        images
            .iter()
            .map(|key| self.duty_at(key, t_ns))
            .fold(1.0, f64::min)
    }

    /// `key`'s window pieces `[open, close)` in the periods around `now_ns` (the one
    /// before, its own and the next), in order.
    fn pieces(&self, key: &ImageKey, now_ns: u64) -> Vec<(u64, u64)> {
        let current = self.period_of(now_ns);
        let mut pieces = Vec::new();
        for period in current.saturating_sub(1)..=current + 1 {
            let start = self.period_start(period);
            let end = start + self.period_ns;
            let duty = self.duty_at(key, start.max(now_ns));
            if duty >= 1.0 {
                pieces.push((start, end));
                continue;
            }
            let Some(phase) = self.phase(period) else {
                continue;
            };
            let length = (duty * self.period_ns as f64) as u64;
            if length == 0 {
                continue;
            }
            let open = start + phase;
            if phase + length <= self.period_ns {
                pieces.push((open, open + length));
            } else {
                pieces.push((start, start + phase + length - self.period_ns));
                pieces.push((open, end));
            }
        }
        pieces.sort_unstable();
        pieces
    }

    /// When `key`'s probes should be in around `now_ns`: windows widened by the lead
    /// before, merged across gaps under [`KEEP_ATTACHED_GAP`].
    fn attach_spans(&self, key: &ImageKey, now_ns: u64) -> Vec<(u64, u64)> {
        let lead = self.lead();
        let mut spans: Vec<(u64, u64)> = Vec::new();
        for (open, close) in self.pieces(key, now_ns) {
            let open = open.saturating_sub(lead);
            match spans.last_mut() {
                Some(last) if open <= last.1 + KEEP_ATTACHED_GAP => last.1 = last.1.max(close),
                _ => spans.push((open, close)),
            }
        }
        spans
    }

    /// Whether `key`'s probes should be in at `now_ns`, and when that next changes.
    pub fn attach_plan(&self, key: &ImageKey, now_ns: u64) -> AttachPlan {
        let spans = self.attach_spans(key, now_ns);
        let attached = spans.iter().any(|&(a, b)| a <= now_ns && now_ns < b);
        let next_change_ns = spans
            .iter()
            .flat_map(|&(a, b)| [a, b])
            .filter(|&t| t > now_ns)
            .min()
            // Nothing ahead in the periods drawn: look again at the next period.
            .unwrap_or(self.period_start(self.period_of(now_ns) + 1));
        AttachPlan {
            attached,
            next_change_ns,
        }
    }

    /// The open window piece of `key` containing `t_ns`, if any (to date a blind spot).
    pub fn open_piece(&self, key: &ImageKey, t_ns: u64) -> Option<(u64, u64)> {
        self.pieces(key, t_ns)
            .into_iter()
            .find(|&(open, close)| open <= t_ns && t_ns < close)
    }
}

/// What [`WindowSchedule::attach_plan`] says of one image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttachPlan {
    /// Its probes should be in now.
    pub attached: bool,
    /// When that may change next (CLOCK_MONOTONIC ns).
    pub next_change_ns: u64,
}

#[cfg(test)]
mod tests {
    #[test]
    fn window_shifts_follow_the_observed_fraction_within_the_bound() {
        assert_eq!(window_shift(1.0), 0);
        assert_eq!(window_shift(0.6), 0);
        assert_eq!(window_shift(0.5), 1);
        assert_eq!(window_shift(0.3), 1);
        assert_eq!(window_shift(0.0449), 4);
        assert_eq!(window_shift(0.01), MAX_WINDOW_SHIFT);
        assert_eq!(window_shift(0.0), 0);
        assert_eq!(window_shift(f64::NAN), 0);
        for duty in [0.9, 0.4, 0.2, 0.1, 0.07] {
            // Never denser than full time would sample: 2^k <= 1/duty.
            assert!(f64::from(1u32 << window_shift(duty)) * duty <= 1.0);
        }
    }

    use super::*;

    const SEC: u64 = 1_000_000_000;

    fn key(n: u64) -> ImageKey {
        ImageKey {
            device: 1,
            inode: n,
        }
    }

    fn schedule() -> WindowSchedule {
        WindowSchedule::with_rng(0, SEC, StdRng::seed_from_u64(3))
    }

    /// Over many periods, the share of instants observed is the duty: the windows are
    /// placed uniformly (the circular window has no edge effect). 4,000 periods x 10
    /// instants; each instant is in with probability 0.05, so the count is Binomial
    /// (40,000, 0.05): mean 2,000, sd 43.6. The bound is 5 sd, the seed fixed.
    #[test]
    fn instants_are_observed_with_probability_duty() {
        let mut s = schedule();
        s.set_duty(key(1), 0, 0.05);
        let mut observed = 0;
        for period in 0..4_000u64 {
            s.draw_phases(period * SEC);
            for i in 0..10 {
                let t = period * SEC + i * SEC / 10 + 12_345;
                if s.place(&[key(1)], t).is_ok() {
                    observed += 1;
                }
            }
        }
        assert!((observed as f64 - 2_000.0).abs() < 5.0 * 43.6, "{observed}");
    }

    /// A process is observed only where every image it maps is probed: inside the
    /// window of its smallest duty, which lies inside the others'.
    #[test]
    fn a_process_is_observed_in_its_smallest_window() {
        let mut s = schedule();
        s.set_duty(key(1), 0, 0.1);
        s.set_duty(key(2), 0, 0.4);
        s.draw_phases(0);
        for step in 0..1_000u64 {
            let t = step * SEC / 1_000;
            let both = s.place(&[key(1), key(2)], t);
            let small = s.place(&[key(1)], t);
            assert_eq!(both.is_ok(), small.is_ok());
            if small.is_ok() {
                assert!(s.place(&[key(2)], t).is_ok(), "nested at {t}");
                assert!(s.attach_plan(&key(1), t).attached && s.attach_plan(&key(2), t).attached);
            }
            if let Ok(window) = both {
                assert_eq!(window.inclusion, 0.1);
            }
        }
    }

    /// Probes go in a lead before a window and come out after it; the plan's next change
    /// is the next boundary.
    #[test]
    fn probes_bracket_each_window() {
        let mut s = schedule();
        s.set_duty(key(1), 0, 0.02);
        s.attached_in(key(1), 3_000_000);
        s.attached_in(key(2), 3_000_000);
        let lead = s.lead();
        assert_eq!(lead, 12_000_000);
        s.draw_phases(0);
        let (open, close) = s.pieces(&key(1), 0)[0];
        assert!(!s.attach_plan(&key(1), open - lead - 1).attached);
        assert!(s.attach_plan(&key(1), open - lead).attached);
        assert!(s.attach_plan(&key(1), close - 1).attached);
        let after = s.attach_plan(&key(1), close);
        assert!(!after.attached || close - open > SEC - KEEP_ATTACHED_GAP);
        assert_eq!(
            s.attach_plan(&key(1), open - lead - 1).next_change_ns,
            open - lead
        );
    }

    /// A duty change applies from the first period without a phase.
    #[test]
    fn changes_wait_for_an_undrawn_period() {
        let mut s = schedule();
        s.draw_phases(SEC / 2);
        assert_eq!(s.next_undrawn_ns(SEC / 2), 2 * SEC);
        s.set_duty(key(1), s.next_undrawn_ns(SEC / 2), 0.5);
        assert_eq!(s.duty_at(&key(1), 2 * SEC - 1), 1.0);
        assert_eq!(s.duty_at(&key(1), 2 * SEC), 0.5);
    }
}
