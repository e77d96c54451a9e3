"""Offsets are released only as a contiguous done prefix, with their outputs."""

from __future__ import annotations

import pytest

from worker.offsets import OutRecord, PartitionTracker


def rec(n: int) -> OutRecord:
    return OutRecord("results", str(n).encode(), b"v%d" % n)


def test_out_of_order_completion_waits_for_the_prefix():
    t = PartitionTracker("in", 0)
    for off in (10, 11, 12):
        t.register(off)
    t.complete(12, [rec(12)])
    assert t.release() is None
    t.complete(10, [rec(10)])
    r = t.release()
    assert (r.commit_offset, [x.key for x in r.records], r.offsets) == (11, [b"10"], [10])
    t.mark_committed(r)
    t.complete(11, [rec(11)])
    r = t.release()
    # Outputs in the order they were completed: 12 before 11.
    assert (r.commit_offset, [x.key for x in r.records], r.offsets) == (13, [b"12", b"11"], [11, 12])
    assert t.in_flight == 0 and t.release() is None


def test_a_chunk_that_waited_for_its_predecessor_is_published_after_it():
    """An ASR chunk fetched before its predecessor (seq 1 at offset 5, seq 0 at 6) completes after it: the
    release lists seq 0's result first, so the stream's results reach the topic in seq order."""
    t = PartitionTracker("in", 0)
    t.register(5)
    t.register(6)
    t.complete(6, [rec(0)])
    assert t.release() is None
    t.complete(5, [rec(1)])
    r = t.release()
    assert ([x.key for x in r.records], r.offsets, r.commit_offset) == ([b"0", b"1"], [5, 6], 7)
    # A failed publish puts them back in the same order, ahead of anything completed since.
    t.register(7)
    t.complete(7, [rec(2)])
    t.restore(r)
    assert [x.key for x in t.release().records] == [b"0", b"1", b"2"]


def test_restore_after_failed_publish_retries_the_same_records():
    t = PartitionTracker("in", 0)
    for off in (0, 1):
        t.register(off)
        t.complete(off, [rec(off)])
    r = t.release()
    t.restore(r)
    again = t.release()
    assert again.commit_offset == 2 and [x.key for x in again.records] == [b"0", b"1"]
    assert again.offsets == [0, 1]


def test_misuse_is_loud():
    t = PartitionTracker("in", 3)
    t.register(5)
    with pytest.raises(ValueError):
        t.register(4)
    with pytest.raises(KeyError):
        t.complete(6, [])
    t.complete(5, [])
    with pytest.raises(ValueError):
        t.complete(5, [])


def test_unfinished_offsets_and_in_flight():
    t = PartitionTracker("in", 0)
    for off in range(5):
        t.register(off)
    t.complete(0, [])
    t.complete(3, [])
    t.release()
    assert t.unfinished_offsets() == [1, 2, 4]
    assert t.in_flight == 4


def test_many_releases_keep_order_compact():
    t = PartitionTracker("in", 0)
    for off in range(3000):
        t.register(off)
        t.complete(off, [rec(off)])
        r = t.release()
        assert r.commit_offset == off + 1
        t.mark_committed(r)
    assert t.in_flight == 0


def test_a_second_release_waits_until_the_first_is_committed_or_restored():
    """Two flushes of one partition (the flush loop and a rebalance's) must not both hold a release:
    restoring the first would rewind over the second's offsets, and committing the second would
    then skip the first's outputs."""
    t = PartitionTracker("in", 0)
    for off in (0, 1):
        t.register(off)
    t.complete(0, [rec(0)])
    first = t.release()
    assert t.publishing
    t.complete(1, [rec(1)])
    assert t.release() is None  # the first is still being published
    t.restore(first)  # its transaction failed
    again = t.release()
    assert again.offsets == [0, 1] and [x.key for x in again.records] == [b"0", b"1"] and again.commit_offset == 2
    with pytest.raises(ValueError):
        t.mark_committed(first)  # settled already
    t.mark_committed(again)
    assert not t.publishing and t.in_flight == 0 and t.committed == 2


def test_a_failed_publish_of_the_release_that_compacts_retries_the_same_records():
    t = PartitionTracker("in", 0)
    for off in range(1023):
        t.register(off)
        t.complete(off, [rec(off)])
        t.mark_committed(t.release())
    for off in (1023, 1024):  # this release takes the list past the length at which it is compacted
        t.register(off)
        t.complete(off, [rec(off)])
    r = t.release()
    t.restore(r)
    again = t.release()
    assert again.offsets == [1023, 1024] and again.commit_offset == 1025
    assert [x.key for x in again.records] == [b"1023", b"1024"]


def test_awaits_tells_which_results_are_still_wanted():
    t = PartitionTracker("in", 0, start_offset=5)
    t.register(5)
    assert t.awaits(5) and not t.awaits(4) and not t.awaits(6)
    t.complete(5, [])
    assert not t.awaits(5)


def test_next_offset_starts_at_the_committed_offset_and_follows_registrations():
    t = PartitionTracker("in", 0, start_offset=40)
    assert t.next_offset == 40  # a record below it was committed by the previous owner: skipped
    t.register(40)
    t.register(43)  # a gap (a transaction marker, say) is allowed
    assert t.next_offset == 44
    assert PartitionTracker("in", 1).next_offset == 0  # nothing committed yet
