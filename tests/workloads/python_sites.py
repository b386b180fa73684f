"""Allocation sites of known sizes for allocbpf's Python tests.

Prints its pid, waits for a line on stdin, runs `rounds` rounds, then prints one
`truth SITE LINE BYTES CALLS` line per site: BYTES is what each call requests of the
allocator (a `bytes` object of N bytes is one PyObject_Calloc of N + 33 bytes: the
object header and the terminating NUL), LINE the line of the site in this file.
Objects up to 512 bytes come from pymalloc, larger ones from malloc through it.
"""
import os
import sys

BYTES_HEADER = 33
PER_ROUND = 100


def site_line(marker, path=__file__):
    """The line of `path` that ends with the comment `# SITE marker`."""
    with open(path) as source:
        for number, text in enumerate(source, 1):
            if text.rstrip().endswith("# SITE " + marker):
                return number
    raise LookupError(marker)


def small_bytes(out):
    for i in range(PER_ROUND):
        out[i] = bytes(100)  # SITE small_bytes


def large_bytes(out):
    for i in range(PER_ROUND):
        out[i] = bytes(4000)  # SITE large_bytes


def small_dicts(out):
    for i in range(PER_ROUND):
        out[i] = {"key": i}  # SITE small_dicts


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    out = [None] * PER_ROUND
    print(os.getpid(), flush=True)
    sys.stdin.readline()
    for _ in range(rounds):
        small_bytes(out)
        large_bytes(out)
        small_dicts(out)
    calls = rounds * PER_ROUND
    for name, size in [("small_bytes", 100), ("large_bytes", 4000)]:
        print("truth", name, site_line(name), size + BYTES_HEADER, calls, flush=True)
    print("truth small_dicts", site_line("small_dicts"), 0, calls, flush=True)


if __name__ == "__main__":
    main()
