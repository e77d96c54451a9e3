"""The connection to Redis and its health: timeouts, degradation, reconnect pings, error counting.

Redis is never on the critical path: while it is down or slow, `guarded` returns the
caller's safe default within the operation timeout, and `healthy` stays False until a
ping succeeds again. Nothing here ever logs the URL or a password.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from redis import exceptions as rexc
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

log = logging.getLogger(__name__)

T = TypeVar("T")

# Errors that mean "Redis is unavailable": they flip `healthy`. OSError covers refused
# connects and asyncio's TimeoutError; READONLY means we reached a replica after a failover.
UNAVAILABLE: tuple[type[BaseException], ...] = (
    rexc.ConnectionError,
    rexc.TimeoutError,
    rexc.ReadOnlyError,
    OSError,
)
_AUTH_ERRORS = (rexc.AuthenticationError, rexc.AuthenticationWrongNumberOfArgsError)

# Every op name counted through `on_error` (a bounded metric label set).
REDIS_OPS = ("kv_events", "index_refresh", "lookup", "longest_prefix", "live_workers", "heartbeat", "get_stream",
             "get_chunk_result", "claim_stream", "commit_chunk", "ping", "deregister")


class RedisAuthError(RuntimeError):
    """Redis rejected the configured credentials. The message never contains the password."""


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class RedisClient:
    """One Redis connection pool, with this worker's view of whether Redis is available.

    `on_error(op)` is called for every failed operation, including those skipped while
    unhealthy; `on_health_change(healthy)` on every transition. `unavailable` is set when
    an operation finds Redis gone, so the reconnect loop can start pinging at once.
    """

    def __init__(
        self,
        url: str,
        *,
        socket_timeout_s: float,
        connect_timeout_s: float,
        password: str | None = None,
        username: str | None = None,
        on_error: Callable[[str], None] | None = None,
        on_health_change: Callable[[bool], None] | None = None,
    ) -> None:
        credentials = {k: v for k, v in (("password", password), ("username", username)) if v is not None}
        # Retries are ours (the background loop); the client's own would multiply every timeout.
        self.redis = aioredis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
            **credentials,
        )
        conn = self.redis.connection_pool.connection_kwargs
        # Never log the URL: it may carry the password.
        where = conn.get("path") or f"{conn.get('host', 'localhost')}:{conn.get('port', 6379)}"
        self.address = f"{where}/{conn.get('db', 0)}"
        self._username = conn.get("username") or "default"
        self._secrets = [s for s in (password, conn.get("password")) if s]
        self.op_timeout_s = connect_timeout_s + socket_timeout_s
        self._on_error = on_error
        self._on_health_change = on_health_change
        self.healthy = False
        self.unavailable = asyncio.Event()
        self._last_ping_error: str | None = None

    async def first_ping(self) -> BaseException | None:
        """None if Redis answered, else why not; a refused login raises RedisAuthError instead."""
        try:
            async with asyncio.timeout(self.op_timeout_s):
                await self.redis.ping()
        except _AUTH_ERRORS as exc:
            await self.redis.aclose()
            how = "with a password" if self._secrets else "without a password"
            raise RedisAuthError(
                f"Redis at {self.address} rejected the credentials of user {self._username!r} ({how}): "
                f"{self.describe(exc).rstrip('.')}. Check the configured Redis username and password."
            ) from None
        except (*UNAVAILABLE, rexc.RedisError) as exc:
            return exc
        return None

    async def ping(self) -> bool:
        """One reconnect attempt: True (and healthy) if Redis answers. Logs each new kind of failure once."""
        try:
            async with asyncio.timeout(self.op_timeout_s):
                await self.redis.ping()
        except (*UNAVAILABLE, rexc.RedisError) as exc:
            self.count_error("ping")
            kind = type(exc).__name__
            if kind != self._last_ping_error:
                self._last_ping_error = kind
                level = logging.ERROR if isinstance(exc, _AUTH_ERRORS) else logging.INFO
                log.log(level, "redis at %s still unavailable: %s", self.address, self.describe(exc))
            return False
        self._last_ping_error = None
        self.set_healthy(True)
        return True

    async def guarded(self, op: str, default: T, fn: Callable[[], Awaitable[T]]) -> T:
        """Runs one Redis operation with a deadline; on any Redis trouble counts it and returns `default`."""
        if not self.healthy:
            self.count_error(op)
            return default
        try:
            async with asyncio.timeout(self.op_timeout_s):
                return await fn()
        except UNAVAILABLE as exc:
            self.mark_unavailable(op, exc)
        except rexc.RedisError as exc:
            self.count_error(op)
            log.warning("redis %s failed: %s", op, self.describe(exc))
        return default

    def mark_unavailable(self, op: str, exc: BaseException) -> None:
        self.count_error(op)
        if self.healthy:
            log.warning(
                "redis at %s unavailable (%s during %s); running degraded",
                self.address,
                self.describe(exc),
                op,
            )
            self.set_healthy(False)
            self.unavailable.set()

    def set_healthy(self, healthy: bool) -> None:
        if healthy == self.healthy:
            return
        self.healthy = healthy
        if healthy:
            log.info("redis at %s is reachable", self.address)
        if self._on_health_change is not None:
            try:
                self._on_health_change(healthy)
            except Exception:
                log.exception("on_health_change callback failed")

    def count_error(self, op: str) -> None:
        if self._on_error is not None:
            try:
                self._on_error(op)
            except Exception:
                log.exception("on_error callback failed")

    def describe(self, exc: BaseException) -> str:
        """`Type: message` of a Redis error, with every known secret masked."""
        text = f"{type(exc).__name__}: {exc}"
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    async def aclose(self) -> None:
        await self.redis.aclose()
