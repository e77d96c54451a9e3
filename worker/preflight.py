"""Start-up checks that need no model: the secrets can be read, Kafka lets the worker in, the
topics it answers on take records of kafka.max_message_bytes, and Redis takes its credentials.

`infinilm worker` runs them before it loads the model, so a wrong password, an
unreadable secret file or an untrusted certificate ends start-up within seconds
with the cause. Kept free of engine imports (torch) for the same reason.
"""

from __future__ import annotations

import structlog
from aiokafka.errors import KafkaError

from worker.config import ServiceConfig
from worker.config_types import ConfigError
from worker.kafka_clients import KafkaAccessError, check_kafka_access, topic_record_limits
from worker.state import RedisAuthError, RedisState

# What check_access raises; each message names the cause and never a secret.
ACCESS_ERRORS = (ConfigError, KafkaAccessError, RedisAuthError)


async def check_access(cfg: ServiceConfig, worker_id: str) -> None:
    """Raise one of ACCESS_ERRORS if the worker could not get in; an unreachable Redis is fine
    (the worker runs degraded without it), a refused Redis login is not."""
    for key, secret in cfg.secrets().items():
        try:
            secret.get()
        except ConfigError as exc:
            raise ConfigError(f"{key}: {exc}") from None
    await check_kafka_access(cfg.kafka, client_id=worker_id)
    await check_record_limits(cfg, worker_id)
    rc = cfg.redis
    # Only pings: a RedisState registers nothing until start().
    redis = RedisState(
        rc.url,
        worker_id=worker_id,
        model=cfg.model.name,
        socket_timeout_s=rc.socket_timeout_s,
        password=rc.password.get() if rc.password else None,
        username=rc.username,
    )
    try:
        await redis.check_credentials()
    finally:
        await redis.stop(deregister=False)


async def check_record_limits(cfg: ServiceConfig, worker_id: str) -> None:
    """Raise ConfigError if a topic the worker answers on takes smaller records than kafka.max_message_bytes:
    the worker cuts its results to that size (worker.record_size), so the broker would refuse a larger one,
    and a refused result holds up its partition's later results. A topic the broker will not describe is
    not checked (logged)."""
    topics = (cfg.topics.results, cfg.topics.dlq)  # deltas are one step's text each
    log = structlog.get_logger("infinilm.worker")
    try:
        limits, unchecked = await topic_record_limits(cfg.kafka, topics, client_id=worker_id)
    except (KafkaError, TimeoutError) as exc:
        log.warning("topic record limits not read", topics=list(topics), error=repr(exc))
        return
    if unchecked:
        log.warning("topic record limits not checked: missing or not described to this user", topics=unchecked)
    small = {topic: limit for topic, limit in limits.items() if limit < cfg.kafka.max_message_bytes}
    if small:
        listed = ", ".join(f"{topic} ({limit})" for topic, limit in small.items())
        raise ConfigError(
            f"kafka.max_message_bytes is {cfg.kafka.max_message_bytes}, over the max.message.bytes of {listed}: "
            "the broker would refuse a result that large and hold up its partition. Lower "
            "kafka.max_message_bytes, or raise the topics' max.message.bytes.")
