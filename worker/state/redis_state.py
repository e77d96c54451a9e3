"""`RedisState`: one worker's view of the shared Redis, and the background task that keeps it in sync.

Redis holds only what must outlive one worker and be shared. While Redis is down or
slow, every call returns a safe default within its timeout and KV events wait in a
bounded buffer, so the service runs degraded instead of failing; `commit_chunk` alone
raises `StateUnavailable`. keys.py gives the key layout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence

from worker.state.asr_streams import AsrStreams, CommitResult, StreamState
from worker.state.client import RedisClient
from worker.state.keys import KeyLayout
from worker.state.liveness import Liveness, WorkerInfo, WorkerLoad
from worker.state.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

RECONNECT_MIN_S = 0.05


class RedisState:
    """This worker's view of the shared Redis: prefix index, heartbeat and load, ASR stream state.

    Call `start()` before use and `stop()` at shutdown. Until `start()` succeeds (and while
    Redis is unavailable) `healthy` is False and calls return their safe defaults at once,
    without touching the network; a background task pings with capped exponential backoff
    and, once Redis answers, flushes buffered KV events and rewrites this worker's index
    entries (Redis may have restarted empty).

    `on_error(op)` is called for every failed operation, including those skipped while
    unhealthy; `on_health_change(healthy)` on every transition. A new instance starts by
    clearing this worker's old index entries: a fresh process has an empty prefix cache.
    """

    def __init__(
        self,
        url: str,
        *,
        worker_id: str,
        model: str,
        key_prefix: str = "infinilm",
        index_ttl_s: float = 300.0,
        heartbeat_interval_s: float = 5.0,
        stream_state_ttl_s: float = 3600.0,
        socket_timeout_s: float = 2.0,
        connect_timeout_s: float | None = None,
        reconnect_max_s: float = 5.0,
        event_buffer: int = 10000,
        password: str | None = None,
        username: str | None = None,
        on_error: Callable[[str], None] | None = None,
        on_health_change: Callable[[bool], None] | None = None,
        load_fn: Callable[[], WorkerLoad] | None = None,
    ) -> None:
        for name, value in (
            ("index_ttl_s", index_ttl_s),
            ("heartbeat_interval_s", heartbeat_interval_s),
            ("stream_state_ttl_s", stream_state_ttl_s),
            ("socket_timeout_s", socket_timeout_s),
            ("reconnect_max_s", reconnect_max_s),
            ("event_buffer", event_buffer),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if not worker_id or not model:
            raise ValueError("worker_id and model must be non-empty")
        self._client = RedisClient(
            url,
            socket_timeout_s=socket_timeout_s,
            connect_timeout_s=connect_timeout_s or socket_timeout_s,
            password=password,
            username=username,
            on_error=on_error,
            on_health_change=on_health_change,
        )
        keys = KeyLayout(key_prefix, model, worker_id)
        self._worker_id = worker_id
        self._reconnect_max_s = reconnect_max_s
        self._index = PrefixIndex(self._client, keys, index_ttl_s=index_ttl_s, event_buffer=event_buffer)
        self._liveness = Liveness(self._client, keys, heartbeat_interval_s=heartbeat_interval_s, load_fn=load_fn)
        self._streams = AsrStreams(self._client, keys, stream_state_ttl_s=stream_state_ttl_s)
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """True while Redis answers; False before `start()` and while running degraded."""
        return self._client.healthy

    @property
    def buffered_events(self) -> int:
        """KV events waiting for Redis."""
        return self._index.buffered_events

    @property
    def dropped_events(self) -> int:
        """KV events lost because the buffer was full (the index heals by a resync afterwards)."""
        return self._index.dropped_events

    async def start(self) -> None:
        """Connects, registers this worker, and starts the background task.

        Raises `RedisAuthError` when Redis rejects the credentials. Any other failure to
        reach Redis is not an error: the worker starts degraded and reconnects in the background.
        """
        if self._task is not None:
            return
        error = await self._client.first_ping()
        if error is not None:
            self._client.count_error("ping")
            log.warning(
                "redis unreachable at %s (%s); starting degraded", self._client.address, self._client.describe(error)
            )
        else:
            self._client.set_healthy(True)
            await self._index.flush()
            await self._liveness.heartbeat_now()
        self._task = asyncio.create_task(self._run(), name=f"redis-state-{self._worker_id}")

    async def check_credentials(self) -> bool:
        """Pings once and writes nothing: True if Redis let us in, False if it did not answer.

        Raises `RedisAuthError`, as `start()` does, when Redis rejects the credentials; a
        worker calls it before loading its model, so a wrong password costs seconds.
        """
        return await self._client.first_ping() is None

    async def stop(self, *, deregister: bool = True) -> None:
        """Stops the background task, flushes buffered events, and closes the connections.

        With `deregister` (the default, for a graceful shutdown) the worker also deletes its
        heartbeat and its index entries, so routers stop counting on its cache at once.
        Bounded: gives up after a few operation timeouts. The instance cannot be restarted.
        """
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._client.healthy:
            try:
                async with asyncio.timeout(4 * self._client.op_timeout_s):
                    await self._index.flush()
                    if deregister:
                        await self._client.guarded("deregister", None, self._deregister)
            except TimeoutError:
                log.warning("redis flush at shutdown timed out; %d KV events not written", self.buffered_events)
        self._client.healthy = False
        await self._client.aclose()

    async def _deregister(self) -> None:
        self._index.forget_held()
        async with self._client.redis.pipeline(transaction=True) as pipe:
            self._liveness.queue_deregister(pipe)
            self._index.queue_clear(pipe)
            await pipe.execute()

    async def _run(self) -> None:
        """Reconnects with capped backoff, flushes the buffer, heartbeats and refreshes the index."""
        client, index = self._client, self._index
        backoff = RECONNECT_MIN_S
        loop = asyncio.get_running_loop()
        next_heartbeat = loop.time() + self._liveness.heartbeat_interval_s
        next_refresh = loop.time() + index.refresh_interval_s
        while True:
            try:
                if not client.healthy:
                    if not await client.ping():
                        await asyncio.sleep(backoff)
                        backoff = min(2 * backoff, self._reconnect_max_s)
                        continue
                    backoff = RECONNECT_MIN_S
                    index.resync_needed = True  # Redis may have restarted empty
                    next_heartbeat = loop.time()
                await index.flush()
                if loop.time() >= next_heartbeat:
                    await self._liveness.heartbeat_now()
                    next_heartbeat = loop.time() + self._liveness.heartbeat_interval_s
                if loop.time() >= next_refresh and client.healthy:
                    async with index.flush_lock:
                        await index.restate_held(clear_first=False)
                    next_refresh = loop.time() + index.refresh_interval_s
                if not client.healthy:
                    continue  # failed during this round: start pinging now, not after the sleep
                client.unavailable.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, min(next_heartbeat, next_refresh) - loop.time())):
                        await client.unavailable.wait()
            except asyncio.CancelledError:
                raise
            except Exception:
                # The loop must outlive any bug in one iteration, or the worker silently stops
                # heartbeating and reconnecting.
                log.exception("redis background task failed; retrying")
                await asyncio.sleep(self._reconnect_max_s)

    # -- the parts' operations, see prefix_index.py, liveness.py and asr_streams.py ----

    async def publish_kv_events(self, events: Iterable[object]) -> None:
        await self._index.publish_kv_events(events)

    async def lookup(self, block_hashes: Sequence[int], *, live_only: bool = True) -> list[set[str]]:
        return await self._index.lookup(block_hashes, live_only=live_only)

    async def longest_prefix(self, block_hashes: Sequence[int], *, live_only: bool = True) -> dict[str, int]:
        return await self._index.longest_prefix(block_hashes, live_only=live_only)

    async def heartbeat_now(self) -> bool:
        return await self._liveness.heartbeat_now()

    async def live_workers(self, model: str | None = None) -> list[WorkerInfo]:
        return await self._liveness.live_workers(model)

    async def cluster_hit_rate(self, model: str | None = None) -> float | None:
        return await self._liveness.cluster_hit_rate(model)

    async def get_stream(self, stream_id: str) -> StreamState | None:
        return await self._streams.get_stream(stream_id)

    async def get_chunk_result(self, stream_id: str, seq: int) -> bytes | None:
        return await self._streams.get_chunk_result(stream_id, seq)

    async def claim_stream(self, stream_id: str, owner: str | None = None) -> StreamState | None:
        return await self._streams.claim_stream(stream_id, owner)

    async def commit_chunk(
        self, stream_id: str, seq: int, corrected_text: str, result_bytes: bytes, owner: str | None = None,
        final: bool = False,
    ) -> CommitResult:
        return await self._streams.commit_chunk(stream_id, seq, corrected_text, result_bytes, owner, final)
