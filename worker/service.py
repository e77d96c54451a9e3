"""The worker: Kafka in, micro-batches to the engine thread, results out exactly once.

Tasks on the event loop:
- consume: poll, decode, hand requests to their handler, feed the batcher;
  pause every partition while too much is in flight, and keep polling;
- batch timer: flush buckets whose window is over;
- outputs: engine events -> deltas, results, metrics, KV events;
- flush: every flush interval, publish each partition's finished prefix with
  its offset (one transaction per partition);
- housekeeping: consumer lag.
The engine runs on its own thread (worker.engine_loop); nothing here waits on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError, ProducerFenced

from engine import EngineCore, RequestError, RequestOutput
from schemas import (
    DeadLetter,
    Delta,
    ErrorCode,
    ErrorInfo,
    Result,
    SchemaError,
    Timing,
    content_type_of,
    decode_request,
    encode,
    error_result,
    format_for_content_type,
    result_key,
    sniff_format,
)
from worker.batcher import Batch, BatchItem, make_batcher
from worker.engine_loop import EngineEvent, EngineJob, EngineLoop, EngineThread
from worker.handlers import Handler, HandlerContext, Prepared
from worker.handlers.asr import AsrHandler
from worker.handlers.chat import ChatHandler
from worker.handlers.risk import RiskHandler
from worker.http import HealthServer
from worker.kafka_clients import check_kafka_access, client_kwargs, producer_kwargs
from worker.memory import collect_cycles, freeze_startup_objects
from worker.metrics import WorkerMetrics
from worker.offsets import OutRecord, PartitionTracker
from worker.publisher import (
    AtLeastOncePublisher,
    DeltaPublisher,
    PartitionLost,
    PartitionResync,
    TransactionalPublisher,
    fit_dead_letter,
)
from worker.rules import RULE_KINDS
from worker.state import REDIS_OPS

log = structlog.get_logger("infinilm.worker")
CONTENT_TYPE = {"json": b"application/json", "msgpack": b"application/msgpack"}


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


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
    submitted_at: float | None = None
    done: bool = False
    job_error: RequestError | None = None
    extra: dict = field(default_factory=dict)


async def stop_tasks(tasks: list[asyncio.Task], timeout_s: float) -> list[str]:
    """Cancel `tasks` and wait for them, cancelling again every half second: a task whose
    cancellation was swallowed (Python 3.11's wait_for can lose one) gets another. Returns the
    names of those still running after `timeout_s`."""
    pending = {t for t in tasks if not t.done()}
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=min(0.5, left))
    return sorted(t.get_name() for t in pending)


class Worker:
    def __init__(self, config, worker_id: str | None = None, *, registry=None, engine: EngineCore | None = None) -> None:
        self.config = config
        self.worker_id = worker_id or config.worker.id or default_worker_id()
        self.metrics = WorkerMetrics(registry)
        # Built on the thread that will step it (EngineThread says why).
        self._engine_thread = EngineThread()
        if engine is None:
            try:
                engine = self._engine_thread.call(EngineCore, config.engine_config()).result()
            except BaseException:
                self._engine_thread.close()
                raise
        self.engine = engine
        self.model_name = config.model.name
        self.metrics.set_worker_info(self.worker_id, self.model_name, _version())
        self.metrics.declare_label_values(topics=config.topics.request_topics.values(), redis_ops=REDIS_OPS,
                                          rules=RULE_KINDS)
        self.handlers: dict[str, Handler] = {"chat": ChatHandler(), "risk": RiskHandler(), "asr": AsrHandler()}
        self.topics = config.topics
        self._kind_topics = config.topics.request_topics
        self._topic_kinds = {topic: kind for kind, topic in self._kind_topics.items()}
        self.ctx = HandlerContext(
            tokenizer=self.engine.tokenizer, max_model_len=self.engine.max_model_len,
            max_num_batched_tokens=self.engine.config.max_num_batched_tokens, worker_id=self.worker_id,
            model_name=self.model_name, config=config, metrics=self.metrics,
        )
        self.batcher = make_batcher(
            config.execution.batcher, max_seq_len=self.engine.max_model_len,
            max_batch_size=config.execution.max_batch_size, batch_timeout_s=config.execution.batch_timeout,
            num_buckets=config.execution.num_buckets,
        ) if config.execution.batcher == "dynamic_bucket" else make_batcher(
            "fifo", max_batch_size=config.execution.max_batch_size, batch_timeout_s=config.execution.batch_timeout)
        self.trackers: dict[TopicPartition, PartitionTracker] = {}
        self.inflight: dict[str, InFlight] = {}  # engine id -> request
        self.redis = None
        self._events: asyncio.Queue[EngineEvent] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = asyncio.Event()
        self._batch_wakeup = asyncio.Event()
        self._results_ready = asyncio.Event()  # a tracker got a finished result since the last flush
        self._paused = False
        self._started = False
        self.consumer: AIOKafkaConsumer | None = None
        self.publisher = None
        self.deltas: DeltaPublisher | None = None
        self.engine_loop: EngineLoop | None = None
        self.http: HealthServer | None = None
        self._tasks: list[asyncio.Task] = []
        self.stuck_tasks: list[str] = []  # set by shutdown(): tasks that would not stop
        self._prepare_tasks: dict[asyncio.Task, TopicPartition] = {}
        # Assigned partitions not set up yet (no producer, no tracker), kept paused: their set-up
        # is in progress, failed, or waits after a fence or an unknown transaction outcome.
        self._awaiting_setup: dict[TopicPartition, _SetUpWait] = {}
        self._setup_lock = asyncio.Lock()  # set-ups and revocations one at a time
        self._setup_retry: asyncio.Task | None = None
        self._watchdog_logged: dict[tuple, float] = {}

    # ---- lifecycle -------------------------------------------------------
    async def run(self) -> None:
        """Start, serve until stop() (or SIGTERM via the CLI), then shut down cleanly."""
        await self.start()
        try:
            await self._stopping.wait()
        finally:
            await self.shutdown()

    def stop(self) -> None:
        self._stopping.set()

    async def start(self) -> None:
        cfg = self.config
        # Before any thread or client starts: a refused login must end start-up with its
        # cause, not leave aiokafka retrying it for ever.
        await check_kafka_access(cfg.kafka, client_id=self.worker_id)
        self._loop = asyncio.get_running_loop()
        self._loop.set_exception_handler(quiet_fenced_futures)
        self._events = asyncio.Queue()
        self.engine_loop = EngineLoop(self.engine, lambda ev: self._loop.call_soon_threadsafe(self._events.put_nowait, ev),
                                      thread=self._engine_thread)
        self.engine_loop.start()
        if cfg.metrics.enabled:
            self.http = HealthServer(cfg.metrics.host, cfg.metrics.port, self.metrics.registry, self._health, self._ready)
            self.http.start()
        await self._start_redis()
        kwargs = client_kwargs(cfg.kafka, client_id=self.worker_id)
        to_produce = producer_kwargs(cfg.kafka, client_id=self.worker_id)
        self.deltas = DeltaPublisher(to_produce, on_error=lambda: None)
        await self.deltas.start()
        self.consumer = AIOKafkaConsumer(
            **kwargs,
            group_id=cfg.kafka.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
            max_poll_interval_ms=cfg.kafka.max_poll_interval_ms,
            session_timeout_ms=cfg.kafka.session_timeout_ms,
            heartbeat_interval_ms=cfg.kafka.heartbeat_interval_ms,
            max_partition_fetch_bytes=max(cfg.kafka.max_message_bytes * 2, 1 << 20),
            fetch_max_bytes=max(cfg.kafka.max_message_bytes * 4, 50 << 20),
        )
        if cfg.kafka.delivery == "exactly_once":
            self.publisher = TransactionalPublisher(to_produce, cfg.kafka.group_id, cfg.kafka.transactional_id_prefix,
                                                    cfg.kafka.transaction_timeout_ms, self.metrics.inc_kafka_transaction,
                                                    publish_timeout_s=cfg.kafka.transaction_timeout_ms / 1000)
        else:
            self.publisher = AtLeastOncePublisher(to_produce, self._commit_offsets, self.metrics.inc_kafka_transaction)
            await self.publisher.start()
        self.consumer.subscribe(list(self._kind_topics.values()), listener=_Rebalance(self))
        await self.consumer.start()
        # The model, tokenizer and clients are built: later full collections need not walk them.
        frozen = freeze_startup_objects()
        self._started = True
        self._tasks = [asyncio.create_task(coro, name=name) for name, coro in (
            ("consume", self._consume_loop()),
            ("batch-timer", self._batch_timer_loop()),
            ("outputs", self._output_loop()),
            ("flush", self._flush_loop()),
            ("housekeeping", self._housekeeping_loop()),
        )]
        for task in self._tasks:
            task.add_done_callback(self._task_done)
        log.info("worker started", model=self.model_name, topics=list(self._kind_topics.values()),
                 delivery=cfg.kafka.delivery, metrics_port=self.http.port if self.http else None,
                 gc_frozen_objects=frozen)

    def _task_done(self, task: asyncio.Task) -> None:
        # A loop that dies would silently stop the worker's progress: make it loud
        # and stop the worker, so its uncommitted work is redelivered elsewhere.
        if task.cancelled() or self._stopping.is_set():
            return
        exc = task.exception()
        log.error("worker task died; stopping the worker", task=task.get_name(),
                  error=repr(exc) if exc else "returned")
        self.stop()

    async def _start_redis(self) -> None:
        from worker.state import RedisState

        rc = self.config.redis
        self.redis = RedisState(
            rc.url, worker_id=self.worker_id, model=self.model_name, key_prefix=rc.key_prefix,
            index_ttl_s=rc.index_ttl_s, heartbeat_interval_s=rc.heartbeat_interval_s,
            stream_state_ttl_s=rc.stream_state_ttl_s, socket_timeout_s=rc.socket_timeout_s,
            event_buffer=rc.event_buffer, password=rc.password.get() if rc.password else None,
            username=rc.username, on_error=self.metrics.inc_redis_error,
            on_health_change=self.metrics.set_redis_up, load_fn=self._load,
        )
        self.ctx.redis = self.redis
        await self.redis.start()

    async def shutdown(self) -> None:
        """Stop fetching, finish in-flight work (bounded), commit, close."""
        if not self._started:
            return
        self._started = False
        timeout = self.config.worker.shutdown_timeout_s
        log.info("shutting down", in_flight=len(self.inflight), timeout_s=timeout)
        deadline = time.monotonic() + timeout  # the drain's bound counts from the signal
        self._stopping.set()
        consume = next((t for t in self._tasks if t.get_name() == "consume"), None)
        if consume:
            consume.cancel()
            await asyncio.gather(consume, return_exceptions=True)
        self._submit(self.batcher.drain())
        while (self.inflight or self._prepare_tasks) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for task in list(self._prepare_tasks):
            task.cancel()
        if self.inflight:
            log.warning("aborting unfinished requests; they will be redelivered", count=len(self.inflight))
            self.engine_loop.abort(list(self.inflight))
            self.inflight.clear()
        # Bounded: what is not committed by then is redelivered to the partition's next owner.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._flush_all(), timeout=max(10.0, timeout))
        # Leave the group before anything else can stall: a stopping worker that stayed in it
        # would be handed partitions again and sit on them (found by bench.chaos, where one
        # task ignored its cancellation and the shutdown never got this far).
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.consumer.stop(), timeout=max(10.0, timeout))
        self.stuck_tasks = await stop_tasks(self._tasks + [t for t in [self._setup_retry] if t], timeout_s=5.0)
        if self.stuck_tasks:
            log.error("tasks did not stop after repeated cancellation; the process will exit without them",
                      tasks=self.stuck_tasks)
        with contextlib.suppress(Exception):
            await self.publisher.close()
        with contextlib.suppress(Exception):
            await self.deltas.close()
        if self.redis is not None:
            with contextlib.suppress(Exception):
                await self.redis.stop()
        self.engine_loop.stop()
        if self.http:
            self.http.stop()
        log.info("worker stopped")

    # ---- intake ----------------------------------------------------------
    async def _consume_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                batch = await self.consumer.getmany(timeout_ms=100, max_records=256)
            except KafkaError as exc:
                log.warning("poll failed, retrying", error=repr(exc))
                await asyncio.sleep(0.5)
                continue
            for records in batch.values():
                for record in records:
                    if not await self._intake(record):
                        break  # the rest of this partition's batch is fetched again later
            self._update_pause()

    async def _intake(self, record) -> bool:
        """Take one record on; False when it must be fetched again (and the rest of its batch with it)."""
        tp = TopicPartition(record.topic, record.partition)
        tracker = self.trackers.get(tp)
        if tracker is None:
            if self.consumer is not None and tp in self.consumer.assignment():
                # NOTE: aiokafka installs a new assignment, and may fetch for it, before
                # on_assigned has finished starting the partition's producer. Skipping the record
                # here would lose it: the consumer's position has moved past it, and the next
                # commit on this partition would cover it. Go back to it and wait for on_assigned.
                self.consumer.seek(tp, record.offset)
                self.consumer.pause(tp)
                if tp not in self._awaiting_setup:
                    # on_assigned is on its way; the flush loop steps in only if it never comes.
                    self._await_setup(tp, "assignment in progress", retry_in_s=5.0)
                    log.info("partition not set up yet; will fetch again", partition=str(tp), offset=record.offset)
            # Otherwise it was revoked while the fetch was in flight; the new owner will see it.
            return False
        if record.offset < tracker.next_offset:
            # Fetched before the set-up moved the position to the group's committed offset
            # (or fetched twice): taken already, or committed by the partition's previous owner.
            return True
        tracker.register(record.offset)
        consumed_at = time.monotonic()
        payload = record.value or b""
        content_type = content_type_of(record.headers)
        fmt = format_for_content_type(content_type) or sniff_format(payload) or "msgpack"
        try:
            request = decode_request(payload, content_type, max_bytes=self.config.kafka.max_message_bytes)
        except SchemaError as exc:
            if exc.request_id is None:
                self._dead_letter(tp, record, exc.to_error_info())
            else:
                self._complete_error(tp, record.offset, exc.request_id, exc.kind, exc.code, exc.message, fmt,
                                     consumed_at)
            return True
        handler = self.handlers.get(request.kind)
        if handler is None:
            self._complete_error(tp, record.offset, request.id, request.kind, ErrorCode.unsupported_kind,
                                 f"this worker does not serve kind {request.kind!r} yet", fmt, consumed_at)
            return True
        if getattr(handler, "defer_prepare", False):
            # This handler may wait (an ASR chunk for its predecessor): run it beside
            # the consume loop, which must keep polling.
            task = asyncio.create_task(self._prepare(tp, record.offset, request, handler, fmt, consumed_at))
            self._prepare_tasks[task] = tp
            task.add_done_callback(self._prepare_tasks.pop)
        else:
            await self._prepare(tp, record.offset, request, handler, fmt, consumed_at)
        return True

    async def _prepare(self, tp, offset: int, request, handler: Handler, fmt: str, consumed_at: float) -> None:
        try:
            prepared = await handler.prepare(request, self.ctx)
        except RequestError as exc:
            self._complete_error(tp, offset, request.id, request.kind, exc.code, exc.message, fmt, consumed_at,
                                 request)
            return
        except Exception as exc:
            log.exception("handler prepare failed", request_id=request.id)
            self._complete_error(tp, offset, request.id, request.kind, ErrorCode.internal,
                                 f"internal error while preparing: {type(exc).__name__}", fmt, consumed_at, request)
            return
        if tp not in self.trackers:
            return  # revoked while preparing
        if prepared.result is not None or not prepared.work:
            result = prepared.result or await handler.finish(request, prepared, [], self.ctx)
            self._complete(tp, offset, request, result, fmt, consumed_at)
            return
        fl = InFlight(tp, offset, request, handler, prepared, fmt, consumed_at, [], [], [])
        self._enqueue(fl, prepared)

    def _enqueue(self, fl: InFlight, prepared: Prepared) -> None:
        """Hand a request's engine work to the batcher (again, for a handler's second round)."""
        fl.prepared = prepared
        fl.round += 1
        base = f"{fl.tp.topic}/{fl.tp.partition}/{fl.offset}"
        fl.engine_ids = [f"{base}/{i}" if fl.round == 1 else f"{base}/r{fl.round}/{i}"
                         for i in range(len(prepared.work))]
        fl.outputs = [None] * len(prepared.work)
        fl.stream = [w.stream for w in prepared.work]
        for engine_id, work in zip(fl.engine_ids, prepared.work, strict=True):
            self.inflight[engine_id] = fl
            ready = self.batcher.add(BatchItem(engine_id, len(work.prompt_token_ids), work.params.max_tokens,
                                               payload=work, arrival=time.monotonic()))
            self._submit(ready)
        self._batch_wakeup.set()

    def _submit(self, batches: list[Batch]) -> None:
        jobs: list[EngineJob] = []
        now_ms = time.time() * 1000
        for batch in batches:
            self.metrics.observe_batch_flush(batch.bucket, batch.padded_tokens - batch.useful_tokens)
            for item in batch.items:
                fl = self.inflight.get(item.key)
                if fl is None or fl.done:
                    continue  # revoked or already failed
                deadline = getattr(fl.request, "deadline_ms", None)
                if deadline is not None and now_ms > deadline:
                    self._fail_inflight(fl, ErrorCode.deadline_exceeded,
                                        f"deadline passed {now_ms - deadline:.0f} ms before the request could start")
                    continue
                fl.submitted_at = fl.submitted_at or time.monotonic()
                work = item.payload
                jobs.append(EngineJob(item.key, work.prompt_token_ids, work.params, work.mask, fl.consumed_at))
        self.engine_loop.submit(jobs)

    async def _batch_timer_loop(self) -> None:
        while not self._stopping.is_set():
            deadline = self.batcher.next_deadline()
            wait = 0.5 if deadline is None else max(0.0, deadline - time.monotonic())
            self._batch_wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._batch_wakeup.wait(), timeout=wait)
            self._submit(self.batcher.poll(time.monotonic()))

    # ---- outputs ---------------------------------------------------------
    async def _output_loop(self) -> None:
        while True:
            event = await self._events.get()
            try:
                await self._on_engine_event(event)
            except Exception:
                log.exception("failed to handle engine outputs")

    async def _on_engine_event(self, ev: EngineEvent) -> None:
        for engine_id, err in ev.errors:
            fl = self.inflight.get(engine_id)
            if fl is not None:
                self._fail_inflight(fl, err.code, err.message)
        for out in ev.outputs:
            fl = self.inflight.get(out.request_id)
            if fl is None or fl.done:
                continue
            idx = fl.engine_ids.index(out.request_id)
            if fl.stream[idx] and (out.new_text or out.finished):
                await self._send_delta(fl, out)
            if not out.finished:
                continue
            if out.error is not None:
                self._fail_inflight(fl, out.error.code, out.error.message)
                continue
            fl.outputs[idx] = out
            self.inflight.pop(out.request_id, None)
            if all(o is not None for o in fl.outputs):
                try:
                    result = await fl.handler.finish(fl.request, fl.prepared, fl.outputs, self.ctx)
                except RequestError as exc:
                    self._fail_inflight(fl, exc.code, exc.message)
                    continue
                except Exception as exc:
                    log.exception("handler finish failed", request_id=fl.request.id)
                    self._fail_inflight(fl, ErrorCode.internal, f"internal error while finishing: {type(exc).__name__}")
                    continue
                if isinstance(result, Prepared):
                    self._enqueue(fl, result)
                    continue
                fl.done = True
                self._complete(fl.tp, fl.offset, fl.request, result, fl.fmt, fl.consumed_at, fl.outputs)
        if ev.stats is not None:
            st = ev.stats
            self.metrics.observe_step(
                num_seqs=st.step_num_seqs, num_scheduled_tokens=st.step_num_tokens, token_budget=st.step_token_budget,
                stall_s=ev.stall_s, kv_cache_usage=st.kv_usage, num_running=st.num_running,
                num_waiting=st.num_waiting, num_preemptions=st.num_preemptions,
                prefix_cache_hit_rate=st.prefix_cache_hit_rate,
            )
            self._last_stats = st
        if ev.kv_events and self.redis is not None:
            await self.redis.publish_kv_events(ev.kv_events)
        self._update_pause()

    async def _send_delta(self, fl: InFlight, out: RequestOutput) -> None:
        delta = Delta(id=fl.request.id, index=fl.delta_index, text=out.new_text, finished=out.finished,
                      finish_reason=out.finish_reason if out.finished else None)
        fl.delta_index += 1
        await self.deltas.send(self.topics.deltas, fl.request.id.encode(), encode(delta, fl.fmt),
                               [("content-type", CONTENT_TYPE[fl.fmt])])

    # ---- completion --------------------------------------------------------
    def _timing(self, consumed_at: float, outputs: list[RequestOutput] | None) -> Timing:
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

    def _complete(self, tp, offset, request, result: Result, fmt: str, consumed_at: float,
                  outputs: list[RequestOutput] | None = None) -> None:
        import msgspec

        timing = self._timing(consumed_at, outputs)
        result = msgspec.structs.replace(result, timing=timing, worker=self.worker_id, model=self.model_name)
        self._publish_result(tp, offset, result, fmt)
        # Metric labels stay bounded: an unreadable kind counts under its topic's kind.
        kind = result.kind if result.kind in self._kind_topics else self._topic_kinds.get(tp.topic, "chat")
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
        if self.config.logging.log_prompts:
            # Opt-in only: request and output text stay out of the logs by default.
            log.info("request text", request_id=result.id, output=result.text,
                     request=msgspec.to_builtins(request) if request is not None else None)
        log.debug("request finished", request_id=result.id, kind=kind, status=status, total_ms=timing.total_ms)

    def _publish_result(self, tp, offset, result: Result, fmt: str) -> None:
        tracker = self.trackers.get(tp)
        if tracker is None:
            return  # partition revoked: the new owner redoes it
        record = OutRecord(self.topics.results, result_key(result), encode(result, fmt),
                           (("content-type", CONTENT_TYPE[fmt]),))
        tracker.complete(offset, [record])
        self._results_ready.set()

    def _complete_error(self, tp, offset, request_id: str, kind, code, message: str, fmt: str,
                        consumed_at: float, request=None) -> None:
        # An asr chunk's error carries its stream, so it is keyed, and ordered, with the stream's other results.
        result = error_result(request_id, kind, code, message, stream_id=getattr(request, "stream_id", None),
                              seq=getattr(request, "seq", None))
        self._complete(tp, offset, None, result, fmt, consumed_at)

    def _fail_inflight(self, fl: InFlight, code, message: str) -> None:
        if fl.done:
            return
        fl.done = True
        for engine_id in fl.engine_ids:
            self.inflight.pop(engine_id, None)
        pending = [eid for eid, out in zip(fl.engine_ids, fl.outputs, strict=True) if out is None]
        self.engine_loop.abort(pending)
        self._complete_error(fl.tp, fl.offset, fl.request.id, fl.request.kind, code, message, fl.fmt, fl.consumed_at,
                             fl.request)

    def _dead_letter(self, tp, record, reason: ErrorInfo) -> None:
        tracker = self.trackers.get(tp)
        if tracker is None:
            return
        payload, key, headers, reason = fit_dead_letter(
            record.value or b"", record.key, [(k, bytes(v or b"")) for k, v in (record.headers or ())], reason)
        letter = DeadLetter(topic=record.topic, partition=record.partition, offset=record.offset,
                            payload=payload, reason=reason, ts_ms=int(time.time() * 1000), key=key, headers=headers,
                            worker=self.worker_id)
        tracker.complete(record.offset, [OutRecord(self.topics.dlq, None, encode(letter, "msgpack"),
                                                   (("content-type", CONTENT_TYPE["msgpack"]),))])
        self._results_ready.set()
        self.metrics.inc_dlq(reason.code)
        log.warning("dead-lettered a record", topic=record.topic, partition=record.partition, offset=record.offset,
                    reason=reason.code)

    # ---- publishing --------------------------------------------------------
    async def _flush_loop(self) -> None:
        """Flush every flush_interval_ms; with eager_flush, also as soon as a result is finished,
        if the last flush of finished results started an interval ago or more. Either way those
        flushes start at most once per interval, so a partition commits at most one transaction
        per interval. Ticks with nothing finished (they retry set-ups and update flow control)
        do not count: a result after an idle spell is flushed at once."""
        interval = self.config.kafka.flush_interval_ms / 1000
        eager = self.config.kafka.eager_flush
        last = float("-inf")  # when the last flush of finished results started
        while True:
            if eager:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._results_ready.wait(), timeout=interval)
                if self._results_ready.is_set():
                    wait = last + interval - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
            else:
                await asyncio.sleep(interval)
            if self._results_ready.is_set():
                self._results_ready.clear()
                last = time.monotonic()
            await self._flush_all()

    async def _flush_all(self, only: list[TopicPartition] | None = None) -> None:
        releases = []
        for tp, tracker in list(self.trackers.items()):
            if only is not None and tp not in only:
                continue
            release = tracker.release()
            if release is not None:
                releases.append((tp, tracker, release))
        if releases:
            await self._publish_releases(releases)
        if only is None and not self._stopping.is_set():  # a stopping worker starts no producers
            self._retry_setups()
        self._update_pause()

    async def _publish_releases(self, releases: list) -> None:
        outcomes = await asyncio.gather(*(self.publisher.publish(r) for _, _, r in releases), return_exceptions=True)
        for (tp, tracker, release), outcome in zip(releases, outcomes, strict=True):
            if outcome is True:
                tracker.mark_committed(release)
            elif isinstance(outcome, PartitionLost):
                # Fenced: another worker has set the partition up, so this one is a zombie that
                # will be told by the next rebalance; in case the fencer was the zombie, this
                # worker sets the partition up again if no rebalance comes first.
                dropped = self._drop_partition(tp)
                log.warning("partition lost to another worker", partition=str(tp), dropped_in_flight=dropped)
                self._await_setup(tp, "fenced by another producer", retry_in_s=self._fenced_retry_s())
            elif isinstance(outcome, PartitionResync):
                dropped = self._drop_partition(tp)
                log.warning("resyncing partition: its in-flight work is dropped and redone from the committed offset",
                            partition=str(tp), reason=str(outcome), dropped_in_flight=dropped)
                self._await_setup(tp, "resync after an unknown transaction outcome", retry_in_s=0.0)
            else:
                if isinstance(outcome, BaseException):
                    log.warning("publish failed", partition=str(tp), error=repr(outcome))
                tracker.restore(release)

    async def _commit_offsets(self, offsets: dict[TopicPartition, int]) -> None:
        await self.consumer.commit(offsets)

    def _drop_partition(self, tp: TopicPartition) -> int:
        """Forget a partition this worker no longer owns; returns how many in-flight requests it dropped
        (the partition's next owner redoes them from the committed offset)."""
        self.trackers.pop(tp, None)
        for task, task_tp in list(self._prepare_tasks.items()):
            if task_tp == tp:
                task.cancel()
        lost = [eid for eid, fl in self.inflight.items() if fl.tp == tp]
        for eid in lost:
            self.inflight[eid].done = True
            self.inflight.pop(eid, None)
        self.engine_loop.abort(lost)
        return len(lost)

    # ---- flow control --------------------------------------------------------
    def _update_pause(self) -> None:
        if self.consumer is None or not self._started:
            return
        in_flight = sum(t.in_flight for t in self.trackers.values())
        limit = self.config.worker.max_inflight
        assigned = list(self.consumer.assignment())
        if not self._paused and in_flight >= limit:
            self._paused = True
            self.consumer.pause(*assigned)
            log.info("engine full: pausing partitions", in_flight=in_flight)
        elif self._paused and in_flight < limit * 0.75 and not self._stopping.is_set():
            self._paused = False
            self.consumer.resume(*(tp for tp in assigned if tp in self.trackers))

    async def on_assigned(self, assigned: set[TopicPartition]) -> None:
        t0 = time.monotonic()
        await self._set_up(assigned, "assigned")
        if self._paused or self._stopping.is_set():
            # Pausing is lost on reassignment; keep not fetching while full.
            self.consumer.pause(*assigned)
        log.info("partitions assigned", partitions=sorted(str(tp) for tp in assigned),
                 not_set_up=sorted(str(tp) for tp in assigned if tp not in self.trackers),
                 setup_s=round(time.monotonic() - t0, 3))

    async def _set_up(self, tps, reason: str) -> None:
        """Take partitions on: start their producers, then seek to the group's committed offsets.

        NOTE: the order is what makes the offsets right. A producer's InitProducerId fences the
        partition's previous owner and finishes whatever transaction it left (committing a
        prepared one), so only after it does the committed offset cover every result already
        published. aiokafka reads committed offsets on assignment, concurrently with this, so
        the position is read again here. A partition that fails to set up stays paused in
        `_awaiting_setup`, and the flush loop tries again.
        """
        async with self._setup_lock:
            tps = [tp for tp in sorted(tps) if tp in self.consumer.assignment() and tp not in self.trackers]
            if not tps:
                return
            failed = set(await self.publisher.add_partitions(tps))
            offsets = await self._committed_offsets([tp for tp in tps if tp not in failed])
            now = time.monotonic()
            for tp in tps:
                if tp not in self.consumer.assignment():
                    await self.publisher.remove_partitions([tp])  # revoked meanwhile
                elif tp in offsets and self._seek(tp, offsets[tp]):
                    self.trackers[tp] = PartitionTracker(tp.topic, tp.partition, start_offset=offsets[tp])
                    waited = self._awaiting_setup.pop(tp, None)
                    if waited is not None and now - waited.since > 1.0:
                        log.info("partition set up", partition=str(tp), after=waited.reason,
                                 waited_s=round(now - waited.since, 1))
                    if not (self._paused or self._stopping.is_set()):
                        self.consumer.resume(tp)
                else:
                    self._await_setup(tp, f"{reason}: set-up failed", retry_in_s=1.0)

    def _seek(self, tp: TopicPartition, committed: int | None) -> bool:
        """Move the position to `committed`; with nothing committed, to offset 0 (a resynced
        partition may have been read further). Below the log's start, 0 is out of range and the
        consumer's auto_offset_reset ("earliest") applies. No round trip: set-up must stay quick,
        as the group waits for it."""
        try:
            self.consumer.seek(tp, 0 if committed is None else committed)
            return True
        except KafkaError as exc:  # IllegalStateError: revoked meanwhile
            log.warning("could not set the position; will retry", partition=str(tp), error=repr(exc))
            return False

    async def _committed_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int | None]:
        """The group's committed offset of each partition (None: nothing committed yet); a
        partition whose offset could not be read is left out."""
        async def one(tp):
            async with asyncio.timeout(self.config.kafka.request_timeout_ms / 1000):
                return await self.consumer.committed(tp)

        outcomes = await asyncio.gather(*(one(tp) for tp in tps), return_exceptions=True)
        offsets = {}
        for tp, outcome in zip(tps, outcomes, strict=True):
            if isinstance(outcome, asyncio.CancelledError):
                raise outcome
            if isinstance(outcome, BaseException):
                log.warning("could not read the committed offset; will retry", partition=str(tp), error=repr(outcome))
            else:
                offsets[tp] = outcome
        return offsets

    def _await_setup(self, tp: TopicPartition, reason: str, retry_in_s: float) -> None:
        if self.consumer is None or tp not in self.consumer.assignment():
            return  # revoked: the next owner sets it up
        now = time.monotonic()
        wait = self._awaiting_setup.get(tp)
        if wait is None:
            self._awaiting_setup[tp] = _SetUpWait(reason, now, now + retry_in_s)
        else:
            wait.reason, wait.retry_at = reason, now + retry_in_s
        self.consumer.pause(tp)

    def _fenced_retry_s(self) -> float:
        # Long enough for a rebalance to reach a zombie (session timeout), so the two do not fence in turn.
        return max(10.0, 2 * self.config.kafka.session_timeout_ms / 1000)

    def _retry_setups(self) -> None:
        """Set up again, beside the flush loop, the partitions whose wait is over."""
        if self._setup_retry is not None and not self._setup_retry.done():
            return
        now = time.monotonic()
        due = [tp for tp, wait in self._awaiting_setup.items() if wait.retry_at <= now]
        if due:
            self._setup_retry = asyncio.create_task(self._set_up(due, "retry"), name="partition-setup")
            self._setup_retry.add_done_callback(_log_failure)

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        revoked = set(revoked)
        if not revoked:
            return
        await self._flush_all(only=list(revoked))
        dropped = 0
        async with self._setup_lock:  # a set-up in progress must not start a producer after this
            for tp in revoked:
                self._awaiting_setup.pop(tp, None)
                dropped += self._drop_partition(tp)
            await self.publisher.remove_partitions(list(revoked))
        log.info("partitions revoked", partitions=sorted(str(tp) for tp in revoked), dropped_in_flight=dropped)

    def _watchdog(self, now: float) -> None:
        """Log what keeps a partition from progressing: a slow transaction or a set-up that waits."""
        slow_s = 10.0
        seen = set()
        for tp, stage, age in self.publisher.busy(now):
            if age >= slow_s:
                seen.add(("txn", tp))
                self._log_stall(("txn", tp), now, "Kafka transaction is slow", partition=str(tp), stage=stage,
                                seconds=round(age, 1))
        for tp, wait in self._awaiting_setup.items():
            if now - wait.since >= slow_s:
                seen.add(("setup", tp))
                self._log_stall(("setup", tp), now, "partition is waiting to be set up", partition=str(tp),
                                reason=wait.reason, seconds=round(now - wait.since, 1))
        for key in set(self._watchdog_logged) - seen:
            del self._watchdog_logged[key]

    def _log_stall(self, key: tuple, now: float, event: str, **fields) -> None:
        if now - self._watchdog_logged.get(key, -1e9) >= 30.0:  # at most every 30 s per partition
            self._watchdog_logged[key] = now
            log.warning(event, **fields)

    async def _housekeeping_loop(self) -> None:
        while True:
            await asyncio.sleep(5)
            self._watchdog(time.monotonic())
            # Dropped fetch buffers are reference cycles that pin whole fetch responses (worker/memory.py).
            self.metrics.observe_gc(*collect_cycles())
            lags: dict[str, int] = {}
            for tp in list(self.consumer.assignment()):
                try:
                    high = self.consumer.highwater(tp)
                    pos = await self.consumer.position(tp)
                except Exception:
                    continue
                if high is not None:
                    lags[tp.topic] = lags.get(tp.topic, 0) + max(0, high - pos)
            for topic, lag in lags.items():
                self.metrics.set_consumer_lag(topic, lag)
            if self.redis is not None:
                with contextlib.suppress(Exception):
                    rate = await self.redis.cluster_hit_rate()
                    if rate is not None:
                        self.metrics.set_cluster_kv_cache_hit_rate(rate)

    # ---- health --------------------------------------------------------------
    def _load(self) -> dict:
        st = getattr(self, "_last_stats", None)
        bm = self.engine.block_manager
        return {
            "running": st.num_running if st else 0,
            "waiting": st.num_waiting if st else 0,
            "kv_usage": bm.usage,
            "hit_rate": bm.hit_rate,
            "queries": bm.prefix_queries,
            "hits": bm.prefix_hits,
        }

    def _health(self) -> tuple[bool, dict]:
        alive = self.engine_loop is not None and self.engine_loop.alive
        return alive, {"engine_thread": alive}

    def _ready(self) -> tuple[bool, dict]:
        alive = self.engine_loop is not None and self.engine_loop.alive
        assigned = len(self.consumer.assignment()) if self.consumer else 0
        redis_ok = bool(self.redis and self.redis.healthy)
        detail = {
            "engine_thread": alive,
            "kafka_started": self._started,
            "assigned_partitions": assigned,
            "redis": "ok" if redis_ok else "degraded",
            "in_flight": len(self.inflight),
            "paused": self._paused,
            "partitions_awaiting_setup": len(self._awaiting_setup),
        }
        # Redis down degrades the service but does not make it unready.
        return alive and self._started, detail


def quiet_fenced_futures(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """The event loop's exception handler: aiokafka's internal transaction futures that hold a
    ProducerFenced nobody awaited are expected after a fence (the publish that met it has already
    given the partition up), so they are logged at debug level instead of as errors."""
    if isinstance(context.get("exception"), ProducerFenced) and context.get("message", "").startswith(
            "Future exception was never retrieved"):
        log.debug("fenced producer left an unread future", detail=context["message"])
        return
    loop.default_exception_handler(context)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task failed", task=task.get_name(), error=repr(task.exception()))


@dataclass
class _SetUpWait:
    reason: str
    since: float
    retry_at: float


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def on_partitions_revoked(self, revoked):
        await self.worker.on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned):
        await self.worker.on_assigned(set(assigned))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("infinilm-stream")
    except PackageNotFoundError:
        return "dev"
