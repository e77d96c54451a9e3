"""The worker: Kafka in, micro-batches to the engine thread, results out exactly once.

`Worker` wires the parts, starts them and shuts them down in order. A request's path,
one file each, top to bottom:

  intake.py      record -> decode -> handler.prepare (or an error result, or a dead letter)
  inflight.py    engine ids, batches to the engine loop (engine_loop.py, its own thread)
  completion.py  engine events -> deltas, the handler's Result, metrics -> partition tracker
  flusher.py     each partition's finished prefix and its offset, one transaction per partition

Beside the path: partitions.py (assign, revoke, set-up, fencing, pause, watchdog) and
health.py (/healthz, /readyz, load, housekeeping); lifecycle.py builds the clients and stops
tasks. Nothing on the event loop waits on the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

import structlog

from engine import EngineCore
from worker.batcher import make_batcher
from worker.completion import Completion
from worker.engine_loop import EngineEvent, EngineLoop, EngineThread
from worker.flusher import Flusher
from worker.health import Health
from worker.http import HealthServer
from worker.inflight import InFlightTable
from worker.intake import Intake
from worker.kafka_clients import check_kafka_access
from worker.lifecycle import (
    build_clients,
    build_engine,
    build_handlers,
    close_quietly,
    default_worker_id,
    package_version,
    quiet_fenced_futures,
    stop_tasks,
)
from worker.memory import freeze_startup_objects
from worker.metrics import WorkerMetrics
from worker.partitions import Partitions, Rebalance
from worker.publisher import AtLeastOncePublisher
from worker.rules import RULE_KINDS
from worker.state import REDIS_OPS

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer

    from worker.publisher import DeltaPublisher, TransactionalPublisher
    from worker.state import RedisState

log = structlog.get_logger("infinilm.worker")


class Worker:
    def __init__(self, config, worker_id: str | None = None, *, registry=None, engine: EngineCore | None = None) -> None:
        self.config = config
        self.worker_id = worker_id or config.worker.id or default_worker_id()
        self.metrics = WorkerMetrics(registry)
        self._engine_thread = EngineThread()
        self.engine = engine if engine is not None else build_engine(self._engine_thread, config)
        self.model_name = config.model.name
        self.metrics.set_worker_info(self.worker_id, self.model_name, package_version())
        self.metrics.declare_label_values(topics=config.topics.request_topics.values(), redis_ops=REDIS_OPS,
                                          rules=RULE_KINDS)
        self.handlers, self.ctx = build_handlers(self.engine, config, self.worker_id, self.metrics)
        self.batcher = make_batcher(
            config.execution.batcher, max_seq_len=self.engine.max_model_len,
            max_batch_size=config.execution.max_batch_size, batch_timeout_s=config.execution.batch_timeout,
            num_buckets=config.execution.num_buckets)
        self._stopping = asyncio.Event()
        self._started = False
        # Built by start(), in this order.
        self.engine_loop: EngineLoop | None = None
        self.redis: RedisState | None = None
        self.deltas: DeltaPublisher | None = None
        self.consumer: AIOKafkaConsumer | None = None
        self.publisher: TransactionalPublisher | AtLeastOncePublisher | None = None
        self.partitions: Partitions | None = None
        self.inflight: InFlightTable | None = None
        self.completion: Completion | None = None
        self.flusher: Flusher | None = None
        self.intake: Intake | None = None
        self.health: Health | None = None
        self.http: HealthServer | None = None
        self._tasks: list[asyncio.Task] = []
        self.stuck_tasks: list[str] = []  # set by shutdown(): tasks that would not stop
        self.engine_failure: BaseException | None = None  # why the engine died under the worker, if it did

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
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(quiet_fenced_futures)
        events: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self.engine_loop = EngineLoop(self.engine, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
                                      thread=self._engine_thread)
        self.engine_loop.on_failure = lambda exc: loop.call_soon_threadsafe(self._engine_failed, exc)
        self.engine_loop.start()
        clients = build_clients(self.config, self.worker_id, self.metrics, load_fn=self.engine_loop.load)
        self.redis, self.deltas, self.consumer, self.publisher = (clients.redis, clients.deltas, clients.consumer,
                                                                  clients.publisher)
        self.ctx.redis = self.redis
        self._wire()
        if cfg.metrics.enabled:
            self.http = HealthServer(cfg.metrics.host, cfg.metrics.port, self.metrics.registry, self.health.healthz,
                                     self.health.readyz)
            self.http.start()
        await self.redis.start()
        await self.deltas.start()
        if isinstance(self.publisher, AtLeastOncePublisher):
            await self.publisher.start()
        topics = list(cfg.topics.request_topics.values())
        self.consumer.subscribe(topics, listener=Rebalance(self.partitions, self._flush_revoked))
        await self.consumer.start()
        # The model, tokenizer and clients are built: later full collections need not walk them.
        frozen = freeze_startup_objects()
        self._started = self.partitions.active = True
        self._tasks = [asyncio.create_task(coro, name=name) for name, coro in (
            ("consume", self.intake.run(self._stopping)),
            ("batch-timer", self.inflight.run_batch_timer(self._stopping)),
            ("outputs", self.completion.run(events)),
            ("flush", self.flusher.run()),
            ("housekeeping", self.health.run_housekeeping()),
        )]
        for task in self._tasks:
            task.add_done_callback(self._task_done)
        log.info("worker started", model=self.model_name, topics=topics, delivery=cfg.kafka.delivery,
                 metrics_port=self.http.port if self.http else None, gc_frozen_objects=frozen)

    def _wire(self) -> None:
        """Build the parts, each given only what it uses."""
        cfg = self.config
        self.partitions = Partitions(self.consumer, self.publisher, cfg, self._stopping, self._forget_work)
        self.flusher = Flusher(self.partitions, self.publisher, flush_interval_s=cfg.kafka.flush_interval_ms / 1000,
                               eager=cfg.kafka.eager_flush, stopping=self._stopping)
        # The table's failures become error results: completion is built next, so look it up late.
        self.inflight = InFlightTable(self.batcher, self.engine_loop, self.metrics,
                                      on_failed=lambda fl, code, message: self.completion.complete_failure(
                                          fl, code, message), max_running=cfg.execution.max_num_seqs)
        self.completion = Completion(
            table=self.inflight, trackers=self.partitions.trackers, deltas=self.deltas, ctx=self.ctx,
            metrics=self.metrics, topics=cfg.topics, log_prompts=cfg.logging.log_prompts, redis=self.redis,
            results_ready=self.flusher.results_ready, on_progress=self.partitions.update_pause,
            speculative=cfg.speculative.method is not None, max_record_bytes=cfg.kafka.max_message_bytes,
        )
        self.intake = Intake(
            consumer=self.consumer, partitions=self.partitions, handlers=self.handlers, ctx=self.ctx,
            table=self.inflight, completion=self.completion, metrics=self.metrics, dlq_topic=cfg.topics.dlq,
            max_message_bytes=cfg.kafka.max_message_bytes, results_ready=self.flusher.results_ready,
        )
        self.health = Health(engine_loop=self.engine_loop, consumer=self.consumer, partitions=self.partitions,
                             table=self.inflight, redis=self.redis, metrics=self.metrics,
                             working=self._working_offsets)

    def _working_offsets(self, tp) -> set[int]:
        """Partition `tp`'s offsets whose requests are being prepared, batched, generated or finished."""
        return self.inflight.offsets(tp) | self.intake.preparing_offsets(tp) | self.completion.finishing_offsets(tp)

    def _forget_work(self, tp) -> int:
        """A partition is gone: cancel its prepares and drop its in-flight requests."""
        self.intake.cancel_prepares(tp)
        return self.inflight.drop_partition(tp)

    async def _flush_revoked(self, revoked: list) -> None:
        await self.flusher.flush_all(only=revoked, complete=True)

    def _task_done(self, task: asyncio.Task) -> None:
        # A loop that dies would silently stop the worker's progress: make it loud
        # and stop the worker, so its uncommitted work is redelivered elsewhere.
        if task.cancelled() or self._stopping.is_set():
            return
        exc = task.exception()
        log.error("worker task died; stopping the worker", task=task.get_name(),
                  error=repr(exc) if exc else "returned")
        self.stop()

    def _engine_failed(self, exc: BaseException) -> None:
        # Nothing in flight can finish now: stop, so the uncommitted work is redelivered to another worker.
        log.error("the engine failed; stopping the worker", error=repr(exc))
        self.engine_failure = exc
        self.stop()

    async def shutdown(self) -> None:
        """Stop fetching, finish in-flight work (bounded), commit, close."""
        if not self._started:
            return
        self._started = self.partitions.active = False
        timeout = self.config.worker.shutdown_timeout_s
        log.info("shutting down", in_flight=len(self.inflight), timeout_s=timeout)
        deadline = time.monotonic() + timeout  # the drain's bound counts from the signal
        self._stopping.set()
        await stop_tasks([t for t in self._tasks if t.get_name() == "consume"], timeout_s=5.0)
        self.inflight.drain()
        while ((len(self.inflight) or self.intake.preparing) and time.monotonic() < deadline
               and self.engine_loop.alive):  # a dead engine finishes nothing: no reason to wait
            await asyncio.sleep(0.05)
        self.intake.cancel_prepares()
        if len(self.inflight):
            log.warning("aborting unfinished requests; they will be redelivered", count=len(self.inflight))
            self.inflight.abort_all()
        # Bounded: what is not committed by then is redelivered to the partition's next owner.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.flusher.flush_all(complete=True), timeout=max(10.0, timeout))
        # Leave the group before anything else can stall: a stopping worker that stayed in it
        # would be handed partitions again and sit on them.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.consumer.stop(), timeout=max(10.0, timeout))
        retry = self.partitions.setup_retry
        self.stuck_tasks = await stop_tasks(self._tasks + ([retry] if retry else []), timeout_s=5.0)
        if self.stuck_tasks:
            log.error("tasks did not stop after repeated cancellation; the process will exit without them",
                      tasks=self.stuck_tasks)
        await close_quietly(self.publisher.close, self.deltas.close, self.redis.stop)
        self.engine_loop.stop()
        if not self.engine_loop.alive:  # never under a step that is still running
            self.engine.close()  # the tensor-parallel ranks, if any
        if self.http:
            self.http.stop()
        log.info("worker stopped")
