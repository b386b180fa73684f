"""Kept and freed allocations for allocbpf's `--live` Python test.

Prints its pid, waits for a line on stdin, keeps KEPT `bytes(4000)` objects alive and
creates and drops CHURN others, then prints `truth SITE LINE BYTES LIVE_BLOCKS` per
site and leaves with os._exit: no interpreter shutdown frees the kept objects, so they
are still in use when the profile ends.
"""
import os
import sys
import time

from python_sites import BYTES_HEADER, site_line

KEPT = 20000
CHURN = 20000


def kept(objects):
    for i in range(KEPT):
        objects[i] = bytes(4000)  # SITE kept


def churn():
    for _ in range(CHURN):
        dropped = bytes(4000)  # SITE churn
    return dropped is None


def main():
    objects = [None] * KEPT
    print(os.getpid(), flush=True)
    sys.stdin.readline()
    kept(objects)
    churn()
    time.sleep(0.4)
    print("truth kept", site_line("kept", __file__), 4000 + BYTES_HEADER, KEPT, flush=True)
    print("truth churn", site_line("churn", __file__), 4000 + BYTES_HEADER, 0, flush=True)
    os._exit(0)


main()
