"""A worker process on fresh topics of the local stack, for the Kafka benchmarks."""

from __future__ import annotations

import contextlib
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def worker_on_fresh_topics(model: str, name: str, **sections) -> Iterator[tuple]:
    """Start the stack if needed, create topics `bench.<name>.<kind>.<id>` (3 partitions), start
    `infinilm worker` on them with the test harness's config updated by `sections`, and wait until
    it is ready. Yields (worker, topics, bootstrap servers); stops the worker and deletes the
    topics afterwards."""
    from devstack import StackConfig, delete_topics, ensure_topics, stack_up
    from tests.integration.worker_harness import Topics, WorkerProcess, write_config

    stack = StackConfig()
    stack_up(stack)
    suffix = uuid.uuid4().hex[:8]
    names = {k: f"bench.{name}.{k}.{suffix}" for k in ("chat", "asr", "risk", "results", "deltas", "dlq")}
    ensure_topics(stack, list(names.values()), 3)
    topics = Topics(**names)
    tmp = Path(tempfile.mkdtemp(prefix=f"kafka-{name}-"))
    cfg = write_config(tmp / "worker.yaml", model=model, topics=topics, group=f"bench-{name}-{suffix}",
                       bootstrap=stack.bootstrap_servers, redis_url=stack.redis_url,
                       **{"logging": {"level": "warning", "format": "json"}, **sections})
    worker = WorkerProcess(cfg, f"bench-{suffix}", tmp / "worker.log").start()
    try:
        worker.wait_ready(timeout=300)
        yield worker, topics, stack.bootstrap_servers
    finally:
        worker.stop()
        delete_topics(stack, list(names.values()))
