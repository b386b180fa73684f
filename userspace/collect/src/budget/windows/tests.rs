//! The window schedule's tests: inclusion, nesting, activation and the interval's coverage.

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
    s.attached_in(key(1), 3_000_000, 1_000_000);
    s.attached_in(key(2), 3_000_000, 1_000_000);
    // Only the windowed image moves, in and out, in every period at share 1.
    assert_eq!(s.moves_cpu_per_period(1.0, 0), 2_000_000.0);
    assert_eq!(s.moves_cpu_per_period(0.25, 0), 500_000.0);
    assert_eq!(s.affordable_activation(4_000_000.0, 0), 1.0);
    let share = s.affordable_activation(1_000_000.0, 0);
    assert!((share - 0.5).abs() < 1e-5, "{share}");
    assert_eq!(s.affordable_activation(0.0, 0), MIN_ACTIVATION);
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

/// With windows in a quarter of the periods, an instant is still observed with
/// probability duty. 4,000 periods x 10 evenly spaced instants at duty 0.05: a
/// period has its window with probability 0.25, 0.2 periods long, and then holds
/// exactly 2 of the instants (a circular window of 2/10 of the period), so each
/// period counts 2·Bernoulli(0.25): mean 0.5, variance 0.75, over all periods mean
/// 2,000 and sd 54.8. The bound is 5 sd, the seed fixed.
#[test]
fn with_windows_in_a_share_of_periods_instants_are_still_observed_with_probability_duty() {
    let mut s = schedule();
    s.set_activation(0.25);
    s.set_duty(key(1), 0, 0.05);
    let (mut observed, mut periods_with_window) = (0, 0);
    for period in 0..4_000u64 {
        s.draw_phases(period * SEC);
        let before = observed;
        for i in 0..10 {
            let t = period * SEC + i * SEC / 10 + 12_345;
            if s.place(&[key(1)], t).is_ok() {
                observed += 1;
            }
        }
        assert!(matches!(observed - before, 0 | 2), "period {period}");
        periods_with_window += usize::from(observed > before);
    }
    assert!((observed as f64 - 2_000.0).abs() < 5.0 * 54.8, "{observed}");
    // Binomial(4,000, 0.25): sd 27.4.
    assert!((periods_with_window as f64 - 1_000.0).abs() < 5.0 * 27.4);
}

/// Under activation windows still nest: where a smaller duty's window is, every
/// larger duty's is too, and their probes are in.
#[test]
fn windows_in_a_share_of_periods_still_nest() {
    let mut s = schedule();
    s.set_activation(0.2);
    for (n, duty) in [(1, 0.02), (2, 0.1), (3, 0.3), (4, 0.7)] {
        s.set_duty(key(n), 0, duty);
    }
    for period in 0..200u64 {
        s.draw_phases(period * SEC);
        for step in 0..100u64 {
            let t = period * SEC + step * SEC / 100;
            let inside: Vec<bool> = (1..=4).map(|n| s.place(&[key(n)], t).is_ok()).collect();
            for n in 1..4 {
                assert!(!inside[n - 1] || inside[n], "{n} at {t}: {inside:?}");
            }
            if inside[0] {
                assert!((1..=4).all(|n| s.attach_plan(&key(n), t).attached));
                let window = s.place(&[key(1), key(4)], t).unwrap();
                assert_eq!(window.inclusion, 0.02);
            }
        }
    }
}

/// A new share applies to periods drawn after it only, and stays within its bounds.
#[test]
fn a_new_activation_applies_to_periods_not_drawn_yet() {
    let mut s = schedule();
    s.set_duty(key(1), 0, 0.5);
    s.draw_phases(0);
    s.set_activation(0.0);
    assert_eq!(s.activation(), MIN_ACTIVATION);
    // Periods 0 and 1 were drawn at share 1: a window each.
    for period in 0..2 {
        assert!(!s.pieces(&key(1), period * SEC).is_empty());
        assert_eq!(s.draw(period).unwrap().share, 1.0);
    }
    s.draw_phases(2 * SEC);
    assert_eq!(s.draw(3).unwrap().share, MIN_ACTIVATION);
    s.set_activation(f64::NAN);
    assert_eq!(s.activation(), 1.0);
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

/// The time-sampling interval still covers at its nominal rate when windows come in a
/// share of the periods: a steady process over 60 periods (a 60 s agent interval) or
/// 20 at duty 0.03, windows in the fewest periods allowed ([`MIN_ACTIVATION`], 1/8) or
/// in all, its 95% interval (`TimeSampling::interval`, from the per-period totals)
/// computed in 1,000 runs of fixed seeds. Each period's total is the bytes of the
/// instants its window holds (a grid of 50 per period) over the duty: time sampling
/// alone, byte sampling left out (it adds variance the estimator sees as well).
/// - Of the runs with a window, at least 92% cover. Were the coverage 95%, the runs
///   covering would be Binomial(n, 0.95), sd 6.9 for n = 1,000: 92% is 4.3 sd below.
///   With one degree of freedom per period (not per period with samples) the 60-period
///   runs covered 93.2%: the skew of a count of windowed periods averaging 7.5.
/// - A run has no window at all with probability `(1 - 1/8)^n`: 0.03% over 60 periods,
///   6.9% over 20 (sd 8 in 1,000 runs); then nothing is seen and no interval printed
///   (docs/statistics.md, "Activation"). The bound is 5 sd above the mean.
#[test]
fn the_interval_covers_when_windows_come_in_a_share_of_periods() {
    use allocbpf_profile::estimate::{
        pace::PaceSlack, windows::PeriodTotals, windows::TimeSampling, Confidence,
    };
    const GRID: u64 = 50;
    let (duty, bytes_per_instant) = (0.03, 1_000.0);
    for (periods, activation) in [(60u64, MIN_ACTIVATION), (20, MIN_ACTIVATION), (60, 1.0)] {
        let truth = (periods * GRID) as f64 * bytes_per_instant;
        let (mut covered, mut unseen) = (0, 0);
        for run in 0..1_000u64 {
            let mut s = WindowSchedule::with_rng(0, SEC, StdRng::seed_from_u64(run));
            s.set_activation(activation);
            s.set_duty(key(1), 0, duty);
            let mut totals = PeriodTotals::default();
            let mut estimate = 0.0;
            for period in 0..periods {
                s.draw_phases(period * SEC);
                let seen = (0..GRID)
                    .filter(|i| s.place(&[key(1)], period * SEC + i * SEC / GRID).is_ok())
                    .count();
                if seen > 0 {
                    let y = seen as f64 * bytes_per_instant / duty;
                    totals.add(period, y);
                    estimate += y;
                }
            }
            let sampling = TimeSampling {
                observed_fraction: duty,
                periods: 0..=periods - 1,
                totals,
                probe_share: None,
                pace: None,
                paced_processes: 0,
                pace_slack: PaceSlack::default(),
            };
            match sampling.interval(estimate, Confidence::DEFAULT) {
                Some(interval) => {
                    covered += usize::from(interval.lo <= truth && truth <= interval.hi)
                }
                None => unseen += 1,
            }
        }
        let seen = 1_000 - unseen;
        eprintln!("{periods} periods, activation {activation}: {covered} of {seen} covered");
        assert!(
            covered as f64 >= 0.92 * seen as f64,
            "{periods} periods at {activation}"
        );
        let none = 1_000.0 * (1.0 - activation).powi(periods as i32);
        let sd = (none * (1.0 - none / 1_000.0)).sqrt();
        assert!(
            (unseen as f64) <= none + 5.0 * sd.max(1.0),
            "{unseen} runs unseen"
        );
    }
}
