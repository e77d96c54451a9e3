"""The flusher's loop: when finished results get committed (kafka.flush_interval_ms, kafka.eager_flush).

Driven through Flusher.run on a virtual clock: the test moves time forward and the
checks are the exact virtual times at which flushes start.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools

from worker.flusher import Flusher


class VirtualClock:
    """Time that moves only when the test calls advance(); sleepers wake in deadline order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._timers: list[tuple[float, int, asyncio.Future]] = []
        self._seq = itertools.count()

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._timers, (self.now + max(0.0, seconds), next(self._seq), future))
        await future

    async def wait(self, event: asyncio.Event, timeout: float) -> None:
        if event.is_set():
            return
        waits = [asyncio.ensure_future(event.wait()), asyncio.ensure_future(self.sleep(timeout))]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def advance(self, seconds: float) -> None:
        target = self.now + seconds
        await _settle()
        while self._timers and self._timers[0][0] <= target:
            due, _, future = heapq.heappop(self._timers)
            self.now = max(self.now, due)
            if not future.done():
                future.set_result(None)
            await _settle()
        self.now = target
        await _settle()


async def _settle() -> None:
    """Let every task that can run, run."""
    for _ in range(20):
        await asyncio.sleep(0)


class Partitions:
    """What the flusher calls on partitions.Partitions; no partitions, so nothing to publish."""

    def __init__(self, clock: VirtualClock) -> None:
        self.trackers: dict = {}
        self.clock = clock
        self.flushes: list[float] = []  # update_pause ends every flush_all

    def retry_setups(self) -> None:
        pass

    def update_pause(self) -> None:
        self.flushes.append(self.clock.now)


async def _drive(interval_ms: int, eager: bool, script) -> list[float]:
    clock = VirtualClock()
    partitions = Partitions(clock)
    flusher = Flusher(partitions, publisher=None, flush_interval_s=interval_ms / 1000, eager=eager,
                      stopping=asyncio.Event(), clock=clock)
    task = asyncio.create_task(flusher.run())
    try:
        await script(flusher, clock, partitions.flushes)
        return partitions.flushes
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _result_after(delay: float, observe: float):
    async def script(flusher, clock, flushes):
        await clock.advance(delay)
        flusher.results_ready.set()
        await clock.advance(observe)

    return script


def test_an_idle_worker_commits_a_finished_result_at_once():
    # Interval 4 s; a result at 0.5 s is flushed right away, not at the 4 s tick.
    assert asyncio.run(_drive(4000, True, _result_after(0.5, 1.5))) == [0.5]


def test_without_eager_flush_results_wait_for_the_tick():
    assert asyncio.run(_drive(4000, False, _result_after(0.5, 1.5))) == []  # the first tick is at 4 s
    assert asyncio.run(_drive(4000, False, _result_after(0.5, 3.5))) == [4.0]


def test_flushes_start_at_most_once_per_interval():
    async def script(flusher, clock, flushes):
        await clock.advance(0.3)
        flusher.results_ready.set()  # flushed at once (idle)
        await clock.advance(0.5)
        flusher.results_ready.set()  # within the interval of that flush: waits for it to pass
        await clock.advance(1.0)
        assert flushes == [0.3]
        await clock.advance(2.5)

    assert asyncio.run(_drive(3000, True, script)) == [0.3, 3.3]


def test_an_idle_worker_still_ticks_every_interval():
    # Set-up retries and flow control run in the flush: it happens every interval without results.
    assert asyncio.run(_drive(1000, True, lambda f, clock, _: clock.advance(3.6))) == [1.0, 2.0, 3.0]


def test_idle_ticks_do_not_hold_back_the_next_result():
    # Interval 2 s: idle ticks at 2 s and 4 s; a result at 4.5 s is flushed at once, not at the 6 s tick.
    assert asyncio.run(_drive(2000, True, _result_after(4.5, 1.0))) == [2.0, 4.0, 4.5]
