"""A worker process on fresh topics of the local stack, for the Kafka benchmarks."""

from __future__ import annotations

import contextlib
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def fresh_topics(name: str) -> Iterator[tuple]:
    """Start the stack if needed and create topics `bench.<name>.<kind>.<id>` (3 partitions). Yields
    (topics, bootstrap servers); deletes the topics afterwards."""
    from devstack import StackConfig, delete_topics, ensure_topics, stack_up
    from tests.integration.worker_harness import Topics

    stack = StackConfig()
    stack_up(stack)
    suffix = uuid.uuid4().hex[:8]
    names = {k: f"bench.{name}.{k}.{suffix}" for k in ("chat", "asr", "risk", "results", "deltas", "dlq")}
    ensure_topics(stack, list(names.values()), 3)
    try:
        yield Topics(**names), stack.bootstrap_servers
    finally:
        delete_topics(stack, list(names.values()))


@contextlib.contextmanager
def worker_on_fresh_topics(model: str, name: str, **sections) -> Iterator[tuple]:
    """`fresh_topics`, then `infinilm worker` on them with the test harness's config updated by `sections`,
    ready. Yields (worker, topics, bootstrap servers); stops the worker afterwards."""
    from devstack import StackConfig
    from tests.integration.worker_harness import WorkerProcess, write_config

    stack = StackConfig()
    with fresh_topics(name) as (topics, bootstrap):
        tmp = Path(tempfile.mkdtemp(prefix=f"kafka-{name}-"))
        cfg = write_config(tmp / "worker.yaml", model=model, topics=topics, group=f"bench-{name}-{topics.chat[-8:]}",
                           bootstrap=bootstrap, redis_url=stack.redis_url,
                           **{"logging": {"level": "warning", "format": "json"}, **sections})
        worker = WorkerProcess(cfg, f"bench-{topics.chat[-8:]}", tmp / "worker.log").start()
        try:
            worker.wait_ready(timeout=300)
            yield worker, topics, bootstrap
        finally:
            worker.stop()
