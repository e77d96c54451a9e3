"""Keeping the worker's memory flat: garbage cycles are collected on a timer.

Why: aiokafka's consumer keeps each fetched partition's records in a
`PartitionRecords` object whose record iterator (a generator) refers back to
it, a reference cycle. When the records are dropped before the iterator ends
(a pause for backpressure, a seek, a revoked partition), only the cyclic
garbage collector can free them, and with aiokafka's C record parser each one
holds the whole fetch response for that partition (up to
`max_partition_fetch_bytes`, 2 MiB by default here). Python runs a full
collection only when the objects promoted since the last one reach a quarter
of all long-lived objects; a worker has about 400,000 of those (torch, the
tokenizer, the model's modules), so full collections came minutes apart and
the pinned responses showed up as RSS that rose with every round of
`bench.chaos`' 30,000-record fuzz run (see docs/reliability.md).

What: after start-up the live objects move to the permanent generation
(`gc.freeze`), so a full collection only walks what was created since, about
a millisecond instead of about 170 ms, and the housekeeping loop runs one every
few seconds. `infinilm_gc_pause_seconds` shows what it costs.

Freed memory, too: glibc's malloc keeps what Python frees in its heap for reuse
and hands it back to the system only from the heap's top. Fetch responses and
oversized records are megabytes each, and once the first such block has been
freed glibc raises its mmap threshold, so later ones come from the heap as well.
Bursts of them then leave RSS at the burst's high-water mark, tens of MiB above
what is live (measured by tests/fault/test_fuzz.py, whose bound is 5% after the
warm-up). After each collection the same loop asks glibc to return free heap
pages (`malloc_trim`); elsewhere (musl, macOS) that step is skipped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time
from functools import cache


def freeze_startup_objects() -> int:
    """Collect once, then exempt every object alive now from later collections; returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> bool | None:
    """Return the malloc heap's free pages to the system: True if some were released, False if none were,
    None where the C library cannot (not glibc)."""
    trim = _malloc_trim()
    return None if trim is None else bool(trim(0))


def collect_cycles() -> tuple[int, float]:
    """One full collection, then free heap pages back to the system: (unreachable objects found, seconds both
    took)."""
    started = time.perf_counter()
    found = gc.collect()
    release_free_heap()
    return found, time.perf_counter() - started
