"""The start-up check that the topics a worker answers on take records of kafka.max_message_bytes (the
broker's side: tests/integration/test_worker.py)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import structlog
from aiokafka.errors import KafkaConnectionError

from worker import preflight
from worker.config import load_config
from worker.config_types import ConfigError


def config(max_message_bytes: int):
    cfg = load_config(None, env={})
    return msgspec.structs.replace(cfg, kafka=msgspec.structs.replace(cfg.kafka, max_message_bytes=max_message_bytes))


def described(limits: dict[str, int], unchecked: list[str] = (), raises: Exception | None = None):
    asked = []

    async def topic_record_limits(kafka_cfg, topics, client_id):
        asked.append(tuple(topics))
        if raises is not None:
            raise raises
        return limits, list(unchecked)

    return topic_record_limits, asked


def test_a_topic_that_takes_smaller_records_stops_the_start(monkeypatch):
    fake, asked = described({"infinilm.results": 1 << 20, "infinilm.dlq": 65536})
    monkeypatch.setattr(preflight, "topic_record_limits", fake)
    with pytest.raises(ConfigError) as info:
        asyncio.run(preflight.check_record_limits(config(1 << 20), "w1"))
    assert str(info.value).startswith("kafka.max_message_bytes is 1048576, over the max.message.bytes of "
                                      "infinilm.dlq (65536): the broker would refuse")
    assert asked == [("infinilm.results", "infinilm.dlq")]
    asyncio.run(preflight.check_record_limits(config(65536), "w1"))  # equal is fine


@pytest.mark.parametrize("outcome", ["unchecked", "error"])
def test_topics_the_broker_will_not_describe_are_logged_not_refused(monkeypatch, outcome):
    fake, _ = (described({"infinilm.results": 4 << 20}, ["infinilm.dlq"]) if outcome == "unchecked"
               else described({}, raises=KafkaConnectionError("gone")))
    monkeypatch.setattr(preflight, "topic_record_limits", fake)
    with structlog.testing.capture_logs() as logs:
        asyncio.run(preflight.check_record_limits(config(1 << 20), "w1"))
    [warning] = [e for e in logs if e["log_level"] == "warning"]
    if outcome == "unchecked":
        assert warning["topics"] == ["infinilm.dlq"] and "not checked" in warning["event"]
    else:
        assert "gone" in warning["error"] and "not read" in warning["event"]
