//! One line of progress on standard error while a run goes on: elapsed time, samples
//! (and their rate), the sampling interval in force and drops. Only on a terminal: a
//! log or a pipe gets none (their readers want the lines that stay).

use std::{
    io::{IsTerminal, Write},
    sync::atomic::{AtomicBool, Ordering},
};

use allocbpf_collect::run::Progress;
use allocbpf_profile::units::format_bytes;

/// A progress line is on the terminal now (to be cleared before other output).
static SHOWN: AtomicBool = AtomicBool::new(false);

/// The line for `progress`.
pub fn line(progress: &Progress) -> String {
    let seconds = progress.elapsed.as_secs_f64();
    let per_second = match seconds > 0.0 {
        true => progress.samples as f64 / seconds,
        false => 0.0,
    };
    format!(
        "allocbpf: {seconds:.0}s, {} samples ({per_second:.0}/s), interval {}, {} dropped, {} process(es)",
        progress.samples,
        format_bytes(progress.interval as f64),
        progress.drops,
        progress.processes,
    )
}

/// What the run calls with its progress: rewrites the line on a terminal, does
/// nothing elsewhere.
pub fn printer() -> impl FnMut(&Progress) {
    let terminal = std::io::stderr().is_terminal();
    move |progress| {
        if !terminal {
            return;
        }
        let mut stderr = std::io::stderr().lock();
        // Carriage return and erase-line: the line is rewritten in place.
        let _ = write!(stderr, "\r\x1b[2K{}", line(progress));
        let _ = stderr.flush();
        SHOWN.store(true, Ordering::Relaxed);
    }
}

/// Erases the progress line, if one is shown, so what follows starts on a clean line.
pub fn clear() {
    if SHOWN.swap(false, Ordering::Relaxed) {
        let mut stderr = std::io::stderr().lock();
        let _ = write!(stderr, "\r\x1b[2K");
        let _ = stderr.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_says_time_samples_rate_interval_and_drops() {
        let line = line(&Progress {
            elapsed: std::time::Duration::from_secs(4),
            samples: 400,
            drops: 3,
            interval: 512 * 1024,
            processes: 1,
        });
        assert_eq!(
            line,
            "allocbpf: 4s, 400 samples (100/s), interval 512.0 KiB, 3 dropped, 1 process(es)"
        );
    }
}
