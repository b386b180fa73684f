//! What a read of another process's memory costs (`cargo xtask bench --parts reads`):
//! a bare `process_vm_readv`, the same judged by the kernel's mapping query and made at
//! once (every read of anonymous or local memory), and one sent to the deadline reader
//! thread (memory of a file system that may stall), on any CPU or (`--one-cpu`) pinned
//! to one with the reader. Reads of our
//! own memory, 64 bytes each; medians of rounds, and the ratios to the bare read.

use std::time::Instant;

use allocbpf_images::memory::{deadline, read_unguarded as bare, ProcessMemory};

const READS: u32 = 20_000;
const ROUNDS: usize = 7;

/// Microseconds per read of `read`, median of [`ROUNDS`].
fn per_read(mut read: impl FnMut() -> std::io::Result<()>) -> f64 {
    let mut rounds: Vec<f64> = (0..ROUNDS)
        .map(|_| {
            let started = Instant::now();
            for _ in 0..READS {
                read().unwrap();
            }
            started.elapsed().as_secs_f64() * 1e6 / f64::from(READS)
        })
        .collect();
    rounds.sort_by(f64::total_cmp);
    rounds[ROUNDS / 2]
}

fn pin_to_first_cpu() {
    // SAFETY: a zeroed cpu_set_t is empty; we set one CPU and apply it to this thread
    // (threads started after inherit it).
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set);
    }
}

fn main() {
    // Pinned before the reader thread starts, which inherits it.
    let pinned = std::env::args().any(|a| a == "--one-cpu");
    if pinned {
        pin_to_first_cpu();
    }
    let value = [7u8; 64];
    let address = value.as_ptr() as u64;
    let pid = std::process::id();
    let memory = ProcessMemory::new(pid);
    let mut buffer = [0u8; 64];
    let bare_us = per_read(|| bare(pid, address, &mut buffer));
    let judged = per_read(|| memory.read(address, &mut buffer));
    let handed = per_read(|| deadline::read_within_deadline(pid, address, &mut buffer, bare));
    let cpus = if pinned { "one CPU" } else { "any CPU" };
    println!(
        "reads of 64 bytes, {cpus}: bare {bare_us:.2} us; judged and made at once {judged:.2} us (x{:.2}); on the deadline reader {handed:.2} us (x{:.1})",
        judged / bare_us,
        handed / bare_us
    );
}
