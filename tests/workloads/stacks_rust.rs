//! Rust allocations through the system allocator (std's default on Linux: malloc),
//! built with -O and without frame pointers: main -> alloc_chain::outer ->
//! alloc_chain::inner -> alloc::... -> malloc. Protocol as sites.c.
use std::hint::black_box;
use std::io::{Read, Write};

mod alloc_chain {
    use std::hint::black_box;

    #[inline(never)]
    pub fn inner(len: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(black_box(len));
        v.push(1u8);
        v
    }

    #[inline(never)]
    pub fn outer(rounds: usize) -> usize {
        let mut total = 0;
        for _ in 0..rounds {
            let v = inner(4096);
            total += black_box(v).capacity();
        }
        total
    }
}

fn main() {
    println!("{}", std::process::id());
    std::io::stdout().flush().unwrap();
    let mut buf = [0u8; 16];
    if std::io::stdin().read(&mut buf).unwrap_or(0) == 0 {
        std::process::exit(1);
    }
    black_box(alloc_chain::outer(20000));
}
