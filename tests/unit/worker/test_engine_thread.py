"""EngineThread and EngineLoop: the engine is built and stepped on one thread."""

from __future__ import annotations

import threading
import time

import pytest

from worker.engine_loop import EngineEvent, EngineLoop, EngineThread


class StepCounter:
    """A stand-in engine that records the thread of every call."""

    def __init__(self) -> None:
        self.threads = {threading.get_ident()}
        self.steps = 0

    def has_unfinished_requests(self) -> bool:
        self.threads.add(threading.get_ident())
        return self.steps < 3

    def step(self):
        self.threads.add(threading.get_ident())
        self.steps += 1
        return []

    @property
    def last_stats(self):
        from engine import EngineStats

        return EngineStats()

    def take_kv_events(self):
        return []

    def check_health(self) -> None:
        pass


def test_calls_run_in_order_on_one_thread_and_errors_reach_the_caller():
    t = EngineThread()
    idents = [t.call(threading.get_ident) for _ in range(3)]
    order: list[int] = []
    done = [t.call(order.append, i) for i in range(5)]
    for f in done:
        f.result(5)
    assert order == [0, 1, 2, 3, 4]
    assert len({f.result(5) for f in idents}) == 1 and idents[0].result() != threading.get_ident()
    with pytest.raises(ZeroDivisionError):
        t.call(lambda: 1 / 0).result(5)
    t.close()
    t._thread.join(5)
    assert not t._thread.is_alive()


def test_the_loop_steps_the_engine_on_the_thread_that_built_it():
    t = EngineThread()
    engine = t.call(StepCounter).result(5)
    events: list[EngineEvent] = []
    loop = EngineLoop(engine, events.append, idle_wait_s=0.01, thread=t)
    loop.start()
    deadline = time.monotonic() + 10
    while len(events) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.alive and len(events) == 3
    loop.stop(timeout=5)
    assert not loop.alive and loop.failed is None
    assert engine.threads == {t._thread.ident}


def test_load_reports_the_last_step_and_the_kv_cache_as_it_is_now():
    from types import SimpleNamespace

    bm = SimpleNamespace(usage=0.25, hit_rate=0.5, prefix_queries=8, prefix_hits=4)
    loop = EngineLoop(SimpleNamespace(block_manager=bm), deliver=lambda ev: None, thread=EngineThread())
    loop.running, loop.waiting = 3, 1
    assert loop.load() == {"running": 3, "waiting": 1, "kv_usage": 0.25, "hit_rate": 0.5, "queries": 8, "hits": 4}


def test_fail_all_finishes_every_request_with_an_internal_error():
    from types import SimpleNamespace

    finished = []
    scheduler = SimpleNamespace(requests={"a": "req-a", "b": "req-b"},
                                finish=lambda req, reason: finished.append((req, reason)))
    processor = SimpleNamespace(finish_without_token=lambda req, reason, err: (req, reason, err.code))
    loop = EngineLoop(SimpleNamespace(scheduler=scheduler, output_processor=processor), deliver=lambda ev: None,
                      thread=EngineThread())
    outs = loop.fail_all(RuntimeError("boom"))
    assert finished == [("req-a", "error"), ("req-b", "error")]
    assert outs == [("req-a", "error", "internal"), ("req-b", "error", "internal")]
