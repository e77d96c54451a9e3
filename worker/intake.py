"""Intake: a Kafka record becomes a prepared request, an answer, or a dead letter.

The consume task polls, registers each record's offset with its partition's tracker,
decodes it and hands it to its kind's handler. Prepared engine work enters the
in-flight table; a request answered without the engine (an error, an immediate
result) goes straight to completion; a record too broken to answer is dead-lettered
onto its partition's tracker.
"""

from __future__ import annotations

import asyncio
import time

import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from engine import RequestError
from schemas import (
    DeadLetter,
    ErrorCode,
    ErrorInfo,
    SchemaError,
    content_type_of,
    decode_request,
    encode,
    format_for_content_type,
    sniff_format,
    unknown_request_fields,
)
from worker.completion import CONTENT_TYPE, Completion
from worker.handlers import Handler, HandlerContext
from worker.inflight import InFlight, InFlightTable
from worker.metrics import WorkerMetrics
from worker.offsets import OutRecord
from worker.partitions import Partitions
from worker.record_size import fit_dead_letter

log = structlog.get_logger("infinilm.worker")


class Intake:
    def __init__(self, *, consumer: AIOKafkaConsumer, partitions: Partitions, handlers: dict[str, Handler],
                 ctx: HandlerContext, table: InFlightTable, completion: Completion, metrics: WorkerMetrics,
                 dlq_topic: str, max_message_bytes: int, results_ready: asyncio.Event) -> None:
        """`results_ready`: the flusher's signal, set when a dead letter lands on a tracker."""
        self.consumer = consumer
        self.partitions = partitions
        self.handlers = handlers
        self.ctx = ctx
        self.table = table
        self.completion = completion
        self.metrics = metrics
        self._dlq_topic = dlq_topic
        self._max_message_bytes = max_message_bytes
        self._results_ready = results_ready
        self.preparing: dict[asyncio.Task, TopicPartition] = {}  # deferred prepares, by partition
        self._preparing_offsets: dict[TopicPartition, set[int]] = {}  # every prepare under way, inline or deferred

    async def run(self, stopping: asyncio.Event) -> None:
        """The consume loop: poll, take each record on, update flow control."""
        while not stopping.is_set():
            try:
                batch = await self.consumer.getmany(timeout_ms=100, max_records=256)
            except KafkaError as exc:
                log.warning("poll failed, retrying", error=repr(exc))
                await asyncio.sleep(0.5)
                continue
            for records in batch.values():
                for record in records:
                    if not await self.take(record):
                        break  # the rest of this partition's batch is fetched again later
            self.partitions.update_pause()

    def cancel_prepares(self, tp: TopicPartition | None = None) -> None:
        """Cancel the deferred prepares of partition `tp` (all of them if None)."""
        for task, task_tp in list(self.preparing.items()):
            if tp is None or task_tp == tp:
                task.cancel()

    async def take(self, record) -> bool:
        """Take one record on; False when it must be fetched again (and the rest of its batch with it)."""
        tp = TopicPartition(record.topic, record.partition)
        tracker = self.partitions.trackers.get(tp)
        if tracker is None:
            self.partitions.fetched_before_setup(tp, record.offset)
            return False
        if record.offset < tracker.next_offset:
            # Fetched before the set-up moved the position to the group's committed offset
            # (or fetched twice): taken already, or committed by the partition's previous owner.
            return True
        tracker.register(record.offset)
        consumed_at = time.monotonic()
        payload = record.value  # None: a tombstone, which decode_request names as one
        content_type = content_type_of(record.headers)
        fmt = format_for_content_type(content_type) or sniff_format(payload) or "msgpack"
        try:
            request = decode_request(payload, content_type, max_bytes=self._max_message_bytes)
        except SchemaError as exc:
            if exc.request_id is None:
                self._dead_letter(tp, record, exc.to_error_info())
            else:
                # The error carries an ASR chunk's stream_id and seq where they were readable.
                self.completion.complete_error(tp, record.offset, exc.request_id, exc.kind, exc.code, exc.message,
                                               fmt, consumed_at, exc)
            return True
        ignored: tuple[str, ...] = ()
        if unknown := unknown_request_fields(payload, content_type, request):
            self.metrics.inc_ignored_fields(request.kind)
            ignored = tuple(f.path for f in unknown)
            if self.ctx.config.worker.unknown_fields == "reject":
                names = ", ".join(f.describe() for f in unknown)
                self.completion.complete_error(
                    tp, record.offset, request.id, request.kind, ErrorCode.invalid_request,
                    f"unknown field(s) {names}: this service does not read them (worker.unknown_fields: reject)",
                    fmt, consumed_at, request, ignored=ignored)
                return True
        handler = self.handlers.get(request.kind)
        if handler is None:
            self.completion.complete_error(tp, record.offset, request.id, request.kind, ErrorCode.unsupported_kind,
                                           f"this worker does not serve kind {request.kind!r} yet", fmt, consumed_at,
                                           ignored=ignored)
            return True
        prepare = self._prepare(tp, record.offset, request, handler, fmt, consumed_at, ignored)
        if getattr(handler, "defer_prepare", False):
            # This handler may wait (an ASR chunk for its predecessor): run it beside
            # the consume loop, which must keep polling.
            task = asyncio.create_task(prepare)
            self.preparing[task] = tp
            task.add_done_callback(self.preparing.pop)
        else:
            await prepare
        return True

    def preparing_offsets(self, tp: TopicPartition) -> set[int]:
        """The offsets of partition `tp` whose requests are being prepared now."""
        return set(self._preparing_offsets.get(tp, ()))

    async def _prepare(self, tp: TopicPartition, offset: int, request, handler: Handler, fmt: str,
                       consumed_at: float, ignored: tuple[str, ...]) -> None:
        working = self._preparing_offsets.setdefault(tp, set())
        working.add(offset)
        try:
            await self._prepare_one(tp, offset, request, handler, fmt, consumed_at, ignored)
        finally:
            working.discard(offset)
            if not working and self._preparing_offsets.get(tp) is working:
                del self._preparing_offsets[tp]

    async def _prepare_one(self, tp: TopicPartition, offset: int, request, handler: Handler, fmt: str,
                           consumed_at: float, ignored: tuple[str, ...]) -> None:
        try:
            prepared = await handler.prepare(request, self.ctx)
        except RequestError as exc:
            self.completion.complete_error(tp, offset, request.id, request.kind, exc.code, exc.message, fmt,
                                           consumed_at, request, ignored=ignored)
            return
        except Exception as exc:
            log.exception("handler prepare failed", request_id=request.id)
            self.completion.complete_error(tp, offset, request.id, request.kind, ErrorCode.internal,
                                           f"internal error while preparing: {type(exc).__name__}", fmt,
                                           consumed_at, request, ignored=ignored)
            return
        if tp not in self.partitions.trackers:
            return  # revoked while preparing
        if prepared.result is not None or not prepared.work:
            result = prepared.result or await handler.finish(request, prepared, [], self.ctx)
            self.completion.complete(tp, offset, request, result, fmt, consumed_at, ignored=ignored)
            return
        self.table.admit(InFlight(tp, offset, request, handler, prepared, fmt, consumed_at, [], [], [],
                                  ignored=ignored), prepared)

    def _dead_letter(self, tp: TopicPartition, record, reason: ErrorInfo) -> None:
        tracker = self.partitions.trackers.get(tp)
        if tracker is None:
            return
        payload, key, headers, reason = fit_dead_letter(
            record.value or b"", record.key, [(k, bytes(v or b"")) for k, v in (record.headers or ())], reason,
            self._max_message_bytes)
        letter = DeadLetter(topic=record.topic, partition=record.partition, offset=record.offset,
                            payload=payload, reason=reason, ts_ms=int(time.time() * 1000), key=key, headers=headers,
                            worker=self.ctx.worker_id)
        tracker.complete(record.offset, [OutRecord(self._dlq_topic, None, encode(letter, "msgpack"),
                                                   (("content-type", CONTENT_TYPE["msgpack"]),))])
        self._results_ready.set()
        self.metrics.inc_dlq(reason.code)
        log.warning("dead-lettered a record", topic=record.topic, partition=record.partition, offset=record.offset,
                    reason=reason.code)
