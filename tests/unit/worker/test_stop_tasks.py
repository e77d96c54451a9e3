"""Shutdown cancels its tasks until they stop: one swallowed cancellation must not hang a worker."""

from __future__ import annotations

import asyncio

from worker.lifecycle import stop_tasks


async def _swallows(times: int, stopped: list[str]) -> None:
    swallowed = 0
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if swallowed >= times:
                stopped.append("done")
                raise
            swallowed += 1  # what a lost cancellation looks like from outside: the task keeps waiting


def test_a_task_that_swallows_a_cancellation_is_cancelled_again():
    async def main():
        stopped: list[str] = []
        tasks = [asyncio.create_task(_swallows(2, stopped), name="outputs"),
                 asyncio.create_task(asyncio.sleep(3600), name="plain")]
        await asyncio.sleep(0)
        stuck = await stop_tasks(tasks, timeout_s=5.0)
        return stuck, stopped, [t.cancelled() for t in tasks]

    stuck, stopped, cancelled = asyncio.run(main())
    assert stuck == [] and stopped == ["done"] and cancelled == [True, True]


def test_a_task_that_never_stops_is_reported_not_waited_for():
    async def main():
        task = asyncio.create_task(_swallows(10**9, []), name="stubborn")
        await asyncio.sleep(0)
        stuck = await stop_tasks([task], timeout_s=1.0)
        assert not task.done()
        task.get_coro().close()  # so the test's own loop can close
        return stuck

    assert asyncio.run(main()) == ["stubborn"]
