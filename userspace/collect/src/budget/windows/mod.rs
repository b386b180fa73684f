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
//! Each move of an image's probes in or out registers (or removes) its breakpoints in
//! every process that maps it, which the agent pays for. Where that costs more than
//! its share ([`WindowSchedule::set_activation`]), windows come in a random share `q`
//! of the periods only, each `1/q` times longer: the same period draws a second
//! uniform `u`, and an image of duty `d` has its window in that period if
//! `u < max(q, d)`, of length `d / max(q, d)` of the period. Every instant is still
//! observed with probability exactly `d`; windows still nest (both the periods with a
//! window and the window's length grow with the duty, from the common phase); the
//! variance of the estimates is the per-period one above, over fewer, fuller periods
//! (docs/statistics.md, "Activation"). `q = 1` is the plain schedule.
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

/// The smallest share of periods with windows: at this share a 60-period interval
/// has windows in 7.5 periods on average (none at all with probability 0.03%), enough
/// for the per-period variance to be estimated; below it the agent overruns its share
/// for window moves rather than lose its intervals.
pub const MIN_ACTIVATION: f64 = 0.125;

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

/// What one period drew: the phase of its windows, whether they come at all, and the
/// share of periods with windows when it was drawn.
#[derive(Clone, Copy, Debug)]
struct PeriodDraw {
    /// Where its windows begin, ns from the period's start.
    phase: u64,
    /// Uniform in `[0, 1)`: an image of duty `d` has a window here if below
    /// `max(share, d)`.
    activation_draw: f64,
    /// The share of periods with windows in force when it was drawn.
    share: f64,
}

impl PeriodDraw {
    /// The length of the window of an image of `duty` in this period (0: none).
    fn window_ns(&self, duty: f64, period_ns: u64) -> u64 {
        if duty >= 1.0 {
            return period_ns;
        }
        // At least the share in force, which is never below `MIN_ACTIVATION`.
        let share = self.share.max(duty);
        if self.activation_draw >= share {
            return 0;
        }
        (duty / share * period_ns as f64) as u64
    }
}

/// The schedule of every image's windows. See the module docs.
pub struct WindowSchedule {
    origin_ns: u64,
    period_ns: u64,
    /// Each period's draws, oldest first, contiguous.
    phases: VecDeque<(u64, PeriodDraw)>,
    /// The share of periods with windows, for periods drawn from now on.
    activation: f64,
    /// Per image, `(from_ns, duty)` changes, oldest first.
    duties: HashMap<ImageKey, VecDeque<(u64, f64)>>,
    /// Per image, how long attaching its probes took (recently, at most): the lead.
    attach_times: HashMap<ImageKey, u64>,
    /// Per image, the agent's CPU for attaching its probes (a running mean of the last
    /// few attaches).
    attach_cpu: HashMap<ImageKey, u64>,
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
            activation: 1.0,
            duties: HashMap::new(),
            attach_times: HashMap::new(),
            attach_cpu: HashMap::new(),
            rng,
        }
    }

    /// The share of periods given windows, from the next period drawn on: at most 1,
    /// at least [`MIN_ACTIVATION`]. Periods already drawn keep theirs, so no window's
    /// placement depends on what the windows saw.
    pub fn set_activation(&mut self, share: f64) {
        self.activation = if share.is_nan() {
            1.0
        } else {
            share.clamp(MIN_ACTIVATION, 1.0)
        };
    }

    /// The share of periods given windows for periods drawn from now on.
    pub fn activation(&self) -> f64 {
        self.activation
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
            let draw = PeriodDraw {
                phase: self.rng.random_range(0..self.period_ns),
                activation_draw: self.rng.random_range(0.0..1.0),
                share: self.activation,
            };
            self.phases.push_back((next, draw));
            next += 1;
        }
        let oldest = self.period_of(now_ns.saturating_sub(HISTORY_NS));
        while self.phases.front().is_some_and(|&(k, _)| k < oldest) {
            self.phases.pop_front();
        }
    }

    fn draw(&self, period: u64) -> Option<PeriodDraw> {
        let &(first, _) = self.phases.front()?;
        let index = usize::try_from(period.checked_sub(first)?).ok()?;
        self.phases.get(index).map(|&(_, draw)| draw)
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
        self.attach_cpu.remove(key);
    }

    /// Attaching `key`'s probes took `took_ns` (wall) and `cpu_ns` of the agent's CPU.
    /// The lead's figure becomes the time, or a little less than before if that was
    /// longer (attach times vary with the processes mapping the image: following only
    /// the last one often falls short, and a late window loses samples). The cost's is
    /// a running mean of the last few: what moves cost on average, which a single slow
    /// attach must not hold high for minutes when moves come seldom.
    pub fn attached_in(&mut self, key: ImageKey, took_ns: u64, cpu_ns: u64) {
        let before = self.attach_times.get(&key).map_or(0, |&took| took * 9 / 10);
        self.attach_times.insert(key, took_ns.max(before));
        let cost = self.attach_cpu.entry(key).or_insert(cpu_ns);
        *cost = (*cost * 3 + cpu_ns) / 4;
    }

    /// The agent's expected CPU per period for moving the probes of every image probed
    /// part time at `now_ns`, were windows given to a share `share` of the periods: an
    /// image of duty `d` has a window in `max(share, d)` of them, each a move in and
    /// one out (the way out, on other threads, taken to cost what the way in did).
    pub fn moves_cpu_per_period(&self, share: f64, now_ns: u64) -> f64 {
        self.attach_cpu
            .iter()
            .filter_map(|(key, &cpu)| {
                let duty = self.duty_at(key, now_ns);
                (duty < 1.0).then(|| 2.0 * cpu as f64 * share.max(duty))
            })
            .sum()
    }

    /// The largest share of periods with windows (within [`MIN_ACTIVATION`] and 1)
    /// whose moves cost at most `allowed_ns` of CPU per period at `now_ns`.
    pub fn affordable_activation(&self, allowed_ns: f64, now_ns: u64) -> f64 {
        if self.moves_cpu_per_period(1.0, now_ns) <= allowed_ns {
            return 1.0;
        }
        // The cost grows with the share: halve the bracket a fixed number of times.
        let (mut low, mut high) = (MIN_ACTIVATION, 1.0);
        for _ in 0..20 {
            let middle = (low + high) / 2.0;
            match self.moves_cpu_per_period(middle, now_ns) <= allowed_ns {
                true => low = middle,
                false => high = middle,
            }
        }
        low
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
        let draw = self.draw(period)?;
        let offset = t_ns.saturating_sub(self.period_start(period));
        let since_phase = (offset + self.period_ns - draw.phase) % self.period_ns;
        Some(since_phase < draw.window_ns(duty, self.period_ns))
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
            let Some(draw) = self.draw(period) else {
                continue;
            };
            let (phase, length) = (draw.phase, draw.window_ns(duty, self.period_ns));
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
mod tests;
