"""Allocation sites of known sizes for allocbpf's Python tests.

Prints its pid, waits for a line on stdin, runs `rounds` rounds (in as many threads
as its second argument says, if any, each running them all), then prints one
`truth SITE LINE BYTES CALLS` line per site: BYTES is what each call requests of the
allocator (a `bytes` object of N bytes is one PyObject_Calloc of N + 33 bytes: the
object header and the terminating NUL), LINE the line of the site in this file.
Objects up to 512 bytes come from pymalloc, larger ones from malloc through it.
"""
import os
import sys

BYTES_HEADER = 33
PER_ROUND = 100
C_MALLOC_BYTES = 3000
# An int of 67 bits: BIG + i is a new int object each time (no free list keeps ints),
# allocated for 4 digits (the sum may carry): a 24-byte header and 4 x 4 bytes.
BIG = 10**20
BIG_INT_BYTES = 24 + 4 * 4


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


def big_ints(out):
    for i in range(PER_ROUND):
        out[i] = BIG + i  # SITE big_ints


def small_dicts(out):
    for i in range(PER_ROUND):
        out[i] = {"key": i}  # SITE small_dicts


def c_malloc(out, malloc, free):
    # ctypes releases the GIL around the call: malloc runs in a thread that does not
    # hold it, and its sample must still carry this line.
    for i in range(PER_ROUND):
        free(malloc(C_MALLOC_BYTES))  # SITE c_malloc


def run_rounds(rounds, c_calls):
    """`rounds` rounds of every site; with `c_calls`, of the ctypes site too."""
    out = [None] * PER_ROUND
    for _ in range(rounds):
        small_bytes(out)
        large_bytes(out)
        big_ints(out)
        small_dicts(out)
        if c_calls:
            c_malloc(out, *c_calls)


def libc_calls():
    """libc's malloc and free through ctypes (which drops the GIL around each call)."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc.malloc, libc.free


def main():
    """`python_sites.py ROUNDS [THREADS]`: with THREADS, that many threads run the
    rounds at once, the ctypes site included."""
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    print(os.getpid(), flush=True)
    sys.stdin.readline()
    if threads:
        import threading

        calls = libc_calls()
        workers = [
            threading.Thread(target=run_rounds, args=(rounds, calls))
            for _ in range(threads)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    else:
        run_rounds(rounds, None)
    calls = rounds * PER_ROUND * max(threads, 1)
    for name, size in [("small_bytes", 100), ("large_bytes", 4000)]:
        print("truth", name, site_line(name), size + BYTES_HEADER, calls, flush=True)
    print("truth big_ints", site_line("big_ints"), BIG_INT_BYTES, calls, flush=True)
    print("truth small_dicts", site_line("small_dicts"), 0, calls, flush=True)
    if threads:
        print("truth c_malloc", site_line("c_malloc"), C_MALLOC_BYTES, calls, flush=True)


if __name__ == "__main__":
    main()
