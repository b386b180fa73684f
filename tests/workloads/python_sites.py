"""Allocation sites of known sizes for allocbpf's Python tests.

Each site allocates `calls` objects of one kind per round and prints its truth line
once, before the workload waits for "go" on stdin; the test compares allocbpf's
Python frames (function and line) with these sites.
"""
import os
import sys


def small_bytes(n):
    return [bytes(100) for _ in range(n)]  # SITE small_bytes


def large_bytes(n):
    return [bytes(4000) for _ in range(n)]  # SITE large_bytes


def small_dicts(n):
    return [{"key": i} for i in range(n)]  # SITE small_dicts


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    print(os.getpid(), flush=True)
    sys.stdin.readline()
    for _ in range(rounds):
        small_bytes(100)
        large_bytes(100)
        small_dicts(100)
    print("done", flush=True)


main()
