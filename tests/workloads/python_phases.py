"""A Python program with a heap that rises, peaks and falls, for the HTML report's
timeline: prints its pid, waits for a line on stdin, then
- grow_cache: holds BLOCKS bytearrays of BLOCK bytes, one every few milliseconds;
- drop_cache: lets them all go at once (the peak is just before);
- churn: allocates and frees small buffers for a while;
then prints `truth held BYTES` (what grow_cache held at the peak) and exits.
"""
import os
import sys
import time

BLOCK = 256 * 1024
BLOCKS = 200


def grow_cache(cache):
    for _ in range(BLOCKS):
        cache.append(bytearray(BLOCK))
        time.sleep(0.004)


def drop_cache(cache):
    cache.clear()


def churn(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        buffer = bytearray(4096)
        del buffer
        time.sleep(0.0002)


def main():
    print(os.getpid(), flush=True)
    sys.stdin.readline()
    time.sleep(0.3)
    cache = []
    grow_cache(cache)
    time.sleep(0.3)
    drop_cache(cache)
    churn(1.0)
    # bytearray(n) asks the allocator for n + 1 bytes (its trailing NUL).
    print(f"truth held {BLOCKS * (BLOCK + 1)}", flush=True)


main()
