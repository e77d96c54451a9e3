"""Completion: engine events become deltas, results and metrics.

The outputs task reads the engine loop's events. A job's text goes out as a best-effort
delta; when every job of a request has finished, its handler turns the outputs into a
Result (or into a second round of work, handed back to the in-flight table for the
engine). A finished Result gets its timing, worker and model, and goes to its
partition's tracker, where the flusher picks it up; intake hands over the requests it
answers without the engine (errors, immediate results) the same way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec
import structlog
from aiokafka import TopicPartition

from engine import RequestError, RequestOutput
from schemas import Delta, ErrorCode, Result, Timing, add_usage, encode, error_result, result_key
from worker.engine_loop import EngineEvent
from worker.handlers import HandlerContext, Prepared, usage_of
from worker.inflight import InFlight, InFlightTable
from worker.metrics import WorkerMetrics
from worker.offsets import OutRecord, PartitionTracker
from worker.publisher import DeltaPublisher
from worker.record_size import DEFAULT_MAX_RECORD_BYTES, fit_result

log = structlog.get_logger("infinilm.worker")
CONTENT_TYPE = {"json": b"application/json", "msgpack": b"application/msgpack"}


class Completion:
    def __init__(self, *, table: InFlightTable, trackers: dict[TopicPartition, PartitionTracker],
                 deltas: DeltaPublisher, ctx: HandlerContext, metrics: WorkerMetrics, topics,
                 log_prompts: bool, redis, results_ready: asyncio.Event,
                 on_progress: Callable[[], None], speculative: bool = False,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> None:
        """`trackers`: the partitions' trackers, owned by partitions.Partitions; `results_ready`: the
        flusher's signal that a tracker got a finished result; `on_progress`: flow control, called
        after each engine event; `speculative`: the engine drafts, so its metrics are kept;
        `max_record_bytes`: the largest record the producers take (kafka.max_message_bytes)."""
        self.table = table
        self.trackers = trackers
        self.deltas = deltas
        self.ctx = ctx
        self.metrics = metrics
        self.topics = topics
        self._kind_topics = topics.request_topics
        self._topic_kinds = {topic: kind for kind, topic in self._kind_topics.items()}
        self._log_prompts = log_prompts
        self.redis = redis
        self._results_ready = results_ready
        self._on_progress = on_progress
        self._speculative = speculative
        self._max_record_bytes = max_record_bytes
        self._finishing: set[tuple[TopicPartition, int]] = set()  # requests whose handler is finishing them
        self._delta_tasks: set[asyncio.Task] = set()  # last deltas of failed requests, sent from a sync path

    # ---- engine events ---------------------------------------------------
    async def run(self, events: asyncio.Queue[EngineEvent]) -> None:
        while True:
            event = await events.get()
            try:
                await self.on_engine_event(event)
            except Exception:
                log.exception("failed to handle engine outputs")

    async def on_engine_event(self, ev: EngineEvent) -> None:
        for engine_id, err in ev.errors:
            fl = self.table.get(engine_id)
            if fl is not None:
                self._fail(fl, err.code, err.message)
        for out in ev.outputs:
            fl = self.table.get(out.request_id)
            if fl is None or fl.done:
                continue
            try:
                await self._on_output(fl, out)
            except Exception as exc:
                # One request's failure must not cost the others of this event their outputs: each of
                # those would stay unanswered, and hold back every later offset of its partition.
                log.exception("failed to handle an engine output", request_id=fl.request.id)
                message = f"internal error while handling its output: {type(exc).__name__}"
                if not fl.done:
                    self._fail(fl, ErrorCode.internal, message)
                elif (tracker := self.trackers.get(fl.tp)) is not None and tracker.awaits(fl.offset):
                    self.complete_failure(fl, ErrorCode.internal, message)  # failed while publishing its result
        if ev.stats is not None:
            st = ev.stats
            self.metrics.observe_step(
                num_seqs=st.step_num_seqs, num_scheduled_tokens=st.step_num_tokens, token_budget=st.step_token_budget,
                stall_s=ev.stall_s, kv_cache_usage=st.kv_usage, num_running=st.num_running,
                num_waiting=st.num_waiting, num_preemptions=st.num_preemptions,
                prefix_cache_hit_rate=st.prefix_cache_hit_rate,
            )
            if self._speculative:
                self.metrics.observe_speculation(st.spec_draft_tokens, st.spec_accepted_tokens)
        if ev.kv_events and self.redis is not None:
            await self.redis.publish_kv_events(ev.kv_events)
        self._on_progress()

    async def _on_output(self, fl: InFlight, out: RequestOutput) -> None:
        if self._speculative and out.new_token_ids:
            self.metrics.observe_step_tokens(fl.request.kind, len(out.new_token_ids))
        job = fl.engine_ids.index(out.request_id)
        fl.latest[job] = out
        if fl.stream[job]:
            if out.finished:
                # Its last delta waits for the handler: a second round would make this text void.
                fl.delta_tail += out.new_text
            elif out.new_text:
                await self._send_delta(fl, out.new_text)
        if not out.finished:
            return
        if out.error is not None:
            self._fail(fl, out.error.code, out.error.message)
            return
        if self.table.finish(out.request_id, out):
            key = (fl.tp, fl.offset)
            self._finishing.add(key)
            try:
                await self._finish(fl)
            finally:
                self._finishing.discard(key)

    def finishing_offsets(self, tp: TopicPartition) -> set[int]:
        """The offsets of partition `tp` whose requests left the engine and are being finished now."""
        return {offset for t, offset in self._finishing if t == tp}

    async def _finish(self, fl: InFlight) -> None:
        """Every job of `fl` has finished: its handler makes the Result, or asks for another round."""
        try:
            result = await fl.handler.finish(fl.request, fl.prepared, fl.outputs, self.ctx)
        except RequestError as exc:
            self._fail(fl, exc.code, exc.message)
            return
        except Exception as exc:
            log.exception("handler finish failed", request_id=fl.request.id)
            self._fail(fl, ErrorCode.internal, f"internal error while finishing: {type(exc).__name__}")
            return
        if fl.done:
            return  # answered or dropped while the handler finished (a deadline, a revoked partition)
        streamed = _streams(fl)
        if isinstance(result, Prepared):
            # A second round: back to the engine through the table. Its usage adds to this round's, and a
            # streaming client is told to drop the text so far before the new answer's deltas come.
            fl.earlier += fl.outputs
            tail, fl.delta_tail = fl.delta_tail, ""
            self.table.admit(fl, result)
            if streamed:
                if tail:
                    await self._send_delta(fl, tail)
                await self._send_delta(fl, "", restart=True)
            return
        fl.done = True
        if fl.earlier:
            result = msgspec.structs.replace(result, usage=add_usage(usage_of(fl.earlier), result.usage))
        self.complete(fl.tp, fl.offset, fl.request, result, fl.fmt, fl.consumed_at, fl.earlier + fl.outputs,
                      ignored=fl.ignored)
        if streamed:
            await self._send_delta(fl, fl.delta_tail, finished=True, finish_reason=result.finish_reason)

    def _fail(self, fl: InFlight, code: str, message: str) -> None:
        if self.table.withdraw(fl):
            self.complete_failure(fl, code, message)

    async def _send_delta(self, fl: InFlight, text: str, *, finished: bool = False,
                          finish_reason: str | None = None, restart: bool = False) -> None:
        delta = Delta(id=fl.request.id, index=fl.delta_index, text=text, finished=finished,
                      finish_reason=finish_reason, restart=restart)
        fl.delta_index += 1  # taken before the send: a delta sent meanwhile gets the next index
        await self.deltas.send(self.topics.deltas, fl.request.id.encode(), encode(delta, fl.fmt),
                               [("content-type", CONTENT_TYPE[fl.fmt])])

    # ---- results ---------------------------------------------------------
    def complete(self, tp: TopicPartition, offset: int, request, result: Result, fmt: str, consumed_at: float,
                 outputs: list[RequestOutput] | None = None, progress: list[RequestOutput] | None = None,
                 ignored: tuple[str, ...] = ()) -> None:
        """`outputs`: the finished jobs of an answered request; `progress`: a failed request's latest outputs,
        which give its timing but stay out of the latency metrics; `ignored`: the request's unread keys."""
        timing = _timing(consumed_at, outputs or progress)
        result = msgspec.structs.replace(result, timing=timing, worker=self.ctx.worker_id, model=self.ctx.model_name,
                                         ignored_fields=list(ignored) or None)
        fitted, value = fit_result(result, fmt, self._max_record_bytes)
        # Metric labels stay bounded: an unreadable kind counts under its topic's kind.
        kind = result.kind if result.kind in self._kind_topics else self._topic_kinds.get(tp.topic, "chat")
        if fitted is not result:
            self._note_cut(result, fitted, kind, len(value))
            result = fitted
        self._publish_result(tp, offset, result, value, fmt)
        status = "ok" if result.status == "ok" else result.error.code
        tokens = result.usage
        e2e = timing.total_ms / 1000
        tpot = None
        if outputs and tokens.completion_tokens > 1:
            tpot = max(0.0, (timing.total_ms - timing.ttft_ms) / 1000 / (tokens.completion_tokens - 1))
        self.metrics.observe_request_finished(
            kind, status, tokens.prompt_tokens, tokens.completion_tokens, tokens.cached_tokens,
            queue_s=timing.queue_ms / 1000 if outputs else None, ttft_s=timing.ttft_ms / 1000 if outputs else None,
            tpot_s=tpot, e2e_s=e2e,
        )
        if self._log_prompts:
            # Opt-in only: request and output text stay out of the logs by default.
            log.info("request text", request_id=result.id, output=result.text,
                     request=msgspec.to_builtins(request) if request is not None else None)
        log.debug("request finished", request_id=result.id, kind=kind, status=status, total_ms=timing.total_ms)

    def complete_error(self, tp: TopicPartition, offset: int, request_id: str, kind, code, message: str, fmt: str,
                       consumed_at: float, request=None, progress: list[RequestOutput] | None = None,
                       ignored: tuple[str, ...] = ()) -> None:
        """An error result; `progress`: the outputs of a request that failed on its way, for what it consumed."""
        # An asr chunk's error carries its stream, so it is keyed, and ordered, with the stream's other results.
        result = error_result(request_id, kind, code, message, stream_id=getattr(request, "stream_id", None),
                              seq=getattr(request, "seq", None), usage=usage_of(progress or []))
        self.complete(tp, offset, None, result, fmt, consumed_at, progress=progress, ignored=ignored)

    def complete_failure(self, fl: InFlight, code: str, message: str) -> None:
        """The in-flight table's failure sink: a request taken out of it early gets an error result, with the
        tokens it consumed; a streaming client gets a last delta that ends its stream."""
        progress = fl.earlier + [out for out in fl.latest if out is not None]
        self.complete_error(fl.tp, fl.offset, fl.request.id, fl.request.kind, code, message, fl.fmt, fl.consumed_at,
                            fl.request, progress, fl.ignored)
        if _streams(fl):
            task = asyncio.create_task(self._send_delta(fl, fl.delta_tail, finished=True, finish_reason="error"))
            self._delta_tasks.add(task)
            task.add_done_callback(self._last_delta_sent)

    def _last_delta_sent(self, task: asyncio.Task) -> None:
        self._delta_tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("last delta of a failed request not sent", error=repr(exc))  # best effort, as every delta

    def _note_cut(self, whole: Result, fitted: Result, kind: str, size: int) -> None:
        if fitted.status == "error":
            log.warning("result too large for one record; answered result_too_large", request_id=whole.id,
                        kind=kind, max_record_bytes=self._max_record_bytes)
            return
        for field in fitted.truncated[len(whole.truncated or ()):]:
            self.metrics.inc_result_truncated(kind, field)
        log.warning("result cut to fit one record", request_id=whole.id, kind=kind, cut=fitted.truncated,
                    kept_logprobs=len(fitted.logprobs) if fitted.logprobs is not None else None, bytes=size,
                    max_record_bytes=self._max_record_bytes)

    def _publish_result(self, tp: TopicPartition, offset: int, result: Result, value: bytes, fmt: str) -> None:
        tracker = self.trackers.get(tp)
        if tracker is None:
            return  # partition revoked: the new owner redoes it
        if not tracker.awaits(offset):
            # Answered already, or not taken (yet) by the partition's current set-up: after a resync the
            # record is fetched and answered again, so this result is not needed. Never a second answer.
            log.warning("result for an offset its partition does not wait for; dropped", partition=str(tp),
                        offset=offset, request_id=result.id)
            return
        record = OutRecord(self.topics.results, result_key(result), value,
                           (("content-type", CONTENT_TYPE[fmt]),))
        tracker.complete(offset, [record])
        self._results_ready.set()


def _streams(fl: InFlight) -> bool:
    """Whether `fl` has a stream to end: its work streams, or deltas went out in an earlier round."""
    return any(fl.stream) or fl.delta_index > 0


def _timing(consumed_at: float, outputs: list[RequestOutput] | None) -> Timing:
    now = time.monotonic()
    first_sched = min((o.metrics.first_scheduled_time for o in outputs or [] if o and o.metrics
                       and o.metrics.first_scheduled_time), default=None)
    first_tok = min((o.metrics.first_token_time for o in outputs or [] if o and o.metrics
                     and o.metrics.first_token_time), default=None)
    return Timing(
        queue_ms=round(((first_sched or now) - consumed_at) * 1000, 3),
        ttft_ms=round(((first_tok or now) - consumed_at) * 1000, 3),
        total_ms=round((now - consumed_at) * 1000, 3),
    )
