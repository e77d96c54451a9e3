"""Micro-batching between the Kafka consumer and the engine.

Two batchers share one interface. `FifoBatcher` releases requests in arrival
order, `max_batch_size` at a time or when the oldest has waited
`batch_timeout`. `DynamicBucketBatcher` ("Dynamic Bucket", SEED-NOTES.md)
first sorts requests into length buckets so that a batch holds requests of
similar shape, which is what keeps padding down on an engine that pads a batch
to its longest member.

Both are pure logic: no asyncio, no threads, time passed in. The worker calls
`add` as requests arrive, sleeps until `next_deadline()`, calls `poll`, and
calls `drain` on shutdown. In front of a continuous-batching engine, waiting
only pays while the engine is full: the worker calls `release(room)` with the
sequences the engine can start now, and that many pending requests leave at
once, so a batcher adds no wait while the engine has room.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

FLUSH_REASONS = ("full", "timeout", "adaptive", "drain", "room")


@dataclass
class BatchItem:
    """One request waiting for a batch. `arrival` is on the batcher's clock."""

    key: str
    prompt_tokens: int
    max_tokens: int
    payload: Any
    arrival: float


@dataclass
class Batch:
    """A released micro-batch. `bucket` is None on the FIFO path."""

    bucket: int | None
    items: list[BatchItem]
    reason: str  # one of FLUSH_REASONS

    def __len__(self) -> int:
        return len(self.items)

    @property
    def useful_tokens(self) -> int:
        """Prompt plus generation budget of every item: the KV a request may really use."""
        return sum(max(0, i.prompt_tokens) + max(0, i.max_tokens) for i in self.items)

    @property
    def padded_tokens(self) -> int:
        """Tokens a static batcher would compute for this batch.

        A padded engine (HF `generate` style) pads every prompt to the longest
        prompt and decodes until the largest max_tokens, so each row costs
        max(prompt) + max(max_tokens), not the longest single request.
        """
        if not self.items:
            return 0
        longest_prompt = max(max(0, i.prompt_tokens) for i in self.items)
        longest_gen = max(max(0, i.max_tokens) for i in self.items)
        return len(self.items) * (longest_prompt + longest_gen)

    @property
    def wasted_tokens(self) -> int:
        return self.padded_tokens - self.useful_tokens

    @property
    def padding_ratio(self) -> float:
        """Share of the padded batch that is padding, in [0, 1)."""
        padded = self.padded_tokens
        return self.wasted_tokens / padded if padded else 0.0


class Batcher(Protocol):
    def add(self, item: BatchItem) -> list[Batch]:
        """Queue an item; returns the batches that became full (at most one)."""
        ...

    def poll(self, now: float | None = None) -> list[Batch]:
        """Batches due at `now` (default: the batcher's clock), oldest first."""
        ...

    def next_deadline(self) -> float | None:
        """Earliest time at which `poll` returns something; may be in the past. None when empty."""
        ...

    def drain(self) -> list[Batch]:
        """Everything pending, oldest first (shutdown)."""
        ...

    def release(self, room: int) -> list[Batch]:
        """Up to `room` pending items at once (the engine can start that many now), oldest first."""
        ...

    def __len__(self) -> int: ...


def _check_common(max_batch_size: int, batch_timeout_s: float) -> None:
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    if not batch_timeout_s >= 0:
        raise ValueError(f"batch_timeout_s must be >= 0, got {batch_timeout_s}")


def _oldest(items: list[BatchItem]) -> float:
    # Not items[0]: a caller may stamp arrival from a source that is not
    # perfectly monotonic (several partitions), and the timeout is owed to the oldest.
    return min(i.arrival for i in items)


class FifoBatcher:
    """The baseline: one queue, flushed when full or when its oldest item times out."""

    def __init__(self, max_batch_size: int, batch_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        _check_common(max_batch_size, batch_timeout_s)
        self.max_batch_size = max_batch_size
        self.batch_timeout_s = batch_timeout_s
        self._clock = clock
        self._items: list[BatchItem] = []

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: BatchItem) -> list[Batch]:
        self._items.append(item)
        if len(self._items) >= self.max_batch_size:
            return [self._flush("full")]
        return []

    def poll(self, now: float | None = None) -> list[Batch]:
        now = self._clock() if now is None else now
        deadline = self.next_deadline()
        if deadline is not None and now >= deadline:
            return [self._flush("timeout")]
        return []

    def next_deadline(self) -> float | None:
        return _oldest(self._items) + self.batch_timeout_s if self._items else None

    def drain(self) -> list[Batch]:
        return [self._flush("drain")] if self._items else []

    def release(self, room: int) -> list[Batch]:
        if room <= 0 or not self._items:
            return []
        batch, self._items = Batch(None, self._items[:room], "room"), self._items[room:]
        return [batch]

    def _flush(self, reason: str) -> Batch:
        batch, self._items = Batch(None, self._items, reason), []
        return batch


class _ArrivalRate:
    """EWMA of inter-arrival gaps, read as a rate.

    We average gaps rather than 1/gap: two requests in the same millisecond
    would make an instantaneous rate infinite and swamp the average.
    """

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.gap: float | None = None  # None until two arrivals were seen
        self.last: float | None = None

    def observe(self, t: float) -> None:
        if self.last is not None:
            sample = max(0.0, t - self.last)
            self.gap = sample if self.gap is None else (1 - self.alpha) * self.gap + self.alpha * sample
        self.last = t if self.last is None else max(self.last, t)

    def qps(self, now: float) -> float | None:
        gap = self.effective_gap(now)
        if gap is None:
            return None
        return math.inf if gap == 0 else 1.0 / gap

    def effective_gap(self, now: float) -> float | None:
        """The gap, lengthened by the silence since the last arrival.

        The silence is folded in as if an arrival came now: after a burst, a
        quiet spell lowers the rate, but one late request does not reset it.
        """
        if self.gap is None or self.last is None:
            return None
        return max(self.gap, (1 - self.alpha) * self.gap + self.alpha * max(0.0, now - self.last))


class DynamicBucketBatcher:
    """Length buckets with online K-means centres and an adaptive batching window.

    Buckets: bucket i holds requests whose prompt_tokens + max_tokens fit in
    max_seq_len / 2**i (integer division), so bucket 0 is the largest and
    takes everything.

    Features: (prompt_tokens, max_tokens), each clamped to [0, max_seq_len]
    and divided by max_seq_len, so both lie in [0, 1] on one scale: a token of
    prompt and a token of generation budget weigh the same, which is what they
    cost when a batch is padded. (A log2 scale, which spaces the geometric
    buckets evenly, was tried and measured worse: it spends centres on
    telling 40-token prompts from 80-token ones, where padding is cheap. On
    bench/batcher.py's mixed workload at 1000 req/s without the adaptive cut,
    learned log2 centres wasted 44% of padded tokens, fixed centres 38%, and
    learned linear centres 36%.)

    Assignment: the nearest centre by L2 distance among the buckets that can
    hold the request. A centre starts at 3/8 of its bucket size on both axes
    (the request that would fill three quarters of it, half prompt, half
    generation) and counts as one observation.

    Centres: mini-batch K-means. Each assignment moves its centre towards the
    request by max(1 / count, min_lr): the running mean at first, then an
    exponential average, so centres follow traffic that shifts.

    Window: a bucket flushes when full, when its oldest item has waited
    batch_timeout_s, or (adaptive) as soon as the arrival rate predicts it
    will not fill within what is left of that window. The rate is an EWMA per
    bucket; a bucket that has not seen two arrivals yet borrows the overall
    rate, which is an upper bound on its own, so the borrowed prediction cuts
    late rather than early. With no history at all, there is no cut.
    """

    def __init__(self, max_seq_len: int, max_batch_size: int, batch_timeout_s: float, num_buckets: int = 5,
                 clock: Callable[[], float] = time.monotonic, ewma_alpha: float = 0.2, min_lr: float = 0.02,
                 adaptive: bool = True, learn_centres: bool = True) -> None:
        _check_common(max_batch_size, batch_timeout_s)
        if num_buckets < 1:
            raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
        if max_seq_len < 2 ** (num_buckets - 1):
            raise ValueError(f"max_seq_len={max_seq_len} is too small for {num_buckets} buckets")
        if not 0 < ewma_alpha <= 1:
            raise ValueError(f"ewma_alpha must be in (0, 1], got {ewma_alpha}")
        if not 0 < min_lr <= 1:
            raise ValueError(f"min_lr must be in (0, 1], got {min_lr}")
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        self.batch_timeout_s = batch_timeout_s
        self.ewma_alpha = ewma_alpha
        self.min_lr = min_lr
        self.adaptive = adaptive
        self.learn_centres = learn_centres
        self._clock = clock
        self.bucket_sizes: tuple[int, ...] = tuple(max_seq_len >> i for i in range(num_buckets))
        self._centres = [self._features(s * 3 // 8, s * 3 // 8) for s in self.bucket_sizes]
        self._counts = [1] * num_buckets
        self._pending: list[list[BatchItem]] = [[] for _ in range(num_buckets)]
        self._rates = [_ArrivalRate(ewma_alpha) for _ in range(num_buckets)]
        self._overall = _ArrivalRate(ewma_alpha)

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_sizes)

    def __len__(self) -> int:
        return sum(len(p) for p in self._pending)

    def pending(self, bucket: int) -> int:
        return len(self._pending[bucket])

    @property
    def centres(self) -> list[tuple[float, float]]:
        """Centres in tokens, (prompt_tokens, max_tokens)."""
        return [(p * self.max_seq_len, m * self.max_seq_len) for p, m in self._centres]

    def qps(self, bucket: int | None = None, now: float | None = None) -> float | None:
        """The EWMA arrival rate of one bucket, or overall; None before two arrivals."""
        now = self._clock() if now is None else now
        return (self._overall if bucket is None else self._rates[bucket]).qps(now)

    # ---- assignment ------------------------------------------------------
    def _clamp(self, tokens: int) -> int:
        return min(max(0, int(tokens)), self.max_seq_len)

    def _features(self, prompt_tokens: int, max_tokens: int) -> tuple[float, float]:
        return self._clamp(prompt_tokens) / self.max_seq_len, self._clamp(max_tokens) / self.max_seq_len

    def assign(self, prompt_tokens: int, max_tokens: int) -> int:
        """The bucket a request would go to now; changes nothing."""
        total = min(self._clamp(prompt_tokens) + self._clamp(max_tokens), self.max_seq_len)
        fp, fm = self._features(prompt_tokens, max_tokens)
        best, best_dist = 0, math.inf
        for i, size in enumerate(self.bucket_sizes):
            if size < total:
                break  # sizes only shrink from here
            cp, cm = self._centres[i]
            dist = (fp - cp) ** 2 + (fm - cm) ** 2
            if dist < best_dist:
                best, best_dist = i, dist
        return best

    def _learn(self, bucket: int, prompt_tokens: int, max_tokens: int) -> None:
        self._counts[bucket] += 1
        lr = max(1.0 / self._counts[bucket], self.min_lr)
        fp, fm = self._features(prompt_tokens, max_tokens)
        cp, cm = self._centres[bucket]
        self._centres[bucket] = (cp + lr * (fp - cp), cm + lr * (fm - cm))

    # ---- the batcher interface ----------------------------------------------
    def add(self, item: BatchItem) -> list[Batch]:
        bucket = self.assign(item.prompt_tokens, item.max_tokens)
        if self.learn_centres:
            self._learn(bucket, item.prompt_tokens, item.max_tokens)
        self._overall.observe(item.arrival)
        self._rates[bucket].observe(item.arrival)
        pending = self._pending[bucket]
        pending.append(item)
        if len(pending) >= self.max_batch_size:
            return [self._flush(bucket, "full")]
        return []

    def poll(self, now: float | None = None) -> list[Batch]:
        now = self._clock() if now is None else now
        due = []
        for b, pending in enumerate(self._pending):
            if pending and now >= self._due_at(b):
                reason = "timeout" if now >= _oldest(pending) + self.batch_timeout_s else "adaptive"
                due.append((_oldest(pending), b, reason))
        return [self._flush(b, reason) for _, b, reason in sorted(due)]

    def next_deadline(self) -> float | None:
        return min((self._due_at(b) for b, p in enumerate(self._pending) if p), default=None)

    def drain(self) -> list[Batch]:
        order = sorted((_oldest(p), b) for b, p in enumerate(self._pending) if p)
        return [self._flush(b, "drain") for _, b in order]

    def release(self, room: int) -> list[Batch]:
        """Buckets in the order of their oldest item, each as one batch of similar requests, until `room` is
        used up; a bucket that does not fit whole gives its oldest items and keeps the rest."""
        out = []
        for _, b in sorted((_oldest(p), b) for b, p in enumerate(self._pending) if p):
            if room <= 0:
                break
            pending = sorted(self._pending[b], key=lambda i: i.arrival)
            out.append(Batch(b, pending[:room], "room"))
            self._pending[b] = pending[room:]
            room -= len(out[-1].items)
        return out

    def _flush(self, bucket: int, reason: str) -> Batch:
        batch = Batch(bucket, self._pending[bucket], reason)
        self._pending[bucket] = []
        return batch

    # ---- the adaptive window -----------------------------------------------
    def _due_at(self, bucket: int) -> float:
        """When the bucket's batch becomes due: its timeout, or earlier by the adaptive cut.

        NOTE: poll() and next_deadline() both read this one number, so polling
        at next_deadline() always releases something.
        """
        pending = self._pending[bucket]
        deadline = _oldest(pending) + self.batch_timeout_s
        return min(deadline, self._cut_at(bucket, deadline)) if self.adaptive else deadline

    def _cut_at(self, bucket: int, deadline: float) -> float:
        """The first time at which needed * effective_gap(t) >= deadline - t.

        effective_gap(t) = max(g, (1 - a) g + a (t - last)), so the condition
        holds once either term does; each gives a linear inequality in t.
        """
        rate = self._rates[bucket] if self._rates[bucket].gap is not None else self._overall
        if rate.gap is None or rate.last is None:
            return math.inf
        needed = self.max_batch_size - len(self._pending[bucket])
        a, g, last = self.ewma_alpha, rate.gap, rate.last
        steady = deadline - needed * g
        silent = (deadline - needed * (1 - a) * g + needed * a * last) / (needed * a + 1)
        return min(steady, silent)


BATCHER_KINDS = ("dynamic_bucket", "fifo", "direct")
_BUCKET_ONLY_OPTIONS = ("max_seq_len", "num_buckets", "ewma_alpha", "min_lr", "adaptive", "learn_centres")


def make_batcher(kind: str, **options: Any) -> Batcher:
    """Build a batcher by name from one set of options.

    The FIFO batcher ignores the bucket-only options, so the worker can pass
    the same execution config whichever kind is configured. "direct" batches
    nothing: every request goes on at once (the baseline bench.slo compares with).
    """
    if kind == "dynamic_bucket":
        return DynamicBucketBatcher(**options)
    if kind == "fifo":
        return FifoBatcher(**{k: v for k, v in options.items() if k not in _BUCKET_ONLY_OPTIONS})
    if kind == "direct":
        return FifoBatcher(max_batch_size=1, batch_timeout_s=0.0, **({"clock": options["clock"]}
                                                                     if "clock" in options else {}))
    raise ValueError(f"batcher kind must be one of {BATCHER_KINDS}, got {kind!r}")
