"""Everything a worker keeps in Redis: the shared prefix index, liveness and load, ASR stream state.

Redis holds only what must outlive one worker and be shared. It is never on
the critical path: while Redis is down or slow, every call here returns a safe
default within its timeout (an empty lookup, no stream state) and KV events
wait in a bounded buffer, so the service runs degraded instead of failing. The
one exception is `commit_chunk`, which raises `StateUnavailable`: an ASR
handler must not report a chunk whose state was not saved.

Key layout (`P` = key_prefix, `M` = model name, hashes in decimal):

    P:kv:M:block:<hash>          zset    worker id -> expiry (epoch ms); key TTL index_ttl_s
    P:kv:M:worker:<worker>       set     block hashes this worker registered; TTL index_ttl_s
    P:workers                    zset    worker id -> heartbeat expiry (epoch ms)
    P:worker:<worker>            string  msgpack `WorkerInfo`; TTL 3 x heartbeat_interval_s
    P:asr:<digest>               hash    stream_id, seq (last committed), text, owner, updated_ms
    P:asr:<digest>:result:<seq>  string  the encoded result of chunk <seq>; both TTL stream_state_ttl_s

NOTE: each (block, worker) pair carries its own expiry as the zset score, since
a key TTL alone would keep a dead worker listed for as long as any live worker
refreshes the same block. Readers skip expired members; they vanish with the key.
NOTE: `<digest>` is a BLAKE2b digest of the stream id, so client-supplied ids
never become key names.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, TypedDict, TypeVar

import msgspec
import redis.asyncio as aioredis
from redis import exceptions as rexc
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

log = logging.getLogger(__name__)

T = TypeVar("T")

# Errors that mean "Redis is unavailable": they flip `healthy`. OSError covers refused
# connects and asyncio's TimeoutError; READONLY means we reached a replica after a failover.
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    rexc.ConnectionError,
    rexc.TimeoutError,
    rexc.ReadOnlyError,
    OSError,
)
_AUTH_ERRORS = (rexc.AuthenticationError, rexc.AuthenticationWrongNumberOfArgsError)

# One pipeline carries at most this many block hashes, so a backlog or a long prompt never
# builds a giant pipeline on the event loop or holds Redis for long.
MAX_HASHES_PER_WRITE = 2048
MAX_EVENTS_PER_WRITE = 512
# longest_prefix reads this many hashes per round trip and stops once no worker is left.
PREFIX_LOOKUP_CHUNK = 128
RECONNECT_MIN_S = 0.05

# Removes one worker from every block it registered. Block keys are built from ARGV rather
# than passed as KEYS, so this assumes a single Redis (not Cluster).
_CLEAR_SCRIPT = """
local hashes = redis.call('SMEMBERS', KEYS[1])
for _, h in ipairs(hashes) do redis.call('ZREM', ARGV[1] .. h, ARGV[2]) end
redis.call('DEL', KEYS[1])
return #hashes
"""

# KEYS: state, result. ARGV: seq, seq - 1, text, result, owner, ttl_ms, now_ms, stream_id.
# NOTE: seq is compared as a decimal string, not a Lua number: seqs go up to 2**63 - 1 and
# Lua numbers are doubles. We always write canonical decimals, so string equality is exact.
_COMMIT_SCRIPT = """
local prior = redis.call('GET', KEYS[2])
local st = redis.call('HMGET', KEYS[1], 'seq', 'text', 'owner', 'updated_ms')
if prior then return {'duplicate', st[1], st[2], st[3], st[4], prior} end
if (st[1] or '-1') ~= ARGV[2] then return {'out_of_order', st[1], st[2], st[3], st[4], false} end
redis.call('HSET', KEYS[1], 'stream_id', ARGV[8], 'seq', ARGV[1], 'text', ARGV[3],
           'owner', ARGV[5], 'updated_ms', ARGV[7])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[6])
return {'applied', ARGV[1], ARGV[3], ARGV[5], ARGV[7], ARGV[4]}
"""

_IndexOp = tuple[Literal["store", "remove", "clear"], tuple[int, ...]]
CommitStatus = Literal["applied", "duplicate", "out_of_order"]


# Every op name counted through `on_error` (a bounded metric label set).
REDIS_OPS = ("kv_events", "index_refresh", "lookup", "longest_prefix", "live_workers", "heartbeat", "get_stream",
             "get_chunk_result", "claim_stream", "commit_chunk", "ping", "deregister")


class StateUnavailable(RuntimeError):
    """Redis could not record ASR stream state; the caller must not act as if it had."""


class RedisAuthError(RuntimeError):
    """Redis rejected the configured credentials. The message never contains the password."""


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


@dataclass(frozen=True)
class StreamState:
    """An ASR stream as Redis knows it. `last_seq` is -1 for a claimed stream with no chunk yet."""

    stream_id: str
    last_seq: int
    text: str
    owner: str
    updated_ms: int


@dataclass(frozen=True)
class CommitResult:
    """What `commit_chunk` did.

    `applied`: this call committed the chunk. `duplicate`: the chunk was committed before
    (maybe by another worker); `result` holds the bytes stored then. `out_of_order`: seq is
    not last_seq + 1 and nothing changed; compare seq with `state.last_seq` to tell a stale
    chunk from a gap. `state` is the stream after the call (None if it does not exist).
    """

    status: CommitStatus
    state: StreamState | None
    result: bytes | None

    @property
    def applied(self) -> bool:
        return self.status == "applied"


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _text(value: bytes | None) -> str:
    return value.decode() if value is not None else ""


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
        connect_timeout_s = connect_timeout_s or socket_timeout_s
        credentials = {k: v for k, v in (("password", password), ("username", username)) if v is not None}
        # Retries are ours (the background loop); the client's own would multiply every timeout.
        self._client = aioredis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
            **credentials,
        )
        conn = self._client.connection_pool.connection_kwargs
        # Never log the URL: it may carry the password.
        where = conn.get("path") or f"{conn.get('host', 'localhost')}:{conn.get('port', 6379)}"
        self._address = f"{where}/{conn.get('db', 0)}"
        self._username = conn.get("username") or "default"
        self._secrets = [s for s in (password, conn.get("password")) if s]

        self._worker_id = worker_id
        self._model = model
        self._index_ttl_ms = max(1, math.ceil(index_ttl_s * 1000))
        self._heartbeat_interval_s = heartbeat_interval_s
        self._heartbeat_ttl_ms = max(1, math.ceil(3 * heartbeat_interval_s * 1000))
        self._stream_ttl_ms = max(1, math.ceil(stream_state_ttl_s * 1000))
        # Re-stating our blocks three times per TTL keeps blocks that stay cached without new
        # BlockStored events (the hottest prefixes) from expiring out of the index.
        self._refresh_interval_s = index_ttl_s / 3
        self._op_timeout_s = connect_timeout_s + socket_timeout_s
        self._reconnect_max_s = reconnect_max_s
        self._on_error = on_error
        self._on_health_change = on_health_change
        self._load_fn = load_fn

        self._k_workers = f"{key_prefix}:workers"
        self._k_worker_prefix = f"{key_prefix}:worker:"
        self._k_block_prefix = f"{key_prefix}:kv:{model}:block:"
        self._k_own_blocks = f"{key_prefix}:kv:{model}:worker:{worker_id}"
        self._k_asr_prefix = f"{key_prefix}:asr:"

        self._healthy = False
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._flush_lock = asyncio.Lock()
        self._buffer_size = event_buffer
        self._buffer: deque[_IndexOp] = deque([("clear", ())])
        self._held: set[int] = set()  # what the engine holds now; Redis converges to it
        self._dropped = 0
        self._resync_needed = False
        self._last_ping_error: str | None = None

    # -- lifecycle ---------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """True while Redis answers; False before `start()` and while running degraded."""
        return self._healthy

    @property
    def buffered_events(self) -> int:
        """KV events waiting for Redis."""
        return len(self._buffer)

    @property
    def dropped_events(self) -> int:
        """KV events lost because the buffer was full (the index heals by a resync afterwards)."""
        return self._dropped

    async def start(self) -> None:
        """Connects, registers this worker, and starts the background task.

        Raises `RedisAuthError` when Redis rejects the credentials. Any other failure to
        reach Redis is not an error: the worker starts degraded and reconnects in the background.
        """
        if self._task is not None:
            return
        error = await self._first_ping()
        if error is not None:
            self._count_error("ping")
            log.warning("redis unreachable at %s (%s); starting degraded", self._address, self._describe(error))
        else:
            self._set_healthy(True)
            await self._flush()
            await self.heartbeat_now()
        self._task = asyncio.create_task(self._run(), name=f"redis-state-{self._worker_id}")

    async def check_credentials(self) -> bool:
        """Pings once and writes nothing: True if Redis let us in, False if it did not answer.

        Raises `RedisAuthError`, as `start()` does, when Redis rejects the credentials; a
        worker calls it before loading its model, so a wrong password costs seconds.
        """
        return await self._first_ping() is None

    async def _first_ping(self) -> BaseException | None:
        """None if Redis answered, else why not; a refused login raises RedisAuthError instead."""
        try:
            async with asyncio.timeout(self._op_timeout_s):
                await self._client.ping()
        except _AUTH_ERRORS as exc:
            await self._client.aclose()
            how = "with a password" if self._secrets else "without a password"
            raise RedisAuthError(
                f"Redis at {self._address} rejected the credentials of user {self._username!r} ({how}): "
                f"{self._describe(exc).rstrip('.')}. Check the configured Redis username and password."
            ) from None
        except (*_UNAVAILABLE, rexc.RedisError) as exc:
            return exc
        return None

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
        if self._healthy:
            try:
                async with asyncio.timeout(4 * self._op_timeout_s):
                    await self._flush()
                    if deregister:
                        await self._guarded("deregister", None, self._deregister)
            except TimeoutError:
                log.warning("redis flush at shutdown timed out; %d KV events not written", len(self._buffer))
        self._healthy = False
        await self._client.aclose()

    # -- prefix index ------------------------------------------------------

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
        if self._healthy:
            await self._flush()

    async def lookup(self, block_hashes: Sequence[int], *, live_only: bool = True) -> list[set[str]]:
        """The workers holding each block, in order (empty sets when Redis is unavailable).

        With `live_only`, workers without a current heartbeat are left out.
        """
        hashes = list(block_hashes)
        return await self._guarded(
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

        return await self._guarded("longest_prefix", {}, read)

    async def _holders(self, hashes: Sequence[int], live_only: bool) -> list[set[str]]:
        now = f"({_now_ms()}"
        async with self._client.pipeline(transaction=False) as pipe:
            for h in hashes:
                pipe.zrangebyscore(self._k_block_prefix + str(h), now, "+inf")
            if live_only:
                pipe.zrangebyscore(self._k_workers, now, "+inf")
            replies = await pipe.execute()
        live = {w.decode() for w in replies.pop()} if live_only else None
        holders = [{w.decode() for w in members} for members in replies]
        return [h & live for h in holders] if live is not None else holders

    def _trim_buffer(self) -> None:
        while len(self._buffer) > self._buffer_size:
            self._buffer.popleft()
            self._dropped += 1
            self._resync_needed = True

    async def _flush(self) -> None:
        """Writes buffered events in order, then resyncs if events were lost. One writer at a time."""
        async with self._flush_lock:
            while self._buffer and self._healthy:
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
                    self._resync_needed = True
            if self._resync_needed and self._healthy and await self._restate_held(clear_first=True):
                self._resync_needed = False

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

    async def _restate_held(self, *, clear_first: bool) -> bool:
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
        expiry = _now_ms() + self._index_ttl_ms
        ttl = self._index_ttl_ms
        try:
            async with asyncio.timeout(self._op_timeout_s), self._client.pipeline(transaction=True) as pipe:
                for kind, hashes in ops:
                    if kind == "clear":
                        pipe.eval(_CLEAR_SCRIPT, 1, self._k_own_blocks, self._k_block_prefix, self._worker_id)
                        continue
                    if not hashes:
                        continue
                    for h in hashes:
                        key = self._k_block_prefix + str(h)
                        if kind == "store":
                            pipe.zadd(key, {self._worker_id: expiry})
                            pipe.pexpire(key, ttl)
                        else:
                            pipe.zrem(key, self._worker_id)
                    if kind == "store":
                        pipe.sadd(self._k_own_blocks, *hashes)
                        pipe.pexpire(self._k_own_blocks, ttl)
                    else:
                        pipe.srem(self._k_own_blocks, *hashes)
                await pipe.execute()
            return True
        except _UNAVAILABLE as exc:
            self._mark_unavailable(op_name, exc)
            return False
        except rexc.RedisError as exc:
            self._count_error(op_name)
            log.error("redis refused a %s write: %s", op_name, self._describe(exc))
            return None

    async def _deregister(self) -> None:
        self._held.clear()
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.zrem(self._k_workers, self._worker_id)
            pipe.delete(self._k_worker_prefix + self._worker_id)
            pipe.eval(_CLEAR_SCRIPT, 1, self._k_own_blocks, self._k_block_prefix, self._worker_id)
            await pipe.execute()

    # -- liveness, load, cluster hit rate ----------------------------------

    async def heartbeat_now(self) -> bool:
        """Writes this worker's heartbeat (with `load_fn()`'s figures) now. False if Redis is unavailable."""
        try:
            load: WorkerLoad = self._load_fn() if self._load_fn is not None else {}
        except Exception:
            log.exception("load_fn failed; heartbeat carries no load figures")
            load = {}
        queries, hits = int(load.get("queries", 0)), int(load.get("hits", 0))
        info = WorkerInfo(
            worker=self._worker_id,
            model=self._model,
            ts_ms=_now_ms(),
            running=int(load.get("running", 0)),
            waiting=int(load.get("waiting", 0)),
            kv_usage=float(load.get("kv_usage", 0.0)),
            hit_rate=float(load.get("hit_rate", hits / queries if queries else 0.0)),
            queries=queries,
            hits=hits,
        )

        async def write() -> bool:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.set(
                    self._k_worker_prefix + self._worker_id,
                    _INFO_ENCODER.encode(info),
                    px=self._heartbeat_ttl_ms,
                )
                pipe.zadd(self._k_workers, {self._worker_id: info.ts_ms + self._heartbeat_ttl_ms})
                pipe.zremrangebyscore(self._k_workers, "-inf", info.ts_ms)
                await pipe.execute()
            return True

        return await self._guarded("heartbeat", False, write)

    async def live_workers(self, model: str | None = None) -> list[WorkerInfo]:
        """Workers with a current heartbeat, sorted by id; only `model`'s when given. Empty when unavailable."""

        async def read() -> list[WorkerInfo]:
            ids = await self._client.zrangebyscore(self._k_workers, f"({_now_ms()}", "+inf")
            if not ids:
                return []
            blobs = await self._client.mget([self._k_worker_prefix + i.decode() for i in ids])
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

        return await self._guarded("live_workers", [], read)

    async def cluster_hit_rate(self, model: str | None = None) -> float | None:
        """Sum of hits over sum of queries (prefix-cache tokens) of the live workers.

        None when nobody has queried yet or Redis is unavailable.
        """
        workers = await self.live_workers(model)
        queries = sum(w.queries for w in workers)
        return sum(w.hits for w in workers) / queries if queries else None

    # -- ASR stream state --------------------------------------------------

    def _k_stream(self, stream_id: str) -> str:
        return self._k_asr_prefix + hashlib.blake2b(stream_id.encode(), digest_size=16).hexdigest()

    async def get_stream(self, stream_id: str) -> StreamState | None:
        """The stream's committed state; None if unknown or Redis is unavailable."""

        async def read() -> StreamState | None:
            seq, text, owner, updated = await self._client.hmget(
                self._k_stream(stream_id), ["seq", "text", "owner", "updated_ms"]
            )
            return self._stream_state(stream_id, seq, text, owner, updated)

        return await self._guarded("get_stream", None, read)

    async def get_chunk_result(self, stream_id: str, seq: int) -> bytes | None:
        """The result stored when chunk `seq` was committed; None if none or Redis is unavailable."""
        key = f"{self._k_stream(stream_id)}:result:{seq}"
        return await self._guarded("get_chunk_result", None, lambda: self._client.get(key))

    async def claim_stream(self, stream_id: str, owner: str | None = None) -> StreamState | None:
        """Makes `owner` (default: this worker) the stream's owner, creating the stream if new.

        Keeps the committed text and seq and refreshes the TTL. None if Redis is unavailable.
        """
        key, owner = self._k_stream(stream_id), owner or self._worker_id

        async def claim() -> StreamState | None:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.hsetnx(key, "stream_id", stream_id)
                pipe.hsetnx(key, "seq", "-1")
                pipe.hsetnx(key, "text", "")
                pipe.hset(key, mapping={"owner": owner, "updated_ms": _now_ms()})
                pipe.pexpire(key, self._stream_ttl_ms)
                pipe.hmget(key, ["seq", "text", "owner", "updated_ms"])
                *_, (seq, text, who, updated) = await pipe.execute()
            return self._stream_state(stream_id, seq, text, who, updated)

        return await self._guarded("claim_stream", None, claim)

    async def commit_chunk(
        self, stream_id: str, seq: int, corrected_text: str, result_bytes: bytes, owner: str | None = None
    ) -> CommitResult:
        """Atomically commits chunk `seq` if it is last_seq + 1 (0 for a new stream).

        Sets the committed text, seq and owner (default: this worker) and stores
        `result_bytes` under (stream, seq), so a redelivered chunk gets the same answer and
        is never applied twice, even by two workers at once. Raises `StateUnavailable` when
        Redis is unavailable or refuses the write: nothing may be assumed saved then.
        """
        if seq < 0:
            raise ValueError(f"seq must be >= 0, got {seq}")
        if not self._healthy:
            self._count_error("commit_chunk")
            raise StateUnavailable(f"Redis at {self._address} is unavailable; chunk not committed")
        key = self._k_stream(stream_id)
        now = _now_ms()
        try:
            async with asyncio.timeout(self._op_timeout_s):
                reply = await self._client.eval(
                    _COMMIT_SCRIPT,
                    2,
                    key,
                    f"{key}:result:{seq}",
                    str(seq),
                    str(seq - 1),
                    corrected_text,
                    result_bytes,
                    owner or self._worker_id,
                    self._stream_ttl_ms,
                    now,
                    stream_id,
                )
        except _UNAVAILABLE as exc:
            self._mark_unavailable("commit_chunk", exc)
            raise StateUnavailable(f"Redis at {self._address} is unavailable; chunk not committed") from exc
        except rexc.RedisError as exc:
            self._count_error("commit_chunk")
            raise StateUnavailable(f"Redis refused the commit: {self._describe(exc)}") from exc
        status, last, text, who, updated, result = (list(reply) + [None] * 6)[:6]
        return CommitResult(
            status=status.decode(),
            state=self._stream_state(stream_id, last, text, who, updated),
            result=result,
        )

    @staticmethod
    def _stream_state(
        stream_id: str, seq: bytes | None, text: bytes | None, owner: bytes | None, updated: bytes | None
    ) -> StreamState | None:
        if seq is None:
            return None
        return StreamState(
            stream_id=stream_id,
            last_seq=int(seq),
            text=_text(text),
            owner=_text(owner),
            updated_ms=int(updated or 0),
        )

    # -- resilience --------------------------------------------------------

    async def _guarded(self, op: str, default: T, fn: Callable[[], Awaitable[T]]) -> T:
        """Runs one Redis operation with a deadline; on any Redis trouble counts it and returns `default`."""
        if not self._healthy:
            self._count_error(op)
            return default
        try:
            async with asyncio.timeout(self._op_timeout_s):
                return await fn()
        except _UNAVAILABLE as exc:
            self._mark_unavailable(op, exc)
        except rexc.RedisError as exc:
            self._count_error(op)
            log.warning("redis %s failed: %s", op, self._describe(exc))
        return default

    async def _run(self) -> None:
        """Reconnects with capped backoff, flushes the buffer, heartbeats and refreshes the index."""
        backoff = RECONNECT_MIN_S
        loop = asyncio.get_running_loop()
        next_heartbeat = loop.time() + self._heartbeat_interval_s
        next_refresh = loop.time() + self._refresh_interval_s
        while True:
            try:
                if not self._healthy:
                    if not await self._ping():
                        await asyncio.sleep(backoff)
                        backoff = min(2 * backoff, self._reconnect_max_s)
                        continue
                    backoff = RECONNECT_MIN_S
                    self._resync_needed = True  # Redis may have restarted empty
                    next_heartbeat = loop.time()
                await self._flush()
                if loop.time() >= next_heartbeat:
                    await self.heartbeat_now()
                    next_heartbeat = loop.time() + self._heartbeat_interval_s
                if loop.time() >= next_refresh and self._healthy:
                    async with self._flush_lock:
                        await self._restate_held(clear_first=False)
                    next_refresh = loop.time() + self._refresh_interval_s
                if not self._healthy:
                    continue  # failed during this round: start pinging now, not after the sleep
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, min(next_heartbeat, next_refresh) - loop.time())):
                        await self._wake.wait()
            except asyncio.CancelledError:
                raise
            except Exception:
                # The loop must outlive any bug in one iteration, or the worker silently stops
                # heartbeating and reconnecting.
                log.exception("redis background task failed; retrying")
                await asyncio.sleep(self._reconnect_max_s)

    async def _ping(self) -> bool:
        try:
            async with asyncio.timeout(self._op_timeout_s):
                await self._client.ping()
        except (*_UNAVAILABLE, rexc.RedisError) as exc:
            self._count_error("ping")
            kind = type(exc).__name__
            if kind != self._last_ping_error:
                self._last_ping_error = kind
                level = logging.ERROR if isinstance(exc, _AUTH_ERRORS) else logging.INFO
                log.log(level, "redis at %s still unavailable: %s", self._address, self._describe(exc))
            return False
        self._last_ping_error = None
        self._set_healthy(True)
        return True

    def _mark_unavailable(self, op: str, exc: BaseException) -> None:
        self._count_error(op)
        if self._healthy:
            log.warning(
                "redis at %s unavailable (%s during %s); running degraded",
                self._address,
                self._describe(exc),
                op,
            )
            self._set_healthy(False)
            self._wake.set()

    def _set_healthy(self, healthy: bool) -> None:
        if healthy == self._healthy:
            return
        self._healthy = healthy
        if healthy:
            log.info("redis at %s is reachable", self._address)
        if self._on_health_change is not None:
            try:
                self._on_health_change(healthy)
            except Exception:
                log.exception("on_health_change callback failed")

    def _count_error(self, op: str) -> None:
        if self._on_error is not None:
            try:
                self._on_error(op)
            except Exception:
                log.exception("on_error callback failed")

    def _describe(self, exc: BaseException) -> str:
        text = f"{type(exc).__name__}: {exc}"
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text
