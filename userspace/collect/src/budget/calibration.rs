//! The calibration workload: a child process whose probe hits the engine times to
//! learn what one hit costs on this machine (the engine's `hit_cost.rs`).

use std::time::Instant;

/// How the engine starts its calibration child: this very executable (the single-step
/// figure puts a probe on its own [`calibration_step`]), with the arguments under which
/// it runs [`calibration_child`]. The binary that defines those arguments says which.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CalibrationChild {
    /// Arguments that run `calibration_child(false)`, the malloc/free loop.
    pub loop_args: Vec<String>,
    /// Arguments that run `calibration_child(true)`, the single-step loop.
    pub step_args: Vec<String>,
}

/// Iterations of the calibration loop (one malloc and one free each).
pub const CALIBRATION_ITERATIONS: u32 = 200_000;

/// The calibration workload, run in a child process ([`CalibrationChild`]): waits for
/// a line on stdin (so the parent can set its gate first), then times
/// [`CALIBRATION_ITERATIONS`] malloc/free pairs and returns nanoseconds per pair, for
/// the binary to print (the parent reads it from the child's stdout). With `step`, it
/// calls [`calibration_step`] instead (a tenth as many times: a single-stepped probe
/// costs far more than an emulated one).
pub fn calibration_child(step: bool) -> std::io::Result<f64> {
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    let iterations = if step {
        CALIBRATION_ITERATIONS / 10
    } else {
        CALIBRATION_ITERATIONS
    };
    let started = Instant::now();
    for i in 0..iterations {
        if step {
            std::hint::black_box(calibration_step(std::hint::black_box(u64::from(i))));
            continue;
        }
        // SAFETY: plain libc allocation, freed at once; black_box keeps the calls.
        unsafe {
            let p = libc::malloc(std::hint::black_box(64 + (i as usize & 63)));
            libc::free(std::hint::black_box(p));
        }
    }
    Ok(started.elapsed().as_nanos() as f64 / f64::from(iterations))
}

/// A function whose first instruction (`nop`, +0) the kernel emulates and whose second
/// (`lea`, +1) it single-steps: the calibration probes each in turn to measure what a
/// single-stepped probe costs on this machine.
#[unsafe(naked)]
pub extern "C" fn calibration_step(x: u64) -> u64 {
    core::arch::naked_asm!("nop", "lea rax, [rdi + rdi * 2]", "ret")
}
