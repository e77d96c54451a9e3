"""The worker's flush loop: when finished results get committed (kafka.flush_interval_ms, kafka.eager_flush).

Driven through Worker._flush_loop with a stand-in for the worker; the intervals are long
(seconds) and the checks are about which tick a flush lands on, with a second or more of slack.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace

from worker.service import Worker


def _stand_in(interval_ms: int, eager: bool):
    flushes: list[float] = []

    async def flush_all(only=None):
        flushes.append(time.monotonic())

    stand_in = SimpleNamespace(
        config=SimpleNamespace(kafka=SimpleNamespace(flush_interval_ms=interval_ms, eager_flush=eager)),
        _results_ready=asyncio.Event(), _flush_all=flush_all)
    return stand_in, flushes


async def _drive(interval_ms: int, eager: bool, script) -> list[float]:
    stand_in, flushes = _stand_in(interval_ms, eager)
    task = asyncio.create_task(Worker._flush_loop(stand_in))
    try:
        start = time.monotonic()
        await script(stand_in, flushes)
        return [t - start for t in flushes]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _result_after(stand_in, flushes, delay: float, observe: float) -> None:
    await asyncio.sleep(delay)
    stand_in._results_ready.set()
    await asyncio.sleep(observe)


def test_an_idle_worker_commits_a_finished_result_at_once():
    # Interval 4 s; a result at 0.5 s is flushed right away, not at the 4 s tick.
    flushes = asyncio.run(_drive(4000, True, lambda s, f: _result_after(s, f, 0.5, 1.5)))
    assert len(flushes) == 1 and flushes[0] < 1.5, flushes


def test_without_eager_flush_results_wait_for_the_tick():
    flushes = asyncio.run(_drive(4000, False, lambda s, f: _result_after(s, f, 0.5, 1.5)))
    assert flushes == [], flushes  # the first tick is at 4 s


def test_flushes_start_at_most_once_per_interval():
    async def script(stand_in, flushes):
        await asyncio.sleep(0.3)
        stand_in._results_ready.set()  # flushed at once (idle)
        await asyncio.sleep(0.5)
        stand_in._results_ready.set()  # within the interval of that flush: waits for it to pass
        await asyncio.sleep(1.0)
        assert len(flushes) == 1
        await asyncio.sleep(2.5)  # past 0.3 + 3 s

    flushes = asyncio.run(_drive(3000, True, script))
    assert len(flushes) == 2, flushes
    assert flushes[1] - flushes[0] >= 3.0 - 0.05, flushes


def test_an_idle_worker_still_ticks_every_interval():
    # Set-up retries and flow control run in the flush: it happens every interval without results.
    flushes = asyncio.run(_drive(1000, True, lambda s, f: asyncio.sleep(3.6)))
    assert len(flushes) == 3, flushes


def test_idle_ticks_do_not_hold_back_the_next_result():
    # Interval 2 s: idle ticks at 2 s and 4 s; a result at 4.5 s is flushed at once, not at the 6 s tick.
    flushes = asyncio.run(_drive(2000, True, lambda s, f: _result_after(s, f, 4.5, 1.0)))
    assert len(flushes) == 3 and 4.4 < flushes[2] < 5.3, flushes
