"""The in-flight table: every request whose work is with the batcher or the engine.

A prepared request enters with `admit`, which gives each of its engine jobs an id
(topic/partition/offset/index, and /rN/ for a handler's second round) and hands the
jobs to the batcher. Released batches go to the engine loop; a request whose deadline
has passed is failed instead: withdrawn, and handed with its error to the failure sink
(completion's error path). Completion looks requests up here by engine id and takes them
out when they finish, or withdraws them when they fail.

NOTE: the batcher only holds work while the engine is full. The table counts the jobs the
engine holds, and whenever fewer than `max_running` are there, it releases that much
room from the batcher at once (`Batcher.release`): a batching window never delays a job
that the engine could start now.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiokafka import TopicPartition

from engine import RequestOutput
from schemas import ErrorCode
from worker.batcher import Batch, Batcher, BatchItem
from worker.engine_loop import EngineJob, EngineLoop
from worker.handlers import Handler, Prepared
from worker.metrics import WorkerMetrics


@dataclass
class InFlight:
    """One consumed request until its result is handed to its partition tracker."""

    tp: TopicPartition
    offset: int
    request: Any
    handler: Handler
    prepared: Prepared
    fmt: str
    consumed_at: float
    outputs: list[RequestOutput | None]
    engine_ids: list[str]
    stream: list[bool]
    delta_index: int = 0
    round: int = 0  # how many times work was handed to the engine (a handler may ask for a second round)
    done: bool = False
    # What the result reports as consumed and when the first token came: each job's latest output this
    # round, and the finished outputs of earlier rounds.
    latest: list[RequestOutput | None] = field(default_factory=list)
    earlier: list[RequestOutput] = field(default_factory=list)
    # A streamed job's last text, held back until the request's outcome says whether it is final.
    delta_tail: str = ""
    ignored: tuple[str, ...] = ()  # the request's keys no field reads, named in its result


# How often the batch timer looks for requests past their deadline, at the longest.
EXPIRY_CHECK_S = 0.5

# Called with a request taken out of the table by `fail`, its error code and message.
FailureSink = Callable[[InFlight, str, str], None]


class InFlightTable:
    def __init__(self, batcher: Batcher, engine_loop: EngineLoop, metrics: WorkerMetrics,
                 on_failed: FailureSink, max_running: int) -> None:
        self.batcher = batcher
        self.max_running = max_running
        self._in_engine: set[str] = set()  # engine ids submitted and not yet finished or withdrawn
        self.engine_loop = engine_loop
        self.metrics = metrics
        self._on_failed = on_failed
        self._entries: dict[str, InFlight] = {}  # engine id -> request
        self._wakeup = asyncio.Event()  # the batch timer's next deadline may have moved

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, engine_id: str) -> InFlight | None:
        return self._entries.get(engine_id)

    def offsets(self, tp: TopicPartition) -> set[int]:
        """The offsets of partition `tp` whose requests are here (with the batcher or the engine)."""
        return {fl.offset for fl in self._entries.values() if fl.tp == tp}

    def admit(self, fl: InFlight, prepared: Prepared) -> None:
        """Hand a request's engine work to the batcher (again, for a handler's second round)."""
        fl.prepared = prepared
        fl.round += 1
        base = f"{fl.tp.topic}/{fl.tp.partition}/{fl.offset}"
        fl.engine_ids = [f"{base}/{i}" if fl.round == 1 else f"{base}/r{fl.round}/{i}"
                         for i in range(len(prepared.work))]
        fl.outputs = [None] * len(prepared.work)
        fl.latest = [None] * len(prepared.work)
        fl.stream = [w.stream for w in prepared.work]
        for engine_id, work in zip(fl.engine_ids, prepared.work, strict=True):
            self._entries[engine_id] = fl
            ready = self.batcher.add(BatchItem(engine_id, len(work.prompt_token_ids) + work.image_positions,
                                               work.params.max_tokens,
                                               payload=work, arrival=time.monotonic()))
            self.submit(ready)
        self.submit(self.batcher.release(self.room()))
        self._wakeup.set()

    def room(self) -> int:
        """How many more jobs the engine can run at once now."""
        return max(0, self.max_running - len(self._in_engine))

    def submit(self, batches: list[Batch]) -> None:
        """Send released batches to the engine, failing the requests whose deadline has passed."""
        jobs: list[EngineJob] = []
        now_ms = time.time() * 1000
        for batch in batches:
            self.metrics.observe_batch_flush(batch.bucket, batch.padded_tokens - batch.useful_tokens)
            for item in batch.items:
                fl = self._entries.get(item.key)
                if fl is None or fl.done:
                    continue  # revoked or already failed
                deadline = getattr(fl.request, "deadline_ms", None)
                if deadline is not None and now_ms > deadline:
                    self.fail(fl, ErrorCode.deadline_exceeded, deadline_message(deadline, now_ms, "could start"))
                    continue
                work = item.payload
                jobs.append(EngineJob(item.key, work.prompt_token_ids, work.params, work.mask, fl.consumed_at,
                                      work.images))
                self._in_engine.add(item.key)
        self.engine_loop.submit(jobs)

    async def run_batch_timer(self, stopping: asyncio.Event) -> None:
        """Release the batcher's buckets whose window is over, and room the engine has; fail what expired."""
        while not stopping.is_set():
            deadline = self.batcher.next_deadline()
            wait = EXPIRY_CHECK_S if deadline is None else min(EXPIRY_CHECK_S, max(0.0, deadline - time.monotonic()))
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout=wait)
            self.expire(time.time() * 1000)
            self.submit(self.batcher.poll(time.monotonic()))
            self.submit(self.batcher.release(self.room()))

    def expire(self, now_ms: float) -> int:
        """Fail every request whose deadline_ms has passed, wherever its work is (batcher or engine): its
        engine work is aborted and it is answered with deadline_exceeded. Returns how many."""
        expired = {id(fl): fl for fl in self._entries.values()
                   if not fl.done and (d := getattr(fl.request, "deadline_ms", None)) is not None and now_ms > d}
        for fl in expired.values():
            self.fail(fl, ErrorCode.deadline_exceeded, deadline_message(fl.request.deadline_ms, now_ms, "finished"))
        return len(expired)

    def drain(self) -> None:
        """Send everything the batcher still holds (shutdown)."""
        self.submit(self.batcher.drain())

    def finish(self, engine_id: str, out: RequestOutput) -> bool:
        """Record one job's last output; True when every job of its request has finished."""
        fl = self._entries.pop(engine_id)
        self._in_engine.discard(engine_id)
        self._wakeup.set()  # room for a waiting job: the batch timer releases it
        fl.outputs[fl.engine_ids.index(engine_id)] = out
        return all(o is not None for o in fl.outputs)

    def withdraw(self, fl: InFlight) -> bool:
        """Take a request out before it finished and abort its engine work; False if it was done already."""
        if fl.done:
            return False
        fl.done = True
        for engine_id in fl.engine_ids:
            self._entries.pop(engine_id, None)
            self._in_engine.discard(engine_id)
        self._wakeup.set()
        pending = [eid for eid, out in zip(fl.engine_ids, fl.outputs, strict=True) if out is None]
        self.engine_loop.abort(pending)
        return True

    def fail(self, fl: InFlight, code: str, message: str) -> None:
        """Withdraw a request and hand it, with its error, to the failure sink."""
        if self.withdraw(fl):
            self._on_failed(fl, code, message)

    def drop_partition(self, tp: TopicPartition) -> int:
        """Forget a revoked or lost partition's requests and abort their engine work; returns how many
        (the partition's next owner redoes them from the committed offset)."""
        lost = [eid for eid, fl in self._entries.items() if fl.tp == tp]
        for eid in lost:
            self._entries[eid].done = True
            self._entries.pop(eid, None)
            self._in_engine.discard(eid)
        self._wakeup.set()
        self.engine_loop.abort(lost)
        return len(lost)

    def abort_all(self) -> int:
        """Abort every unfinished request (shutdown); they are redelivered. Returns how many."""
        count = len(self._entries)
        if count:
            self.engine_loop.abort(list(self._entries))
            self._entries.clear()
            self._in_engine.clear()
        return count


# A deadline_ms this small lies decades in the past as an epoch time: the sender meant a duration.
_EPOCH_MS_FLOOR = 10**12


def deadline_message(deadline_ms: int, now_ms: float, before: str) -> str:
    text = f"deadline passed {now_ms - deadline_ms:.0f} ms before the request {before}"
    if deadline_ms < _EPOCH_MS_FLOOR:
        text += (f" (deadline_ms is a Unix epoch time in milliseconds; {deadline_ms} is "
                 f"{deadline_ms / 1000:g} s after 1970)")
    return text
