"""What the worker's start and shutdown use beside the wiring: the engine, the handlers, the clients and
their closing, its id, task stopping, and the event loop's handling of fenced producers' leftover futures."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import ProducerFenced

from worker.handlers import Handler, HandlerContext
from worker.handlers.asr import AsrHandler
from worker.handlers.chat import ChatHandler
from worker.handlers.images import ImageReader
from worker.handlers.risk import RiskHandler
from worker.kafka_clients import consumer_kwargs, producer_kwargs
from worker.metrics import WorkerMetrics
from worker.publisher import AtLeastOncePublisher, DeltaPublisher, TransactionalPublisher
from worker.state import RedisState

log = structlog.get_logger("infinilm.worker")


@dataclass
class Clients:
    """The worker's connections, built but not connected: Redis, the delta producer, the consumer and the
    results publisher (transactional for exactly-once delivery)."""

    redis: RedisState
    deltas: DeltaPublisher
    consumer: AIOKafkaConsumer
    publisher: TransactionalPublisher | AtLeastOncePublisher


def build_engine(thread, cfg):
    """The engine, built on the thread that will step it (engine_loop.EngineThread says why)."""
    from engine import EngineCore

    try:
        return thread.call(EngineCore, cfg.engine_config()).result()
    except BaseException:
        thread.close()
        raise


def build_handlers(engine, cfg, worker_id: str, metrics: WorkerMetrics) -> tuple[dict[str, Handler], HandlerContext]:
    """One handler per request kind, and the context they share (the Redis client is set at start)."""
    ctx = HandlerContext(
        tokenizer=engine.tokenizer, max_model_len=engine.max_model_len,
        max_num_batched_tokens=engine.config.max_num_batched_tokens, worker_id=worker_id,
        model_name=cfg.model.name, config=cfg, metrics=metrics, images=ImageReader.for_engine(engine, cfg.chat),
    )
    return {"chat": ChatHandler(), "risk": RiskHandler(), "asr": AsrHandler()}, ctx


def build_clients(cfg, worker_id: str, metrics: WorkerMetrics, *, load_fn) -> Clients:
    rc = cfg.redis
    redis = RedisState(
        rc.url, worker_id=worker_id, model=cfg.model.name, key_prefix=rc.key_prefix,
        index_ttl_s=rc.index_ttl_s, heartbeat_interval_s=rc.heartbeat_interval_s,
        stream_state_ttl_s=rc.stream_state_ttl_s, socket_timeout_s=rc.socket_timeout_s,
        event_buffer=rc.event_buffer, password=rc.password.get() if rc.password else None,
        username=rc.username, on_error=metrics.inc_redis_error, on_health_change=metrics.set_redis_up,
        load_fn=load_fn,
    )
    to_produce = producer_kwargs(cfg.kafka, client_id=worker_id)
    consumer = AIOKafkaConsumer(**consumer_kwargs(cfg.kafka, client_id=worker_id))
    if cfg.kafka.delivery == "exactly_once":
        publisher = TransactionalPublisher(to_produce, cfg.kafka.group_id, cfg.kafka.transactional_id_prefix,
                                           cfg.kafka.transaction_timeout_ms, metrics.inc_kafka_transaction,
                                           publish_timeout_s=cfg.kafka.transaction_timeout_ms / 1000)
    else:
        publisher = AtLeastOncePublisher(to_produce, consumer.commit, metrics.inc_kafka_transaction)
    return Clients(redis, DeltaPublisher(to_produce, on_error=lambda: None), consumer, publisher)


async def close_quietly(*closers: Callable[[], Awaitable]) -> None:
    """Close each client in order: one that fails to close must not keep the next from closing."""
    for close in closers:
        with contextlib.suppress(Exception):
            await close()


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


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


def quiet_fenced_futures(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """The event loop's exception handler: aiokafka's internal transaction futures that hold a
    ProducerFenced nobody awaited are expected after a fence (the publish that met it has already
    given the partition up), so they are logged at debug level instead of as errors."""
    if isinstance(context.get("exception"), ProducerFenced) and context.get("message", "").startswith(
            "Future exception was never retrieved"):
        log.debug("fenced producer left an unread future", detail=context["message"])
        return
    loop.default_exception_handler(context)


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("infinilm-stream")
    except PackageNotFoundError:
        return "dev"
