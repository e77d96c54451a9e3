"""Worker liveness and load: each worker's heartbeat, the live workers, the cluster's prefix hit rate."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TypedDict

import msgspec
from redis.asyncio.client import Pipeline

from worker.state.client import RedisClient, now_ms
from worker.state.keys import KeyLayout

log = logging.getLogger(__name__)


class WorkerLoad(TypedDict, total=False):
    """What `load_fn` returns for each heartbeat. `queries` and `hits` are cumulative prefix-cache token counts."""

    running: int
    waiting: int
    kv_usage: float
    hit_rate: float
    queries: int
    hits: int


class WorkerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One worker's heartbeat: who it is, when it last reported, and its load."""

    worker: str
    model: str
    ts_ms: int
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    hit_rate: float = 0.0
    queries: int = 0
    hits: int = 0


_INFO_ENCODER = msgspec.msgpack.Encoder()
_INFO_DECODER = msgspec.msgpack.Decoder(WorkerInfo)


class Liveness:
    """This worker's heartbeat (with `load_fn()`'s figures) and the view of every live worker."""

    def __init__(
        self,
        client: RedisClient,
        keys: KeyLayout,
        *,
        heartbeat_interval_s: float,
        load_fn: Callable[[], WorkerLoad] | None = None,
    ) -> None:
        self._client = client
        self._keys = keys
        self.heartbeat_interval_s = heartbeat_interval_s
        self._ttl_ms = max(1, math.ceil(3 * heartbeat_interval_s * 1000))
        self._load_fn = load_fn

    async def heartbeat_now(self) -> bool:
        """Writes this worker's heartbeat now. False if Redis is unavailable."""
        try:
            load: WorkerLoad = self._load_fn() if self._load_fn is not None else {}
        except Exception:
            log.exception("load_fn failed; heartbeat carries no load figures")
            load = {}
        queries, hits = int(load.get("queries", 0)), int(load.get("hits", 0))
        info = WorkerInfo(
            worker=self._keys.worker_id,
            model=self._keys.model,
            ts_ms=now_ms(),
            running=int(load.get("running", 0)),
            waiting=int(load.get("waiting", 0)),
            kv_usage=float(load.get("kv_usage", 0.0)),
            hit_rate=float(load.get("hit_rate", hits / queries if queries else 0.0)),
            queries=queries,
            hits=hits,
        )

        async def write() -> bool:
            async with self._client.redis.pipeline(transaction=True) as pipe:
                pipe.set(self._keys.worker_info(info.worker), _INFO_ENCODER.encode(info), px=self._ttl_ms)
                pipe.zadd(self._keys.workers, {info.worker: info.ts_ms + self._ttl_ms})
                pipe.zremrangebyscore(self._keys.workers, "-inf", info.ts_ms)
                await pipe.execute()
            return True

        return await self._client.guarded("heartbeat", False, write)

    async def live_workers(self, model: str | None = None) -> list[WorkerInfo]:
        """Workers with a current heartbeat, sorted by id; only `model`'s when given. Empty when unavailable."""
        redis = self._client.redis

        async def read() -> list[WorkerInfo]:
            ids = await redis.zrangebyscore(self._keys.workers, f"({now_ms()}", "+inf")
            if not ids:
                return []
            blobs = await redis.mget([self._keys.worker_info(i.decode()) for i in ids])
            infos = []
            for blob in blobs:
                if blob is None:
                    continue
                try:
                    info = _INFO_DECODER.decode(blob)
                except msgspec.DecodeError:
                    continue  # written by an incompatible version; not ours to judge
                if model is None or info.model == model:
                    infos.append(info)
            return sorted(infos, key=lambda i: i.worker)

        return await self._client.guarded("live_workers", [], read)

    async def cluster_hit_rate(self, model: str | None = None) -> float | None:
        """Sum of hits over sum of queries (prefix-cache tokens) of the live workers.

        None when nobody has queried yet or Redis is unavailable.
        """
        workers = await self.live_workers(model)
        queries = sum(w.queries for w in workers)
        return sum(w.hits for w in workers) / queries if queries else None

    def queue_deregister(self, pipe: Pipeline) -> None:
        """Adds to `pipe` the removal of this worker's heartbeat."""
        pipe.zrem(self._keys.workers, self._keys.worker_id)
        pipe.delete(self._keys.worker_info(self._keys.worker_id))
