"""The engine on its own thread, so the asyncio side never waits on compute.

The asyncio side submits jobs and aborts through a thread-safe queue; the
thread steps the engine while it has work and hands each step's outputs,
stats and KV events back through `deliver` (which must be thread-safe, e.g.
`loop.call_soon_threadsafe`). The thread never touches Kafka or Redis.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from engine import EngineCore, EngineStats, MaskSpec, RequestError, RequestOutput, SamplingParams
from engine.attention.metadata import CAUSAL
from engine.errors import EngineFailure

log = logging.getLogger(__name__)


@dataclass
class EngineJob:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    mask: MaskSpec = CAUSAL
    arrival_time: float | None = None
    images: tuple = ()


@dataclass
class EngineEvent:
    outputs: list[RequestOutput] = field(default_factory=list)
    errors: list[tuple[str, RequestError]] = field(default_factory=list)
    stats: EngineStats | None = None
    kv_events: list = field(default_factory=list)
    stall_s: float = 0.0


class EngineThread:
    """One daemon thread that runs the calls it is given, in order.

    Why: the engine should be built on the thread that then steps it. With GNU OpenMP
    every thread that runs a parallel region gets its own team of worker threads; a
    model loaded on the main thread and stepped on another leaves two teams, more
    OpenMP threads than CPUs on a small host, and libgomp then parks its workers
    between parallel regions instead of spinning, which slows every step
    (docs/perf/worker-notes.md has the measurement).
    """

    def __init__(self, name: str = "engine") -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._calls.put((future, fn, args))
        return future

    def close(self) -> None:
        """Let the thread end once the calls already given have run."""
        self._calls.put(None)

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)


class EngineLoop:
    def __init__(self, engine: EngineCore, deliver: Callable[[EngineEvent], None], idle_wait_s: float = 0.05,
                 thread: EngineThread | None = None) -> None:
        """`thread`: the thread the engine was built on (see EngineThread); a new one if None."""
        self.engine = engine
        self._deliver = deliver
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._idle_wait_s = idle_wait_s
        self._thread = thread or EngineThread()
        self._done: Future | None = None
        self.running = 0
        self.waiting = 0
        self.failed: BaseException | None = None
        # Called on the engine thread with the error when the loop dies (e.g. EngineFailure: a tensor-parallel
        # rank is gone); the service stops the worker, so its partitions move to another one.
        self.on_failure: Callable[[BaseException], None] | None = None

    def start(self) -> None:
        self._done = self._thread.call(self._run)
        self._thread.close()  # the loop is its last call

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        if self._done is not None:
            with contextlib.suppress(Exception):  # a timeout, or the loop's own failure (in `failed`)
                self._done.exception(timeout)

    @property
    def alive(self) -> bool:
        return self._done is not None and not self._done.done()

    def submit(self, jobs: list[EngineJob]) -> None:
        if jobs:
            self._commands.put(("add", jobs))

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._commands.put(("abort", request_ids))

    def _run(self) -> None:
        engine = self.engine
        last_step_end = time.perf_counter()
        try:
            while not self._stop.is_set():
                busy = engine.has_unfinished_requests()
                # Block only when idle; while busy, just pick up whatever has arrived.
                errors, work_arrived = self._drain(block=not busy)
                now = time.perf_counter()
                if not busy:
                    last_step_end = max(last_step_end, work_arrived or now)
                    engine.check_health()  # an idle engine's dead rank must not wait for the next request
                if not engine.has_unfinished_requests():
                    if errors:
                        self._deliver(EngineEvent(errors=errors))
                    continue
                stall = max(0.0, now - last_step_end)
                try:
                    outputs = engine.step()
                except EngineFailure:
                    raise  # the engine as a whole is gone: failing its requests would not help
                except Exception as exc:  # a bug must fail requests, not the worker
                    log.exception("engine step failed")
                    outputs = self.fail_all(exc)
                last_step_end = time.perf_counter()
                stats = engine.last_stats
                if stats.device_idle_s is not None:
                    # On a GPU the engine measures the device's own idle time before the step (CUDA
                    # events): the loop's wait plus whatever host work the pipeline did not hide.
                    stall = stats.device_idle_s
                self.running, self.waiting = stats.num_running, stats.num_waiting
                self._deliver(EngineEvent(outputs, errors, stats, engine.take_kv_events(), stall))
        except BaseException as exc:  # pragma: no cover - reported through `failed`
            self.failed = exc
            log.exception("engine thread died")
            if self.on_failure is not None:
                self.on_failure(exc)
            raise

    def _drain(self, block: bool) -> tuple[list[tuple[str, RequestError]], float | None]:
        errors: list[tuple[str, RequestError]] = []
        arrived: float | None = None
        try:
            cmd = self._commands.get(timeout=self._idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return errors, None
        while True:
            kind, payload = cmd
            if kind == "add":
                arrived = arrived or time.perf_counter()
                for job in payload:
                    try:
                        self.engine.add_request(job.request_id, job.prompt_token_ids, job.params, mask=job.mask,
                                                arrival_time=job.arrival_time, images=job.images)
                    except RequestError as exc:
                        errors.append((job.request_id, exc))
            elif kind == "abort":
                for rid in payload:
                    self.engine.abort_request(rid)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return errors, arrived

    def load(self) -> dict:
        """What the worker reports as its load: running and waiting requests as of the last step,
        and the KV cache's usage and prefix-cache counts as they are now."""
        bm = self.engine.block_manager
        return {
            "running": self.running,
            "waiting": self.waiting,
            "kv_usage": bm.usage,
            "hit_rate": bm.hit_rate,
            "queries": bm.prefix_queries,
            "hits": bm.prefix_hits,
        }

    def fail_all(self, exc: Exception) -> list[RequestOutput]:
        """Finish every request the engine holds with an internal error (after a failed step);
        returns their final outputs. Runs on the engine thread."""
        err = RequestError(f"internal engine error: {exc!r}", code="internal")
        outs: list[RequestOutput] = []
        for rid in list(self.engine.scheduler.requests):
            req = self.engine.scheduler.requests[rid]
            self.engine.scheduler.finish(req, "error")
            out = self.engine.output_processor.finish_without_token(req, "error", err)
            outs.append(out)
        return outs
