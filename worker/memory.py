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
"""

from __future__ import annotations

import gc
import time


def freeze_startup_objects() -> int:
    """Collect once, then exempt every object alive now from later collections; returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def collect_cycles() -> tuple[int, float]:
    """One full collection: (unreachable objects found, seconds it took)."""
    started = time.perf_counter()
    found = gc.collect()
    return found, time.perf_counter() - started
