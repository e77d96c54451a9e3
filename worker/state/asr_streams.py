"""ASR stream state: the committed transcript, last seq and owner of each stream, so any worker can continue it.

Reads return None while Redis is unavailable. `commit_chunk` raises `StateUnavailable`
instead: an ASR handler must not report a chunk whose state was not saved.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Literal

from redis import exceptions as rexc

from worker.state.client import UNAVAILABLE, RedisClient, now_ms
from worker.state.keys import KeyLayout

# KEYS: state, result. ARGV: seq, seq - 1, text, result, owner, ttl_ms, now_ms, stream_id, final (1 or 0).
# NOTE: seq is compared as a decimal string, not a Lua number: seqs go up to 2**63 - 1 and
# Lua numbers are doubles. We always write canonical decimals, so string equality is exact.
_COMMIT_SCRIPT = """
local prior = redis.call('GET', KEYS[2])
local st = redis.call('HMGET', KEYS[1], 'seq', 'text', 'owner', 'updated_ms', 'final')
if prior then return {'duplicate', st[1], st[2], st[3], st[4], prior, st[5]} end
if (st[1] or '-1') ~= ARGV[2] or st[5] == '1' then
  return {'out_of_order', st[1], st[2], st[3], st[4], false, st[5]}
end
redis.call('HSET', KEYS[1], 'stream_id', ARGV[8], 'seq', ARGV[1], 'text', ARGV[3],
           'owner', ARGV[5], 'updated_ms', ARGV[7], 'final', ARGV[9])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[6])
return {'applied', ARGV[1], ARGV[3], ARGV[5], ARGV[7], ARGV[4], ARGV[9]}
"""

CommitStatus = Literal["applied", "duplicate", "out_of_order"]


class StateUnavailable(RuntimeError):
    """Redis could not record ASR stream state; the caller must not act as if it had."""


@dataclass(frozen=True)
class StreamState:
    """An ASR stream as Redis knows it. `last_seq` is -1 for a claimed stream with no chunk yet; `final`:
    its last committed chunk said `final`, so the stream takes no more."""

    stream_id: str
    last_seq: int
    text: str
    owner: str
    updated_ms: int
    final: bool = False


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


def _text(value: bytes | None) -> str:
    return value.decode() if value is not None else ""


def _stream_state(
    stream_id: str, seq: bytes | None, text: bytes | None, owner: bytes | None, updated: bytes | None,
    final: bytes | None = None,
) -> StreamState | None:
    if seq is None:
        return None
    return StreamState(
        stream_id=stream_id,
        last_seq=int(seq),
        text=_text(text),
        owner=_text(owner),
        updated_ms=int(updated or 0),
        final=final == b"1",
    )


class AsrStreams:
    """Every ASR stream's committed state; a stream's owner defaults to this worker."""

    def __init__(self, client: RedisClient, keys: KeyLayout, *, stream_state_ttl_s: float) -> None:
        self._client = client
        self._keys = keys
        self._ttl_ms = max(1, math.ceil(stream_state_ttl_s * 1000))

    async def get_stream(self, stream_id: str) -> StreamState | None:
        """The stream's committed state; None if unknown or Redis is unavailable."""

        async def read() -> StreamState | None:
            seq, text, owner, updated, final = await self._client.redis.hmget(
                self._keys.stream(stream_id), ["seq", "text", "owner", "updated_ms", "final"]
            )
            return _stream_state(stream_id, seq, text, owner, updated, final)

        return await self._client.guarded("get_stream", None, read)

    async def get_chunk_result(self, stream_id: str, seq: int) -> bytes | None:
        """The result stored when chunk `seq` was committed; None if none or Redis is unavailable."""
        key = self._keys.chunk_result(stream_id, seq)
        return await self._client.guarded("get_chunk_result", None, lambda: self._client.redis.get(key))

    async def claim_stream(self, stream_id: str, owner: str | None = None) -> StreamState | None:
        """Makes `owner` (default: this worker) the stream's owner, creating the stream if new.

        Keeps the committed text and seq and refreshes the TTL. None if Redis is unavailable.
        """
        key, owner = self._keys.stream(stream_id), owner or self._keys.worker_id

        async def claim() -> StreamState | None:
            async with self._client.redis.pipeline(transaction=True) as pipe:
                pipe.hsetnx(key, "stream_id", stream_id)
                pipe.hsetnx(key, "seq", "-1")
                pipe.hsetnx(key, "text", "")
                pipe.hset(key, mapping={"owner": owner, "updated_ms": now_ms()})
                pipe.pexpire(key, self._ttl_ms)
                pipe.hmget(key, ["seq", "text", "owner", "updated_ms", "final"])
                *_, (seq, text, who, updated, final) = await pipe.execute()
            return _stream_state(stream_id, seq, text, who, updated, final)

        return await self._client.guarded("claim_stream", None, claim)

    async def commit_chunk(
        self, stream_id: str, seq: int, corrected_text: str, result_bytes: bytes, owner: str | None = None,
        final: bool = False,
    ) -> CommitResult:
        """Atomically commits chunk `seq` if it is last_seq + 1 (0 for a new stream) and the stream has not
        ended (`final` on its last chunk: nothing follows, `out_of_order` with `state.final`).

        Sets the committed text, seq and owner (default: this worker) and stores
        `result_bytes` under (stream, seq), so a redelivered chunk gets the same answer and
        is never applied twice, even by two workers at once. Raises `StateUnavailable` when
        Redis is unavailable or refuses the write: nothing may be assumed saved then.
        """
        if seq < 0:
            raise ValueError(f"seq must be >= 0, got {seq}")
        client = self._client
        if not client.healthy:
            client.count_error("commit_chunk")
            raise StateUnavailable(f"Redis at {client.address} is unavailable; chunk not committed")
        key = self._keys.stream(stream_id)
        try:
            async with asyncio.timeout(client.op_timeout_s):
                reply = await client.redis.eval(
                    _COMMIT_SCRIPT,
                    2,
                    key,
                    self._keys.chunk_result(stream_id, seq),
                    str(seq),
                    str(seq - 1),
                    corrected_text,
                    result_bytes,
                    owner or self._keys.worker_id,
                    self._ttl_ms,
                    now_ms(),
                    stream_id,
                    "1" if final else "0",
                )
        except UNAVAILABLE as exc:
            client.mark_unavailable("commit_chunk", exc)
            raise StateUnavailable(f"Redis at {client.address} is unavailable; chunk not committed") from exc
        except rexc.RedisError as exc:
            client.count_error("commit_chunk")
            raise StateUnavailable(f"Redis refused the commit: {client.describe(exc)}") from exc
        status, last, text, who, updated, result, final = (list(reply) + [None] * 7)[:7]
        return CommitResult(
            status=status.decode(),
            state=_stream_state(stream_id, last, text, who, updated, final),
            result=result,
        )
