"""The micro-batchers, driven with an injected clock so every time is exact."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.batcher import Batch, BatchItem, DynamicBucketBatcher, FifoBatcher, make_batcher

SEQ = 4096


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def item(key: str, prompt: int, max_tokens: int = 32, at: float = 0.0) -> BatchItem:
    return BatchItem(key, prompt, max_tokens, payload=None, arrival=at)


def dyn(**kw) -> DynamicBucketBatcher:
    opts = dict(max_seq_len=SEQ, max_batch_size=4, batch_timeout_s=1.0, clock=Clock())
    return DynamicBucketBatcher(**{**opts, **kw})


def keys(batches: list[Batch]) -> list[list[str]]:
    return [[i.key for i in b.items] for b in batches]


# ---- buckets and assignment --------------------------------------------------
def test_bucket_sizes_halve_from_max_seq_len():
    assert dyn().bucket_sizes == (4096, 2048, 1024, 512, 256)
    assert dyn(max_seq_len=1000, num_buckets=3).bucket_sizes == (1000, 500, 250)
    with pytest.raises(ValueError):
        dyn(max_seq_len=8, num_buckets=5)


def test_short_request_goes_to_a_small_bucket_and_long_one_to_bucket_0():
    b = dyn()
    assert b.assign(40, 32) == 4
    assert b.assign(3500, 64) == 0
    # Too long for bucket 1 even though its centre might be nearer: capacity wins.
    assert b.assign(2040, 16) == 0
    # Out-of-range features are clamped rather than crashing the worker.
    assert b.assign(10**9, 10**9) == 0
    assert b.assign(-5, 0) == 4
    assert b.add(item("a", 40, at=0.0)) == []
    assert b.pending(4) == 1


def test_a_longer_generation_budget_needs_a_bigger_bucket():
    b = dyn()
    assert b.assign(100, 16) > b.assign(100, 800)


# ---- flush rules -----------------------------------------------------------------
def test_flushes_when_full():
    b = dyn(adaptive=False)
    for k in "abc":
        assert b.add(item(k, 40)) == []
    [batch] = b.add(item("d", 40))
    assert (batch.bucket, batch.reason, [i.key for i in batch.items]) == (4, "full", list("abcd"))
    assert len(b) == 0 and b.next_deadline() is None


def test_flushes_at_batch_timeout_and_not_before():
    clock = Clock()
    b = dyn(adaptive=False, clock=clock)
    b.add(item("a", 40, at=0.0))
    b.add(item("b", 40, at=0.25))
    assert b.next_deadline() == 1.0
    assert b.poll(0.999) == []
    clock.t = 1.0
    [batch] = b.poll()
    assert batch.reason == "timeout" and keys([batch]) == [["a", "b"]]


def test_each_bucket_times_out_on_its_own_oldest_item():
    b = dyn(adaptive=False)
    b.add(item("long", 3000, at=0.0))
    b.add(item("short", 40, at=0.5))
    assert b.next_deadline() == 1.0
    assert keys(b.poll(1.0)) == [["long"]]
    assert b.next_deadline() == 1.5
    assert keys(b.poll(1.5)) == [["short"]]


def test_adaptive_cut_fires_when_arrivals_are_too_slow_to_fill():
    b = dyn(max_batch_size=8)
    b.add(item("a", 40, at=0.0))
    # One item and no history: nothing to predict from, so wait the full window.
    assert b.next_deadline() == 1.0
    b.add(item("b", 40, at=0.4))
    # 6 more at one per 0.4 s take 2.4 s; only 0.6 s of the window is left.
    assert b.qps(4, now=0.4) == pytest.approx(2.5)
    assert b.next_deadline() <= 0.4
    [batch] = b.poll(0.4)
    assert batch.reason == "adaptive" and keys([batch]) == [["a", "b"]]


def test_adaptive_cut_does_not_fire_under_a_high_arrival_rate():
    b = dyn(max_batch_size=8)
    out = []
    for n in range(8):
        t = n * 0.01
        assert b.poll(t) == []
        out += b.add(item(str(n), 40, at=t))
        if len(b):
            assert b.next_deadline() > t + 0.01
    assert [(x.reason, len(x.items)) for x in out] == [("full", 8)]


def test_adaptive_cut_after_arrivals_stop():
    b = dyn(max_batch_size=8)
    for n in range(3):
        b.add(item(str(n), 40, at=n * 0.01))
    cut = b.next_deadline()
    # The silence since the last arrival stretches the predicted gap until
    # 5 more can't arrive in time; that happens well before the timeout.
    assert 0.03 < cut < 1.0
    assert b.poll(cut - 1e-9) == []
    assert [x.reason for x in b.poll(cut)] == ["adaptive"]


def test_an_empty_bucket_borrows_the_overall_rate():
    b = dyn(max_batch_size=4)
    b.add(item("s0", 40, at=0.0))
    b.add(item("s1", 40, at=0.5))
    assert [(x.bucket, x.reason) for x in b.poll(0.5)] == [(4, "adaptive")]
    b.add(item("long", 3000, at=0.6))  # bucket 0's first item, so no rate of its own
    # 3 more at the overall rate (a gap of 0.42 s) can't arrive within the 1 s window.
    assert [(x.bucket, x.reason) for x in b.poll(0.6)] == [(0, "adaptive")]


# ---- K-means ----------------------------------------------------------------------
def test_centres_move_toward_observed_traffic():
    b = dyn(max_batch_size=1000)
    bucket = b.assign(300, 100)
    before = b.centres[bucket]
    for n in range(200):
        b.add(item(str(n), 300, 100, at=n))
    after = b.centres[bucket]
    assert abs(after[0] - 300) < abs(before[0] - 300) and abs(after[1] - 100) < abs(before[1] - 100)
    assert after == pytest.approx((300, 100), rel=0.02)
    # Other centres saw nothing and stay put.
    assert b.centres[0] == dyn().centres[0]


def test_centres_keep_adapting_after_a_shift():
    b = dyn(max_batch_size=10_000, min_lr=0.05)
    for n in range(1000):
        b.add(item(str(n), 300, 64, at=n))
    bucket = b.assign(200, 64)
    assert bucket == b.assign(300, 64)
    for n in range(100):
        b.add(item(f"x{n}", 200, 64, at=1000 + n))
    # The learning rate bottoms out at min_lr rather than 1/1100, so 100 new
    # items pull the centre nearly all the way (a plain running mean would sit near 291).
    assert b.centres[bucket][0] == pytest.approx(200, rel=0.02)


def test_frozen_centres_do_not_move():
    b = dyn(learn_centres=False)
    before = b.centres
    for n in range(50):
        b.add(item(str(n), 300, 100, at=n))
    assert b.centres == before


# ---- deadlines, drain, FIFO -------------------------------------------------------
def test_next_deadline_is_the_earliest_bucket_and_poll_honours_it():
    b = dyn(max_batch_size=8, adaptive=False)
    assert b.next_deadline() is None
    b.add(item("a", 3000, at=0.2))
    b.add(item("b", 40, at=0.3))
    assert b.next_deadline() == 1.2
    assert keys(b.poll(b.next_deadline())) == [["a"]]
    assert b.next_deadline() == 1.3


def test_next_deadline_includes_the_adaptive_cut():
    b = dyn(max_batch_size=8)
    b.add(item("a", 3000, at=0.2))
    b.add(item("b", 40, at=0.3))
    # Both buckets borrow the overall gap of 0.1 s, and the silence after 0.3
    # stretches it: bucket 0's cut solves 7 * (0.8 * 0.1 + 0.2 * (t - 0.3)) = 1.2 - t.
    cut = b.next_deadline()
    assert cut == pytest.approx((1.2 - 7 * 0.8 * 0.1 + 7 * 0.2 * 0.3) / (7 * 0.2 + 1))
    assert b.poll(cut - 1e-9) == []
    assert [(x.bucket, x.reason) for x in b.poll(cut)] == [(0, "adaptive")]


def test_drain_returns_everything_oldest_first():
    b = dyn()
    b.add(item("b", 40, at=0.5))
    b.add(item("a", 3000, at=0.1))
    b.add(item("c", 40, at=0.6))
    drained = b.drain()
    assert keys(drained) == [["a"], ["b", "c"]] and {x.reason for x in drained} == {"drain"}
    assert len(b) == 0 and b.drain() == [] and b.next_deadline() is None


def test_fifo_preserves_order_and_flushes_at_size_or_timeout():
    b = FifoBatcher(max_batch_size=3, batch_timeout_s=0.5, clock=Clock())
    out = []
    for n, (prompt, t) in enumerate([(3000, 0.0), (10, 0.1), (500, 0.2), (20, 0.3), (7, 0.4)]):
        out += b.add(item(str(n), prompt, at=t))
    assert keys(out) == [["0", "1", "2"]] and out[0].bucket is None and out[0].reason == "full"
    assert b.next_deadline() == pytest.approx(0.8)
    assert b.poll(0.79) == []
    late = b.poll(0.8)
    assert keys(late) == [["3", "4"]] and late[0].reason == "timeout"
    b.add(item("5", 1, at=1.0))
    assert keys(b.drain()) == [["5"]]


def test_padding_accounting():
    batch = Batch(None, [item("a", 100, 10), item("b", 20, 50)], "full")
    assert batch.useful_tokens == 180
    assert batch.padded_tokens == 2 * (100 + 50)
    assert batch.wasted_tokens == 120 and batch.padding_ratio == pytest.approx(0.4)
    assert Batch(0, [], "drain").padding_ratio == 0.0


def test_make_batcher():
    opts = dict(max_seq_len=1024, max_batch_size=8, batch_timeout_s=0.05, clock=Clock())
    assert isinstance(make_batcher("dynamic_bucket", **opts), DynamicBucketBatcher)
    assert isinstance(make_batcher("fifo", **opts), FifoBatcher)
    direct = make_batcher("direct", **opts)
    assert keys(direct.add(item("a", 40))) == [["a"]] and len(direct) == 0 and direct.next_deadline() is None
    with pytest.raises(ValueError):
        make_batcher("lifo", **opts)


# ---- no item is lost or duplicated ----------------------------------------------
# An op adds a request after a gap, polls after a gap, or jumps to the advertised deadline and polls.
ops = st.lists(
    st.tuples(st.sampled_from(["add", "add", "poll", "deadline"]), st.floats(0, 0.3),
              st.integers(-10, 10_000), st.integers(0, 600)),
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, kind=st.sampled_from(["dynamic_bucket", "fifo"]), size=st.integers(1, 6),
       timeout=st.sampled_from([0.0, 0.05, 0.5]))
def test_every_item_comes_out_exactly_once(ops, kind, size, timeout):
    clock = Clock()
    b = make_batcher(kind, max_seq_len=4096, max_batch_size=size, batch_timeout_s=timeout, clock=clock)
    added, out = [], []
    for n, (op, gap, prompt, max_tokens) in enumerate(ops):
        clock.t += gap
        if op == "add":
            added.append(str(n))
            out += b.add(item(str(n), prompt, max_tokens, at=clock.t))
        elif op == "poll":
            out += b.poll()
        elif (deadline := b.next_deadline()) is not None:
            clock.t = max(clock.t, deadline)
            released = b.poll()
            assert released, "polling at next_deadline() must release something"
            out += released
        assert len(b) == len(added) - sum(len(x.items) for x in out)
    out += b.drain()
    released_keys = [i.key for x in out for i in x.items]
    assert sorted(released_keys) == sorted(added)
    assert all(1 <= len(x.items) <= size for x in out)
    assert len(b) == 0 and b.next_deadline() is None


# ---- room: no wait while the engine can start more ---------------------------------
def test_release_hands_over_at_most_room_items_bucket_by_bucket_oldest_first():
    b = dyn(adaptive=False)
    b.add(item("long1", 3000, at=0.0))  # bucket 0
    b.add(item("s1", 40, at=0.1))  # bucket 4
    b.add(item("s2", 40, at=0.2))
    b.add(item("long2", 3000, at=0.3))
    assert b.release(0) == []
    batches = b.release(3)
    assert [(x.bucket, x.reason) for x in batches] == [(0, "room"), (4, "room")]
    assert keys(batches) == [["long1", "long2"], ["s1"]]
    assert len(b) == 1 and b.pending(4) == 1
    assert keys(b.release(5)) == [["s2"]] and len(b) == 0 and b.release(5) == []


def test_fifo_release_is_arrival_order():
    f = FifoBatcher(max_batch_size=8, batch_timeout_s=1.0, clock=Clock())
    for k, at in (("a", 0.0), ("b", 0.1), ("c", 0.2)):
        f.add(item(k, 40, at=at))
    assert keys(f.release(2)) == [["a", "b"]] and f.release(2)[0].reason == "room"
    assert len(f) == 0 and f.next_deadline() is None


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4096), st.integers(0, 512)), max_size=40), st.integers(0, 50))
def test_release_never_loses_or_repeats_an_item(requests, room):
    b = dyn()
    full = []
    for n, (prompt, gen) in enumerate(requests):
        full += [i.key for x in b.add(item(str(n), prompt, gen, at=n * 0.01)) for i in x.items]
    waiting = len(b)
    released = [i.key for x in b.release(room) for i in x.items]
    assert len(released) == min(room, waiting) == waiting - len(b)
    rest = [i.key for x in b.drain() for i in x.items]
    assert sorted(full + released + rest, key=int) == [str(n) for n in range(len(requests))]
