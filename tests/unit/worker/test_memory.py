"""worker.memory: why the worker collects garbage cycles on a timer, and that doing so frees them."""

from __future__ import annotations

import gc
import weakref

import pytest
from aiokafka.consumer.fetcher import PartitionRecords
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.structs import TopicPartition

from worker.memory import collect_cycles, freeze_startup_objects, release_free_heap


@pytest.fixture
def no_automatic_gc():
    """Only the collections the test makes itself run, as in a worker between full collections."""
    enabled = gc.isenabled()
    gc.disable()
    yield
    if enabled:
        gc.enable()


def fetched_partition(records: int, value_bytes: int) -> PartitionRecords:
    """What aiokafka's fetcher builds from one partition's part of a fetch response."""
    builder = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=0, producer_id=-1,
                                        producer_epoch=-1, base_sequence=-1, batch_size=1 << 30)
    for offset in range(records):
        builder.append(offset, timestamp=None, key=None, value=b"x" * value_bytes, headers=[])
    return PartitionRecords(TopicPartition("t", 0), MemoryRecords(bytes(builder.build())), None, 0,
                            None, None, True, 0)


def test_dropped_fetch_buffer_lives_until_a_full_collection(no_automatic_gc):
    part = fetched_partition(records=4, value_bytes=64 << 10)
    first = next(part)
    assert first.offset == 0 and len(first.value) == 64 << 10
    alive = weakref.ref(part)
    del part, first  # dropped part-way, as on a pause, a seek or a revoke
    # The premise of worker/memory.py: the records and their iterator form a cycle, so reference
    # counting alone does not free them (nor the fetch response they hold).
    assert alive() is not None
    # gc.collect()'s return value does not always count this cycle's objects (seen: 0 found while the
    # cycle was freed), so the count is checked on a plain cycle of our own.
    loop: list = []
    loop.append(loop)
    del loop
    found, seconds = collect_cycles()
    assert alive() is None
    assert found >= 1 and seconds >= 0


def test_fully_read_fetch_buffer_needs_no_collection(no_automatic_gc):
    part = fetched_partition(records=3, value_bytes=16)
    assert [r.offset for r in part] == [0, 1, 2]
    alive = weakref.ref(part)
    del part
    assert alive() is None


def test_frozen_objects_are_kept_out_of_collections(no_automatic_gc):
    try:
        frozen = freeze_startup_objects()
        # Frozen objects that die leave the frozen set (another thread of the test process may drop some
        # between the two counts: 2 of 535601 did once), so the count can only have shrunk since.
        assert frozen > 0 and frozen - 1000 < gc.get_freeze_count() <= frozen
        # Garbage made after the freeze is still found.
        node = _Node()
        node.me = node
        alive = weakref.ref(node)
        del node
        assert alive() is not None
        found, _ = collect_cycles()
        assert found > 0 and alive() is None
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


class _Node:
    me: _Node | None = None


def _rss_kb() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


@pytest.mark.skipif(release_free_heap() is None, reason="the C library has no malloc_trim (not glibc)")
def test_release_free_heap_hands_freed_blocks_in_the_middle_of_the_heap_back():
    # 64 KiB blocks come from the heap (below glibc's mmap threshold); a block allocated after them keeps the
    # freed space in the middle of the heap, where free() alone never returns it to the system.
    blocks = [bytearray(64 << 10) for _ in range(2048)]  # 128 MiB, every page written (bytearray zero-fills)
    pin = bytearray(64 << 10)
    del blocks
    held = _rss_kb()
    assert release_free_heap() is True
    released = held - _rss_kb()
    assert released > 96 << 10, f"only {released} kB of the 131072 kB freed went back to the system"
    assert len(pin) == 64 << 10
