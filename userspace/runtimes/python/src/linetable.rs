//! The source line of an instruction, from a code object's line table.
//!
//! A sampled frame gives us a code object and an instruction offset; the line is
//! computed here, in the profiler, from the line table copied out of the target
//! process. Each decoder follows the matching CPython version's `PyCode_Addr2Line`
//! step by step, so that our lines are the ones a traceback in that process would
//! show. Unlike CPython, which trusts its tables (and asserts), every read here is
//! bounds-checked and every sum overflow-checked: the bytes may be torn by a
//! concurrent write, stale, or garbage, and a profiler must not crash or stall on them.
//! Every decoder is a single forward pass over the table, allocation-free.

/// The line-table formats of CPython's code objects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LineTableFormat {
    /// 3.9 and earlier: `co_lnotab`, (byte increment, signed line increment) pairs.
    Lnotab,
    /// 3.10: `co_linetable`, (byte length, signed line delta; -128 = no line) pairs.
    Linetable310,
    /// 3.11 and later: `co_linetable`, the varint location table (Objects/locations.md).
    Locations,
}

impl LineTableFormat {
    /// The format used by CPython 3.`minor`, or `None` before 3.6, whose `co_lnotab`
    /// line increments were unsigned (a format nothing we profile still runs).
    pub fn for_minor(minor: u8) -> Option<Self> {
        match minor {
            0..=5 => None,
            6..=9 => Some(Self::Lnotab),
            10 => Some(Self::Linetable310),
            _ => Some(Self::Locations),
        }
    }
}

/// The source line of the instruction at byte offset `offset` into the code object's bytecode
/// (3.9: f_lasti; 3.10: f_lasti * 2; 3.11+: (instruction pointer - start of co_code_adaptive)),
/// given the code object's `co_firstlineno` and its line table bytes. None when the table says the
/// instruction has no line, or when the table is malformed / ends before `offset` (the bytes come
/// from another process's memory: hostile input — never panic, never loop beyond table.len() steps,
/// no allocation proportional to anything but the table).
///
/// `co_lnotab` (3.9 and earlier) does not record the length of the bytecode, so, as in
/// CPython, an offset past its last entry gets the last entry's line rather than None.
/// Lines below 1 are None: CPython gives line 0 to instructions no source line owns
/// (the `RESUME` opening a module in 3.11+), and a garbage table can sum to anything.
pub fn line_of(format: LineTableFormat, table: &[u8], first_line: i32, offset: u32) -> Option<u32> {
    // i64/u64 sums: no table of addressable size can overflow them, so no wrapping and
    // no debug-build overflow panic on garbage; only the varint path needs a check.
    let first = i64::from(first_line);
    let offset = u64::from(offset);
    let line = match format {
        LineTableFormat::Lnotab => lnotab_line(table, first, offset),
        LineTableFormat::Linetable310 => linetable310_line(table, first, offset),
        LineTableFormat::Locations => locations_line(table, first, offset),
    }?;
    u32::try_from(line).ok().filter(|&line| line > 0)
}

/// 3.6–3.9 `PyCode_Addr2Line`: add up line increments until the byte increments pass
/// `offset`. Large jumps span several pairs (`(255, 0), (45, 3)`), so an increment must
/// not be applied before the address sum has been compared.
fn lnotab_line(table: &[u8], first: i64, offset: u64) -> Option<i64> {
    let mut line = first;
    let mut addr = 0u64;
    // `chunks_exact` drops an odd trailing byte, as CPython's `size / 2` does.
    for pair in table.chunks_exact(2) {
        addr += u64::from(pair[0]);
        if addr > offset {
            break;
        }
        line += i64::from(pair[1] as i8);
    }
    Some(line)
}

/// 3.10 `_PyCode_CheckLineNumber` walking forward with `PyLineTable_NextAddressRange`:
/// each pair covers `[end, end + length)`; zero-length pairs only carry line deltas
/// (jumps of more than 127 lines); -128 means "no line" and is not added to the line.
fn linetable310_line(table: &[u8], first: i64, offset: u64) -> Option<i64> {
    let mut computed = first;
    let mut end = 0u64;
    for pair in table.chunks_exact(2) {
        end += u64::from(pair[0]);
        let delta = pair[1] as i8;
        let line = (delta != -128).then(|| {
            computed += i64::from(delta);
            computed
        });
        // Every earlier range ended at or before `offset`, so this one starts there too.
        if offset < end {
            return line;
        }
    }
    None
}

/// Location-table entry kinds (`_PyCodeLocationInfoKind`) that change the line.
const ONE_LINE0: u8 = 10;
const ONE_LINE2: u8 = 12;
const NO_COLUMNS: u8 = 13;
const LONG: u8 = 14;
const NONE: u8 = 15;

/// 3.11+ `advance`: an entry is a header byte (bit 7 set; kind in bits 3–6; length in
/// code units, minus one, in bits 0–2) followed by payload bytes with bit 7 clear.
/// Only the line delta is decoded; like CPython we find the next entry by skipping to
/// the next byte with bit 7 set rather than by parsing the columns.
fn locations_line(table: &[u8], first: i64, offset: u64) -> Option<i64> {
    let mut computed = first;
    let mut end = 0u64;
    let mut pos = 0;
    while let Some(&header) = table.get(pos) {
        // Later entries are found by scanning for bit 7, so only the first byte can be
        // a non-header here; CPython asserts, we call the table malformed.
        if header & 0x80 == 0 {
            return None;
        }
        let kind = (header >> 3) & 0x0f;
        let delta = match kind {
            NO_COLUMNS | LONG => read_svarint(table, pos + 1)?,
            ONE_LINE0..=ONE_LINE2 => i64::from(kind - ONE_LINE0),
            _ => 0,
        };
        computed = computed.checked_add(delta)?;
        // Lengths count 2-byte code units; offsets are in bytes.
        end += (u64::from(header & 7) + 1) * 2;
        pos += 1;
        while table.get(pos).is_some_and(|&b| b & 0x80 == 0) {
            pos += 1;
        }
        if offset < end {
            // A no-location entry still applies its (zero) delta, so `computed` carries on.
            return (kind != NONE).then_some(computed);
        }
    }
    None
}

/// CPython's `scan_varint`: 6-bit chunks, least significant first, bit 6 = more.
/// CPython accumulates in a 32-bit unsigned int, so a sixth chunk is truncated as
/// there; a seventh would shift past it (undefined in C), which we call malformed.
/// Like CPython this may read on into the next entry's bytes: a well-formed table never
/// sets bit 6 on a varint's last chunk, and a torn one is garbage either way.
fn read_varint(table: &[u8], mut pos: usize) -> Option<u32> {
    let mut value = 0u64;
    for shift in (0..=30).step_by(6) {
        let byte = *table.get(pos)?;
        pos += 1;
        value |= u64::from(byte & 63) << shift;
        if byte & 64 == 0 {
            return Some((value & 0xffff_ffff) as u32);
        }
    }
    None
}

/// CPython's `scan_signed_varint`: magnitude in the high bits, sign in bit 0.
fn read_svarint(table: &[u8], pos: usize) -> Option<i64> {
    let value = read_varint(table, pos)?;
    let magnitude = i64::from(value >> 1);
    Some(if value & 1 != 0 {
        -magnitude
    } else {
        magnitude
    })
}

#[cfg(test)]
mod tests {
    use super::LineTableFormat::{Linetable310, Lnotab, Locations};
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn formats_by_minor_version() {
        assert_eq!(LineTableFormat::for_minor(5), None);
        assert_eq!(LineTableFormat::for_minor(6), Some(Lnotab));
        assert_eq!(LineTableFormat::for_minor(9), Some(Lnotab));
        assert_eq!(LineTableFormat::for_minor(10), Some(Linetable310));
        assert_eq!(LineTableFormat::for_minor(11), Some(Locations));
        assert_eq!(LineTableFormat::for_minor(13), Some(Locations));
    }

    /// `line_of` at each offset of `offs`.
    fn lines(f: LineTableFormat, t: &[u8], first: i32, offs: &[u32]) -> Vec<Option<u32>> {
        offs.iter().map(|&o| line_of(f, t, first, o)).collect()
    }

    #[test]
    fn lnotab_by_hand() {
        // first 10; (0,+1) before any byte; [0,6) 11; [6,10) 12; -3 at 10;
        // a 300-byte, 200-line jump spread over three pairs; trailing odd byte.
        let t = [0, 1, 6, 1, 4, 0xfd, 255, 0, 45, 127, 0, 73, 9];
        let got = lines(Lnotab, &t, 10, &[0, 4, 6, 8, 10, 264, 309, 310, 5000]);
        let want = [11, 11, 12, 12, 9, 9, 9, 209, 209].map(Some);
        assert_eq!(got, want);
        // No table: every instruction is on the first line (no code length to end at).
        assert_eq!(line_of(Lnotab, &[], 7, 0), Some(7));
        assert_eq!(line_of(Lnotab, &[9], 7, 100), Some(7));
        // Summing to line 0 or below is no line.
        assert_eq!(
            lines(Lnotab, &[2, 0xff, 2, 0x80], 1, &[0, 2, 4]),
            [Some(1), None, None]
        );
    }

    #[test]
    fn linetable310_by_hand() {
        // first 10: [0,6) 10; zero-length +2; [6,10) 13; [10,12) no line;
        // [12,16) 10 (the no-line entry did not move the line); then the table ends.
        let t = [6, 0, 0, 2, 4, 1, 2, 0x80, 4, 0xfd, 3];
        let got = lines(Linetable310, &t, 10, &[0, 5, 6, 9, 10, 11, 12, 15, 16, 99]);
        let want = [10, 10, 13, 13, 0, 0, 10, 10, 0, 0].map(|l| (l > 0).then_some(l));
        assert_eq!(got, want);
        assert_eq!(line_of(Linetable310, &[], 10, 0), None);
        assert_eq!(line_of(Linetable310, &[0, 1, 0, 1], 10, 0), None);
        assert_eq!(line_of(Linetable310, &[2, 0xfc], 3, 0), None);
    }

    /// A location-table header: bit 7, kind, length in code units.
    fn header(kind: u8, units: u8) -> u8 {
        0x80 | kind << 3 | (units - 1)
    }

    #[test]
    fn locations_by_hand() {
        let t = [
            &[header(0, 1), 0x05][..],              // [0,2) short form: line 10
            &[header(11, 2), 3, 7],                 // [2,6) one-line form, +1: 11
            &[header(NO_COLUMNS, 1), 7],            // [6,8) svarint 7 = -3: 8
            &[header(LONG, 8), 88, 9, 2, 73, 3, 5], // [8,24) svarint 600 = +300: 308
            &[header(NONE, 1)],                     // [24,26) no location, line unmoved
            &[header(10, 1), 1, 2],                 // [26,28) one-line form, +0: 308
        ]
        .concat();
        let offsets = [0, 2, 5, 6, 8, 23, 24, 25, 26, 28, 1000];
        let got = lines(Locations, &t, 10, &offsets);
        let want = [10, 11, 11, 8, 308, 308, 0, 0, 308, 0, 0].map(|l| (l > 0).then_some(l));
        assert_eq!(got, want);

        // A 3.11+ module (`x=1`): RESUME is on line 0 (long form, -1 from line 1), then 1.
        let module = [0xf0, 0x03, 0x01, 0x01, header(11, 1), 0, 1];
        assert_eq!(lines(Locations, &module, 1, &[0, 2]), [None, Some(1)]);
        // Malformed: payload byte first, truncated varint, 7-chunk varint (read on as 64
        // bits it would be 2 << 36, i.e. +0 once truncated: Some(1)), empty.
        assert_eq!(line_of(Locations, &[0x05, header(0, 1)], 1, 0), None);
        assert_eq!(line_of(Locations, &[header(LONG, 1), 0x40], 1, 0), None);
        let long_varint = [header(NO_COLUMNS, 1), 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 2];
        assert_eq!(line_of(Locations, &long_varint, 1, 0), None);
        assert_eq!(line_of(Locations, &[], 1, 0), None);
        // Garbage after the entry holding the offset is never read.
        assert_eq!(
            line_of(Locations, &[header(0, 1), 0, header(LONG, 1), 0x40], 4, 0),
            Some(4)
        );
    }

    /// A small deterministic xorshift64 generator: no crates for tests either.
    struct XorShift(u64);
    impl XorShift {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    #[test]
    fn random_tables_never_panic() {
        let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
        let start = Instant::now();
        let mut some = 0;
        for format in [Lnotab, Linetable310, Locations] {
            for i in 0..10_000 {
                let len = (rng.next() % 96) as usize;
                let table: Vec<u8> = (0..len)
                    .map(|_| {
                        let byte = rng.next() as u8;
                        // Half headers, so the location decoder gets past its first entry.
                        if format == Locations && rng.next() & 1 == 0 {
                            byte | 0x80
                        } else {
                            byte
                        }
                    })
                    .collect();
                let first = match i % 4 {
                    0 => i32::MAX,
                    1 => i32::MIN,
                    _ => (rng.next() % 2000) as i32 - 1000,
                };
                for offset in [0, (rng.next() % 512) as u32, u32::MAX] {
                    let line = line_of(format, &table, first, offset);
                    assert_ne!(line, Some(0));
                    some += usize::from(line.is_some());
                }
            }
        }
        // Not vacuous: plenty of random tables do decode to some line.
        assert!(some > 1000, "only {some} lines decoded");
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "took {:?}",
            start.elapsed()
        );
    }

    #[test]
    fn huge_tables_are_one_linear_pass() {
        let start = Instant::now();
        let size = 8 << 20;
        for (format, fill) in [
            (Lnotab, 0xff),
            (Linetable310, 0),
            (Locations, header(NONE, 8)),
        ] {
            assert!(line_of(format, &vec![fill; size], 1, u32::MAX).is_none_or(|l| l > 0));
        }
        // Long-form headers each followed by a 6-chunk varint: the worst case per byte.
        let mut t = Vec::with_capacity(size);
        while t.len() < size {
            t.extend([header(LONG, 8), 0x41, 0x41, 0x41, 0x41, 0x41, 0x01]);
        }
        assert_eq!(line_of(Locations, &t, 1, u32::MAX), None);
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "took {:?}",
            start.elapsed()
        );
    }

    /// Prints, for every code object compiled from argv[1], its line table (hex), its
    /// co_firstlineno, its bytecode length and the line CPython gives each 2-byte
    /// code unit. Runs unchanged on 3.6 to 3.13.
    const DUMP: &str = r#"
import dis, sys
v = sys.version_info
print("version", v[0], v[1])
def walk(co):
    yield co
    for c in co.co_consts:
        if isinstance(c, type(co)):
            for x in walk(c):
                yield x
for co in walk(compile(sys.argv[1], "<linetable-test>", "exec")):
    n = len(co.co_code)
    lines = [None] * (n // 2)
    if v < (3, 10):
        table = co.co_lnotab
        starts = list(dis.findlinestarts(co))
        ranges = [(s, starts[i + 1][0] if i + 1 < len(starts) else n, l)
                  for i, (s, l) in enumerate(starts)]
    else:
        table = co.co_linetable
        ranges = co.co_lines()
    for start, end, line in ranges:
        for off in range(start, min(end, n), 2):
            lines[off // 2] = line
    print("|".join([co.co_name, table.hex(), str(co.co_firstlineno), str(n),
                    ",".join("-" if l is None else str(l) for l in lines)]))
"#;

    /// Source with loops, nested functions, multi-line expressions, try/except, lambdas,
    /// a 300-line gap and a very wide line (long forms and multi-pair entries).
    fn ground_truth_source() -> String {
        let base = r#"import os
def outer(values, scale=2):
    total = 0
    for i, v in enumerate(values):
        if v % 2 == 0:
            total += (v *
                      scale +
                      i)
        else:
            while v > 0:
                v -= 1
    def inner(x):
        try:
            return 10 // x
        except ZeroDivisionError as e:
            print(e)
            return None
        finally:
            total = 0
    key = lambda item: (item[1],
                        -item[0])
    pairs = sorted([(inner(v), v) for v in values if v],
                   key=key)
    return total, pairs
class Holder:
    def method(self, a,
               b):
        with open(a) as f:
            result = {k: f.read(b + k)
                      for k in range(3)}
        return result
async def coro(xs):
    async for x in xs:
        await x
def gen(n):
    yield from range(n)
try:
    outer([1, 2, 3])
except (ValueError,
        TypeError):
    pass
def far_apart(a):
    x = a
"#;
        let gap = "\n".repeat(300);
        let wide: Vec<String> = (0..150).map(|i| format!("a + {i}")).collect();
        format!(
            "{base}{gap}    y = [{}]\n    return f(x,\n             y)\n",
            wide.join(", ")
        )
    }

    /// Interpreters to check: the system 3.11, plus every pyenv 3.x if pyenv is there.
    fn interpreters() -> Vec<std::path::PathBuf> {
        // The brief's list is 3.9.18 to 3.13.0; any pyenv 3.x (3.6 to 3.8 here too) is welcome.
        let mut found = vec![std::path::PathBuf::from("/usr/bin/python3.11")];
        if let Ok(dir) = std::fs::read_dir("/root/.pyenv/versions") {
            for entry in dir.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                let mut parts = name.split('.');
                if let (Some("3"), Some(minor)) = (parts.next(), parts.next()) {
                    found.push(entry.path().join(format!("bin/python3.{minor}")));
                }
            }
        }
        found.retain(|p| p.is_file());
        found.sort();
        found
    }

    fn unhex(hex: &str) -> Vec<u8> {
        (0..hex.len() / 2)
            .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn agrees_with_real_interpreters() {
        let source = ground_truth_source();
        let found = interpreters();
        assert!(
            !found.is_empty(),
            "no interpreter found (/usr/bin/python3.11 should exist)"
        );
        for python in found {
            let name = python.display();
            let out = std::process::Command::new(&python)
                .args(["-I", "-c", DUMP, &source])
                .output()
                .unwrap();
            let stdout = String::from_utf8(out.stdout).unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{name}: {stderr}");
            let mut rows = stdout.lines();
            let minor = rows.next().and_then(|l| l.split(' ').nth(2)).unwrap();
            let format = LineTableFormat::for_minor(minor.parse().unwrap()).unwrap();
            let (mut codes, mut offsets, mut none) = (0, 0, 0);
            for row in rows {
                let f: Vec<&str> = row.split('|').collect();
                let (table, first): (Vec<u8>, i32) = (unhex(f[1]), f[2].parse().unwrap());
                for (unit, want) in f[4].split(',').filter(|s| !s.is_empty()).enumerate() {
                    // Python's line 0 (module RESUME) and None are both "no line" to us.
                    let want = want.parse::<u32>().ok().filter(|&l| l > 0);
                    let offset = 2 * unit as u32;
                    let got = line_of(format, &table, first, offset);
                    assert_eq!(got, want, "{name} {}: offset {offset}: {}", f[0], f[1]);
                    none += usize::from(want.is_none());
                    offsets += 1;
                }
                // 3.10+ tables cover the bytecode exactly; lnotab has no end.
                if format != Lnotab {
                    assert_eq!(
                        line_of(format, &table, first, f[3].parse().unwrap()),
                        None,
                        "{row}"
                    );
                }
                codes += 1;
            }
            eprintln!(
                "{name}: {format:?}: {codes} code objects, {offsets} offsets, {none} lineless"
            );
            assert!(codes >= 8 && offsets > 500);
        }
    }
}
