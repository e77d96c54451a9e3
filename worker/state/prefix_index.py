"""The shared prefix index: which workers hold each KV block, fed by the engine's KV events.

Events are applied in order. While Redis is unavailable they wait in a bounded buffer
(oldest dropped when full); a dropped or refused event makes the index resync by
writing every block this worker holds again.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Literal

from redis import exceptions as rexc
from redis.asyncio.client import Pipeline

from worker.state.client import UNAVAILABLE, RedisClient, now_ms
from worker.state.keys import KeyLayout

log = logging.getLogger(__name__)

# One pipeline carries at most this many block hashes, so a backlog or a long prompt never
# builds a giant pipeline on the event loop or holds Redis for long.
MAX_HASHES_PER_WRITE = 2048
MAX_EVENTS_PER_WRITE = 512
# longest_prefix reads this many hashes per round trip and stops once no worker is left.
PREFIX_LOOKUP_CHUNK = 128

# Removes one worker from every block it registered. Block keys are built from ARGV rather
# than passed as KEYS, so this assumes a single Redis (not Cluster).
_CLEAR_SCRIPT = """
local hashes = redis.call('SMEMBERS', KEYS[1])
for _, h in ipairs(hashes) do redis.call('ZREM', ARGV[1] .. h, ARGV[2]) end
redis.call('DEL', KEYS[1])
return #hashes
"""

_IndexOp = tuple[Literal["store", "remove", "clear"], tuple[int, ...]]


def _index_op(event: object) -> _IndexOp:
    # NOTE: dispatch on the class name, not isinstance: engine/kv_events.py and
    # schemas/kv_events.py name their events alike with the same fields, and importing
    # engine/ here would pull torch into every process that only talks to Redis.
    name = type(event).__name__
    if name == "BlockStored":
        return ("store", tuple(int(h) for h in event.block_hashes))  # type: ignore[attr-defined]
    if name == "BlockRemoved":
        return ("remove", tuple(int(h) for h in event.block_hashes))  # type: ignore[attr-defined]
    if name == "AllBlocksCleared":
        return ("clear", ())
    raise TypeError(f"not a KV cache event: {name}")


class PrefixIndex:
    """This worker's entries in the shared prefix index, and lookups across all workers.

    A new instance starts by clearing this worker's old entries: a fresh process has an
    empty prefix cache.
    """

    def __init__(self, client: RedisClient, keys: KeyLayout, *, index_ttl_s: float, event_buffer: int) -> None:
        self._client = client
        self._keys = keys
        self._ttl_ms = max(1, math.ceil(index_ttl_s * 1000))
        # Re-stating our blocks three times per TTL keeps blocks that stay cached without new
        # BlockStored events (the hottest prefixes) from expiring out of the index.
        self.refresh_interval_s = index_ttl_s / 3
        self.flush_lock = asyncio.Lock()
        self._buffer_size = event_buffer
        self._buffer: deque[_IndexOp] = deque([("clear", ())])
        self._held: set[int] = set()  # what the engine holds now; Redis converges to it
        self._dropped = 0
        self.resync_needed = False

    @property
    def buffered_events(self) -> int:
        return len(self._buffer)

    @property
    def dropped_events(self) -> int:
        return self._dropped

    async def publish_kv_events(self, events: Iterable[object]) -> None:
        """Applies the engine's KV events (engine or schemas dataclasses) to the index, in order.

        One pipelined transaction per batch when Redis is up. Otherwise the events wait in
        the buffer (oldest dropped when full) and are written when Redis returns. Never raises
        for Redis trouble; raises TypeError for something that is not a KV event.
        """
        # Convert all first, so a bad event leaves the buffer and `_held` untouched.
        for kind, hashes in [_index_op(e) for e in events]:
            if kind == "store":
                self._held.update(hashes)
            elif kind == "remove":
                self._held.difference_update(hashes)
            else:
                self._held.clear()
                # Everything queued before a clear is undone by it, so it need not be written.
                self._buffer.clear()
            # A long prompt's blocks go in pieces, so no pipeline grows past MAX_HASHES_PER_WRITE.
            for start in range(0, max(len(hashes), 1), MAX_HASHES_PER_WRITE):
                self._buffer.append((kind, hashes[start : start + MAX_HASHES_PER_WRITE]))
        self._trim_buffer()
        if self._client.healthy:
            await self.flush()

    async def lookup(self, block_hashes: Sequence[int], *, live_only: bool = True) -> list[set[str]]:
        """The workers holding each block, in order (empty sets when Redis is unavailable).

        With `live_only`, workers without a current heartbeat are left out.
        """
        hashes = list(block_hashes)
        return await self._client.guarded(
            "lookup", [set() for _ in hashes], lambda: self._holders(hashes, live_only)
        )

    async def longest_prefix(self, block_hashes: Sequence[int], *, live_only: bool = True) -> dict[str, int]:
        """For each worker holding the first block, how many leading blocks it holds in a row.

        Reads in chunks and stops as soon as no worker holds the prefix so far, so a prompt
        nobody has seen costs one round trip. Empty when Redis is unavailable.
        """
        hashes = list(block_hashes)

        async def read() -> dict[str, int]:
            counts: dict[str, int] = {}
            candidates: set[str] | None = None
            for start in range(0, len(hashes), PREFIX_LOOKUP_CHUNK):
                chunk = await self._holders(hashes[start : start + PREFIX_LOOKUP_CHUNK], live_only)
                for offset, holders in enumerate(chunk):
                    candidates = holders if candidates is None else candidates & holders
                    if not candidates:
                        return counts
                    for worker in candidates:
                        counts[worker] = start + offset + 1
            return counts

        return await self._client.guarded("longest_prefix", {}, read)

    async def _holders(self, hashes: Sequence[int], live_only: bool) -> list[set[str]]:
        now = f"({now_ms()}"
        block_prefix = self._keys.block_prefix
        async with self._client.redis.pipeline(transaction=False) as pipe:
            for h in hashes:
                pipe.zrangebyscore(block_prefix + str(h), now, "+inf")
            if live_only:
                pipe.zrangebyscore(self._keys.workers, now, "+inf")
            replies = await pipe.execute()
        live = {w.decode() for w in replies.pop()} if live_only else None
        holders = [{w.decode() for w in members} for members in replies]
        return [h & live for h in holders] if live is not None else holders

    def _trim_buffer(self) -> None:
        while len(self._buffer) > self._buffer_size:
            self._buffer.popleft()
            self._dropped += 1
            self.resync_needed = True

    async def flush(self) -> None:
        """Writes buffered events in order, then resyncs if events were lost. One writer at a time."""
        async with self.flush_lock:
            while self._buffer and self._client.healthy:
                batch = self._take_batch()
                try:
                    outcome = await self._write(batch, "kv_events")
                except BaseException:
                    self._requeue(batch)  # cancelled mid-write (stop): keep the events
                    raise
                if outcome is False:
                    self._requeue(batch)
                    return
                if outcome is None:
                    # Redis refused the batch itself; replaying would fail the same way.
                    self._dropped += len(batch)
                    self.resync_needed = True
            if self.resync_needed and self._client.healthy and await self.restate_held(clear_first=True):
                self.resync_needed = False

    def _take_batch(self) -> list[_IndexOp]:
        batch: list[_IndexOp] = []
        num_hashes = 0
        while self._buffer and len(batch) < MAX_EVENTS_PER_WRITE and num_hashes < MAX_HASHES_PER_WRITE:
            op = self._buffer.popleft()
            batch.append(op)
            num_hashes += len(op[1])
        return batch

    def _requeue(self, batch: list[_IndexOp]) -> None:
        self._buffer.extendleft(reversed(batch))
        self._trim_buffer()

    async def restate_held(self, *, clear_first: bool) -> bool:
        """Writes every block this worker holds again, with fresh expiries. Caller holds the flush lock."""
        held = list(self._held)
        for start in range(0, max(len(held), 1), MAX_HASHES_PER_WRITE):
            ops: list[_IndexOp] = [("clear", ())] if clear_first and start == 0 else []
            # Skip blocks removed while we were writing; their BlockRemoved is in the buffer.
            chunk = tuple(h for h in held[start : start + MAX_HASHES_PER_WRITE] if h in self._held)
            if chunk:
                ops.append(("store", chunk))
            if ops and await self._write(ops, "index_refresh") is not True:
                return False
        return True

    async def _write(self, ops: Sequence[_IndexOp], op_name: str) -> bool | None:
        """One MULTI/EXEC round trip. True: written; False: Redis unavailable; None: Redis refused it."""
        expiry = now_ms() + self._ttl_ms
        ttl = self._ttl_ms
        block_prefix, own_blocks, worker_id = self._keys.block_prefix, self._keys.own_blocks, self._keys.worker_id
        redis = self._client.redis
        try:
            async with asyncio.timeout(self._client.op_timeout_s), redis.pipeline(transaction=True) as pipe:
                for kind, hashes in ops:
                    if kind == "clear":
                        self.queue_clear(pipe)
                        continue
                    if not hashes:
                        continue
                    for h in hashes:
                        key = block_prefix + str(h)
                        if kind == "store":
                            pipe.zadd(key, {worker_id: expiry})
                            pipe.pexpire(key, ttl)
                        else:
                            pipe.zrem(key, worker_id)
                    if kind == "store":
                        pipe.sadd(own_blocks, *hashes)
                        pipe.pexpire(own_blocks, ttl)
                    else:
                        pipe.srem(own_blocks, *hashes)
                await pipe.execute()
            return True
        except UNAVAILABLE as exc:
            self._client.mark_unavailable(op_name, exc)
            return False
        except rexc.RedisError as exc:
            self._client.count_error(op_name)
            log.error("redis refused a %s write: %s", op_name, self._client.describe(exc))
            return None

    def queue_clear(self, pipe: Pipeline) -> None:
        """Adds to `pipe` the removal of this worker from every block it registered."""
        pipe.eval(_CLEAR_SCRIPT, 1, self._keys.own_blocks, self._keys.block_prefix, self._keys.worker_id)

    def forget_held(self) -> None:
        """At deregistration: the index no longer lists this worker, so nothing is held for it."""
        self._held.clear()
