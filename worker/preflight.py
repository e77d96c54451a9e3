"""Start-up checks that need no model: the secrets can be read, Kafka lets the worker in,
and Redis takes its credentials.

`infinilm worker` runs them before it loads the model, so a wrong password, an
unreadable secret file or an untrusted certificate ends start-up within seconds
with the cause. Kept free of engine imports (torch) for the same reason.
"""

from __future__ import annotations

from worker.config import ServiceConfig
from worker.config_types import ConfigError
from worker.kafka_clients import KafkaAccessError, check_kafka_access
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
