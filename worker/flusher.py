"""The flusher: each partition's finished prefix goes out with its offset, one transaction per partition.

Completion puts finished results on their partition's tracker and sets `results_ready`.
The flush loop takes each tracker's releasable prefix and publishes it; a published
release is marked committed, a failed one is restored for the next flush. A fenced
partition, or one whose transaction outcome is unknown, goes back to Partitions.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol

import structlog
from aiokafka import TopicPartition

from worker.offsets import PartitionTracker, Release
from worker.partitions import Partitions
from worker.publisher import PartitionLost, PartitionResync

log = structlog.get_logger("infinilm.worker")


class Clock(Protocol):
    """The flush loop's time: the event loop's in service, a virtual one in tests."""

    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...

    async def wait(self, event: asyncio.Event, timeout: float) -> None:
        """Return when `event` is set or `timeout` seconds have passed, whichever is first."""


class MonotonicClock:
    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def wait(self, event: asyncio.Event, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout=timeout)


class Flusher:
    def __init__(self, partitions: Partitions, publisher, *, flush_interval_s: float, eager: bool,
                 stopping: asyncio.Event, clock: Clock | None = None) -> None:
        """`publisher`: TransactionalPublisher or AtLeastOncePublisher (worker.publisher)."""
        self.partitions = partitions
        self.publisher = publisher
        self.interval = flush_interval_s
        self.eager = eager
        self._stopping = stopping
        self.clock = clock or MonotonicClock()
        self.results_ready = asyncio.Event()  # a tracker got a finished result since the last flush
        self._published = asyncio.Event()  # set, and replaced, whenever a round of publishes ends

    async def run(self) -> None:
        """Flush every flush interval; with eager flushing, also as soon as a result is finished,
        if the last flush of finished results started an interval ago or more. Either way those
        flushes start at most once per interval, so a partition commits at most one transaction
        per interval. Ticks with nothing finished (they retry set-ups and update flow control)
        do not count: a result after an idle spell is flushed at once."""
        last = float("-inf")  # when the last flush of finished results started
        while True:
            if self.eager:
                await self.clock.wait(self.results_ready, self.interval)
                if self.results_ready.is_set():
                    wait = last + self.interval - self.clock.monotonic()
                    if wait > 0:
                        await self.clock.sleep(wait)
            else:
                await self.clock.sleep(self.interval)
            if self.results_ready.is_set():
                self.results_ready.clear()
                last = self.clock.monotonic()
            await self.flush_all()

    async def flush_all(self, only: list[TopicPartition] | None = None, *, complete: bool = False) -> None:
        """Publish every partition's releasable results (only those of `only`, if given).

        A partition whose previous release is still being published (by another flush) is skipped,
        or, with `complete` (a rebalance's or a shutdown's flush: the last chance to publish), flushed
        again once that publish ends, so that what finished after that release goes out too. No
        release is held while waiting, so two such flushes never wait on each other."""
        busy = await self._flush_once(only)
        while complete and (busy := self._still_publishing(busy)):
            await self._published.wait()
            busy = await self._flush_once(busy)
        if only is None and not self._stopping.is_set():  # a stopping worker starts no producers
            self.partitions.retry_setups()
        self.partitions.update_pause()

    async def _flush_once(self, only: list[TopicPartition] | None) -> list[TopicPartition]:
        """Publish what is releasable now; returns the partitions skipped as still publishing."""
        releases, busy = [], []
        for tp, tracker in list(self.partitions.trackers.items()):
            if only is not None and tp not in only:
                continue
            if tracker.publishing:
                busy.append(tp)
                continue
            release = tracker.release()
            if release is not None:
                releases.append((tp, tracker, release))
        if releases:
            await self._publish(releases)
        return busy

    def _still_publishing(self, tps: list[TopicPartition]) -> list[TopicPartition]:
        return [tp for tp in tps if (t := self.partitions.trackers.get(tp)) is not None and t.publishing]

    async def _publish(self, releases: list[tuple[TopicPartition, PartitionTracker, Release]]) -> None:
        try:
            await self._publish_and_settle(releases)
        finally:
            self._published.set()
            self._published = asyncio.Event()

    async def _publish_and_settle(self, releases: list[tuple[TopicPartition, PartitionTracker, Release]]) -> None:
        outcomes = await asyncio.gather(*(self.publisher.publish(r) for _, _, r in releases), return_exceptions=True)
        for (tp, tracker, release), outcome in zip(releases, outcomes, strict=True):
            if outcome is True:
                tracker.mark_committed(release)
            elif isinstance(outcome, PartitionLost):
                self.partitions.lost(tp)
            elif isinstance(outcome, PartitionResync):
                self.partitions.resync(tp, str(outcome))
            else:
                if isinstance(outcome, BaseException):
                    log.warning("publish failed", partition=str(tp), error=repr(outcome))
                tracker.restore(release)
