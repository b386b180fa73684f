//! What the bench binaries (`src/bin/`: soak, burst, agent_cost) share.

use std::{fmt::Write as _, path::Path};

use anyhow::{Context, Result};

/// Writes `dir/big.c`: `functions` small functions that each malloc and free, a file
/// whose compile keeps cc1 allocating (gcc -O2 of 3,000 takes ~1.8 s here).
pub fn write_malloc_heavy_source(dir: &Path, functions: usize) -> Result<()> {
    let mut source = String::from("#include <stdlib.h>\n");
    for i in 0..functions {
        let _ = writeln!(
            source,
            "int f{i}(int x) {{ int *p = malloc(sizeof(int) * {}); p[0] = x; int r = p[0] * {i}; free(p); return r; }}",
            i + 1
        );
    }
    std::fs::write(dir.join("big.c"), source).context("writing big.c")
}

/// The `--rounds N` argument of a bench binary, `default` without it.
pub fn rounds_arg(default: usize) -> Result<usize> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == "--rounds")
        .and_then(|i| args.get(i + 1))
        .map_or(Ok(default), |r| r.parse())
        .context("--rounds")
}

/// The median of `values` (the upper one of an even count).
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}
