"""Kept and freed allocations for allocbpf's `--live` Python test.

Prints its pid, waits for a line on stdin, keeps KEPT `bytes(4000)` objects alive and
creates and drops CHURN others, then does the same with small objects (ints and
25-item tuples, which a link-time optimised interpreter allocates where it inlined
`PyObject_Malloc`, and frees tuples where it inlined `PyObject_Free`), then prints
`truth SITE LINE BYTES LIVE_BLOCKS` per site and leaves with os._exit: no interpreter
shutdown frees the kept objects, so they are still in use when the profile ends.
"""
import os
import sys
import time

from python_sites import BIG, BIG_INT_BYTES, BYTES_HEADER, site_line

KEPT = 20000
CHURN = 20000
SMALL = 200000
TUPLES = 50000
TUPLE_ITEMS = 25
# A tuple's block: the GC header (16 bytes), the object header with its size (24) and
# one pointer per item.
TUPLE_BYTES = 16 + 24 + 8 * TUPLE_ITEMS


def kept(objects):
    for i in range(KEPT):
        objects[i] = bytes(4000)  # SITE kept


def churn():
    for _ in range(CHURN):
        dropped = bytes(4000)  # SITE churn
    return dropped is None


def kept_ints(ints):
    for i in range(SMALL):
        ints[i] = BIG + i  # SITE kept_ints


def churn_ints():
    for i in range(SMALL):
        dropped = BIG + i  # SITE churn_ints
    return dropped is None


def kept_tuples(tuples, items):
    for i in range(TUPLES):
        tuples[i] = tuple(items)  # SITE kept_tuples


def churn_tuples(items):
    for _ in range(TUPLES):
        dropped = tuple(items)  # SITE churn_tuples
    return dropped is None


def kept_mixed(ints):
    # Kept and dropped ints of one size class (40 and 36 bytes: 48-byte blocks),
    # interleaved: each kept int takes the block the previous dropped one freed, so a
    # block predicted wrongly moves bytes from one site to the other.
    for i in range(SMALL):
        ints[i] = BIG + i  # SITE kept_mixed
        churn_mixed(i)


def churn_mixed(i):
    dropped = BIG - i  # SITE churn_mixed
    return dropped is None


def main():
    objects = [None] * KEPT
    ints = [None] * SMALL
    mixed_ints = [None] * SMALL
    tuples = [None] * TUPLES
    items = list(range(TUPLE_ITEMS))
    print(os.getpid(), flush=True)
    sys.stdin.readline()
    kept(objects)
    churn()
    kept_ints(ints)
    churn_ints()
    kept_tuples(tuples, items)
    churn_tuples(items)
    kept_mixed(mixed_ints)
    time.sleep(0.4)
    for name, size, live in [
        ("kept", 4000 + BYTES_HEADER, KEPT),
        ("churn", 4000 + BYTES_HEADER, 0),
        ("kept_ints", BIG_INT_BYTES, SMALL),
        ("churn_ints", BIG_INT_BYTES, 0),
        ("kept_tuples", TUPLE_BYTES, TUPLES),
        ("churn_tuples", TUPLE_BYTES, 0),
        ("kept_mixed", BIG_INT_BYTES, SMALL),
        # BIG - i: three digits.
        ("churn_mixed", BIG_INT_BYTES - 4, 0),
    ]:
        print("truth", name, site_line(name, __file__), size, live, flush=True)
    os._exit(0)


main()
