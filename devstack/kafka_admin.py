"""Kafka admin calls for the local stack: is the broker serving, and the topics it holds.

Every call is synchronous, for the CLI and pytest fixtures: `run_sync` runs the coroutine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from aiokafka.admin import AIOKafkaAdminClient, NewPartitions, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, for_code

from devstack.config import StackConfig
from devstack.processes import StackError, port_open

log = logging.getLogger(__name__)

T = TypeVar("T")


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    # Callers are sync (CLI, pytest fixtures) or already inside an event loop (a worker);
    # asyncio.run refuses to nest, so the second kind gets a loop on a helper thread.
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def kafka_answers(cfg: StackConfig) -> bool:
    if not port_open(cfg.kafka_host, cfg.kafka_port):
        return False
    try:
        return run_sync(_kafka_has_broker(cfg))
    except Exception as exc:  # starting up, or not Kafka at all: either way it does not answer yet
        log.debug("Kafka not ready: %r", exc)
        return False


async def _with_admin(cfg: StackConfig, timeout_s: float, work: Callable[[AIOKafkaAdminClient], Any]) -> Any:
    admin = AIOKafkaAdminClient(
        bootstrap_servers=cfg.bootstrap_servers,
        client_id="infinilm-stack",
        request_timeout_ms=int(timeout_s * 1000),
        **cfg.kafka_client_kwargs(),
    )
    try:
        async with asyncio.timeout(timeout_s):
            await admin.start()
            return await work(admin)
    finally:
        await admin.close()


async def _kafka_has_broker(cfg: StackConfig) -> bool:
    async def work(admin: AIOKafkaAdminClient) -> bool:
        # The broker only serves metadata listing itself once it is unfenced and can take requests.
        return bool((await admin.describe_cluster()).get("brokers"))

    return await _with_admin(cfg, 5.0, work)


async def describe_topics(cfg: StackConfig, names: Sequence[str], timeout_s: float) -> dict[str, int]:
    async def work(admin: AIOKafkaAdminClient) -> dict[str, int]:
        return {
            t["topic"]: len(t["partitions"])
            for t in await admin.describe_topics(list(names))
            if t["error_code"] == 0
        }

    return await _with_admin(cfg, timeout_s, work)


async def _ensure_topics(cfg: StackConfig, names: list[str], partitions: int) -> dict[str, int]:
    async def work(admin: AIOKafkaAdminClient) -> dict[str, int]:
        existing = {t["topic"]: t for t in await admin.describe_topics(names) if t["error_code"] == 0}
        missing = [n for n in names if n not in existing]
        if missing:
            response = await admin.create_topics(
                [NewTopic(name, num_partitions=partitions, replication_factor=1) for name in missing]
            )
            for topic, code, *message in response.topic_errors:
                error = for_code(code)
                if code and error is not TopicAlreadyExistsError:
                    raise StackError(f"creating topic {topic} failed: {error.__name__} {message}")
        # Never shrinks: Kafka cannot, and growing only happens when asked for more.
        grow = {
            n: NewPartitions(partitions) for n, t in existing.items() if len(t["partitions"]) < partitions
        }
        if grow:
            log.warning("Growing partitions to %d for %s", partitions, sorted(grow))
            await admin.create_partitions(grow)
        # Creation returns once the controller has committed it; wait until every partition
        # has a leader so callers can produce right away.
        while True:
            described = await admin.describe_topics(names)
            ready = {
                t["topic"]: len(t["partitions"])
                for t in described
                if t["error_code"] == 0 and t["partitions"] and all(p["leader"] >= 0 for p in t["partitions"])
            }
            if len(ready) == len(set(names)) and all(ready[n] >= partitions for n in names):
                return ready
            await asyncio.sleep(0.2)

    return await _with_admin(cfg, 60.0, work)


def ensure_topics(
    cfg: StackConfig | None = None,
    topics: Sequence[str] | None = None,
    partitions: int | None = None,
) -> dict[str, int]:
    """Create missing topics (replication factor 1) and grow any with fewer partitions.

    Returns topic -> partition count once every partition has a leader, so producers and
    consumers can use the topics as soon as this returns.
    """
    cfg = cfg or StackConfig()
    names = list(cfg.topics if topics is None else topics)
    if not names:
        return {}
    return run_sync(_ensure_topics(cfg, names, partitions or cfg.partitions))


def delete_topics(cfg: StackConfig | None = None, topics: Sequence[str] = ()) -> None:
    """Best-effort delete, errors ignored: test cleanup that keeps the shared dev broker small."""
    cfg = cfg or StackConfig()
    if topics:
        run_sync(_with_admin(cfg, 30.0, lambda admin: admin.delete_topics(list(topics))))
