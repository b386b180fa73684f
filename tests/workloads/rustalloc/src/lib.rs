//! Known allocation sites through the global allocator, for allocbpf's tests. The
//! binaries pick the allocator; the protocol is `workloads/sites.c`'s: print the pid,
//! wait for a line on stdin, run every site, print "done", exit.
//!
//! Truth (tests/tests/allocators.rs): 60,000 calls, 107,520,000 bytes.

use std::{
    alloc::{alloc, alloc_zeroed, dealloc, realloc, Layout},
    hint::black_box,
    io::{BufRead, Write},
};

/// 20,000 x alloc(1024, align 1).
#[inline(never)]
pub fn site_alloc() {
    let layout = Layout::from_size_align(1024, 1).unwrap();
    for _ in 0..20_000 {
        // SAFETY: non-zero size; freed with the same layout.
        unsafe { dealloc(black_box(alloc(layout)), layout) };
    }
}

/// 10,000 x alloc_zeroed(4096, align 1).
#[inline(never)]
pub fn site_zeroed() {
    let layout = Layout::from_size_align(4096, 1).unwrap();
    for _ in 0..10_000 {
        // SAFETY: as above.
        unsafe { dealloc(black_box(alloc_zeroed(layout)), layout) };
    }
}

/// 10,000 x alloc(2048, align 64): the allocators' aligned paths.
#[inline(never)]
pub fn site_aligned() {
    let layout = Layout::from_size_align(2048, 64).unwrap();
    for _ in 0..10_000 {
        // SAFETY: as above.
        unsafe { dealloc(black_box(alloc(layout)), layout) };
    }
}

/// 10,000 x alloc(512) then realloc to 2048.
#[inline(never)]
pub fn site_grow() {
    let small = Layout::from_size_align(512, 8).unwrap();
    let large = Layout::from_size_align(2048, 8).unwrap();
    for _ in 0..10_000 {
        // SAFETY: as above; realloc keeps the alignment and returns a 2048-byte block.
        unsafe {
            let p = black_box(alloc(small));
            let q = black_box(realloc(p, small, 2048));
            dealloc(q, large);
        }
    }
}

#[inline(never)]
pub fn run_sites() {
    site_alloc();
    site_zeroed();
    site_aligned();
    site_grow();
}

/// The test protocol around [`run_sites`].
pub fn main_protocol() {
    // Everything std allocates for itself (stdin's and stdout's buffers, the line)
    // is allocated before the pid is printed, so the profiled window holds the sites
    // alone.
    let mut input = std::io::stdin().lock();
    let mut line = String::with_capacity(64);
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", std::process::id()).unwrap();
    out.flush().unwrap();
    input.read_line(&mut line).unwrap();
    run_sites();
    writeln!(out, "done").unwrap();
    out.flush().unwrap();
}
