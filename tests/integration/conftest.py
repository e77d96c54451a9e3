"""Fixtures for tests that talk to the real local stack (Kafka + Redis).

The session starts the stack once through devstack.stack_up, the same code
path as `infinilm stack up` and CI, and leaves it running afterwards. Every
test gets its own topics, consumer groups and transactional ids (uuid
suffixes), so tests never see each other's records or offsets and can run in
any order, against a broker that other people are using too.
"""

from __future__ import annotations

import contextlib
import re
import sys
import uuid
from collections.abc import Callable, Iterator

import pytest

from devstack import StackConfig, StackStatus, delete_topics, ensure_topics, stack_up
from tests.integration.worker_harness import WorkerProcess, make_topics, write_config


@pytest.fixture(scope="session")
def stack_config() -> StackConfig:
    """The stack's config; honours INFINILM_STATE_DIR and INFINILM_CACHE_DIR."""
    return StackConfig()


@pytest.fixture(scope="session")
def local_stack(stack_config: StackConfig, pytestconfig: pytest.Config) -> Iterator[StackStatus]:
    """Starts (or reuses) Kafka and Redis for the whole session and leaves them running."""
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")

    def progress(message: str) -> None:
        # The first run fetches Kafka with Maven for a minute or two; say so instead of
        # sitting silent behind pytest's output capture.
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            print(f"[stack] {message}", file=sys.stderr, flush=True)

    status = stack_up(stack_config, progress=progress)
    assert status.up, status
    yield status


@pytest.fixture(scope="session")
def kafka_bootstrap(local_stack: StackStatus, stack_config: StackConfig) -> str:
    return stack_config.bootstrap_servers


@pytest.fixture(scope="session")
def redis_url(local_stack: StackStatus, stack_config: StackConfig) -> str:
    return stack_config.redis_url


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> Callable[[str], str]:
    """unique_name("group") -> "test.<test name>.group.<8 hex>": a fresh name per call."""
    test = re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name)[:80]

    def make(kind: str) -> str:
        return f"test.{test}.{kind}.{uuid.uuid4().hex[:8]}"

    return make


@pytest.fixture
def make_topic(
    stack_config: StackConfig, local_stack: StackStatus, unique_name: Callable[[str], str]
) -> Iterator[Callable[..., str]]:
    """make_topic("in", partitions=1) creates a fresh topic (leaders ready) and deletes it after the test."""
    created: list[str] = []

    def make(kind: str = "topic", partitions: int = 1) -> str:
        name = unique_name(kind)
        ensure_topics(stack_config, [name], partitions)
        created.append(name)
        return name

    yield make
    if created:
        delete_topics(stack_config, created)


@pytest.fixture
def worker_setup(tmp_path, make_topic, unique_name, kafka_bootstrap, redis_url, tiny_llama):
    topics = make_topics(make_topic)
    group = unique_name("group")
    workers: list[WorkerProcess] = []

    def start(worker_id: str = "w1", model: str | None = None, **sections) -> WorkerProcess:
        cfg = write_config(tmp_path / f"{worker_id}.yaml", model=model or str(tiny_llama), topics=topics,
                           group=group, bootstrap=kafka_bootstrap, redis_url=redis_url, **sections)
        w = WorkerProcess(cfg, worker_id, tmp_path / f"{worker_id}.log").start()
        workers.append(w)
        return w

    yield topics, start
    for w in workers:
        w.stop()
