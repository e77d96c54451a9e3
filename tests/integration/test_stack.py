"""The local stack itself: up, status, topics, Redis, and a full down -> up cycle."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from typer.testing import CliRunner

from cli import app
from devstack import (
    DEFAULT_TOPICS,
    StackConfig,
    StackStatus,
    delete_topics,
    ensure_topics,
    stack_down,
    stack_status,
    stack_up,
)
from tests.integration.redis_server import free_port

# Generous because the first test of a fresh machine also pays for the Maven fetch and broker start.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_up_is_idempotent(stack_config: StackConfig, local_stack: StackStatus) -> None:
    again = stack_up(stack_config)
    assert again.up
    # Reused, not restarted: whatever process answered before still does.
    assert again.kafka.pid == local_stack.kafka.pid
    assert again.redis.pid == local_stack.redis.pid


def test_status_reports_both_up(stack_config: StackConfig, local_stack: StackStatus) -> None:
    status = stack_status(stack_config)
    assert status.up
    assert status.kafka.address == stack_config.bootstrap_servers == "127.0.0.1:9092"
    assert status.redis.address == "127.0.0.1:6379"
    if status.kafka.pid is not None:
        # Started by this stack, so its logs are in the state folder.
        assert status.kafka.log_path.is_relative_to(stack_config.state_dir)
        assert status.kafka.log_path.exists()


def test_default_topics_exist_with_configured_partitions(
    stack_config: StackConfig, local_stack: StackStatus
) -> None:
    topics = stack_status(stack_config).topics
    assert set(DEFAULT_TOPICS) <= set(topics)
    # `stack up --partitions N` may have grown them beyond the default; they never shrink.
    assert all(topics[name] >= stack_config.partitions for name in DEFAULT_TOPICS)


def test_ensure_topics_creates_then_grows(
    stack_config: StackConfig, local_stack: StackStatus, unique_name: Callable[[str], str]
) -> None:
    name = unique_name("topic")
    try:
        assert ensure_topics(stack_config, [name], 2) == {name: 2}
        assert ensure_topics(stack_config, [name], 2) == {name: 2}
        assert ensure_topics(stack_config, [name], 4) == {name: 4}
    finally:
        delete_topics(stack_config, [name])


def test_redis_answers(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5)
    key = f"test:stack:{uuid.uuid4().hex}"
    try:
        assert client.ping()
        client.set(key, b"value", ex=60)
        assert client.get(key) == b"value"
    finally:
        client.delete(key)
        client.close()


def test_cli_status_shows_both_up(local_stack: StackStatus) -> None:
    result = CliRunner().invoke(app, ["stack", "status"])
    assert result.exit_code == 0, result.output
    assert "kafka" in result.output and "redis" in result.output
    assert "infinilm.results" in result.output


@pytest.mark.slow
def test_down_then_up_on_a_private_stack(
    tmp_path: Path, stack_config: StackConfig, local_stack: StackStatus
) -> None:
    # Its own ports and state folder, so cycling it never disturbs the shared stack;
    # the jar cache is shared, so no second Maven fetch.
    cfg = StackConfig(
        state_dir=tmp_path / "stack",
        cache_dir=stack_config.cache_dir,
        kafka_port=free_port(),
        controller_port=free_port(),
        redis_port=free_port(),
        partitions=2,
        topics=("private.requests",),
        kafka_heap="256m",
    )
    try:
        first = stack_up(cfg)
        assert first.up and first.kafka.pid and first.redis.pid
        assert first.topics == {"private.requests": 2}
        assert cfg.kafka_log.exists() and cfg.redis_log.exists()

        stack_down(cfg)
        down = stack_status(cfg)
        assert not down.kafka.up and not down.redis.up
        assert not cfg.kafka_pid_file.exists() and not cfg.redis_pid_file.exists()

        second = stack_up(cfg)
        assert second.up
        assert second.kafka.pid != first.kafka.pid
        # The data folder survived the restart: the topic was kept, not recreated.
        assert second.topics == {"private.requests": 2}
    finally:
        stack_down(cfg)
