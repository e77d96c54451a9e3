"""worker.state against real Redis: the shared server of the local stack for the
index, heartbeats and ASR state, and private servers for outages and passwords.

Every test on the shared server gets its own key prefix and deletes its keys
afterwards. Tests that stop, pause or lock down Redis start their own
redis-server on a free port; the local stack's server on 6379 is never touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.integration.redis_server import PrivateRedis, free_port
from worker.state import RedisAuthError, RedisState, StateUnavailable, WorkerLoad

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SCENARIO_TIMEOUT_S = 60.0
MODEL = "test-model"


def run(scenario: Awaitable[None]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(SCENARIO_TIMEOUT_S):
            await scenario

    asyncio.run(bounded())


async def eventually(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.05)


def stored(*hashes: int) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), block_size=16)


@pytest.fixture
def prefix(redis_url: str, unique_name: Callable[[str], str]) -> Iterator[str]:
    """A fresh key prefix on the shared Redis; its keys are deleted after the test."""
    name = unique_name("redis")
    yield name
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{name}:*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@contextlib.asynccontextmanager
async def running(url: str, prefix: str, *worker_ids: str, **kwargs: Any) -> AsyncIterator[list[RedisState]]:
    """Started RedisStates, one per worker id, all stopped on exit."""
    kwargs.setdefault("model", MODEL)
    states = [RedisState(url, worker_id=w, key_prefix=prefix, **kwargs) for w in worker_ids]
    try:
        for state in states:
            await state.start()
        yield states
    finally:
        for state in states:
            await state.stop()


@contextlib.asynccontextmanager
async def raw_client(url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(url)
    try:
        yield client
    finally:
        await client.aclose()


# -- prefix index --------------------------------------------------------------------------


def test_store_remove_and_clear_update_the_index(redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        async with running(redis_url, prefix, "worker-a") as [a], raw_client(redis_url) as raw:
            own = f"{prefix}:kv:{MODEL}:worker:worker-a"
            await a.publish_kv_events([stored(11, 12, 13)])
            assert await a.lookup([11, 12, 13, 14]) == [{"worker-a"}] * 3 + [set()]
            assert await raw.smembers(own) == {b"11", b"12", b"13"}

            await a.publish_kv_events([BlockRemoved(block_hashes=[12])])
            assert await a.lookup([11, 12, 13]) == [{"worker-a"}, set(), {"worker-a"}]
            assert await raw.smembers(own) == {b"11", b"13"}
            assert await raw.exists(f"{prefix}:kv:{MODEL}:block:12") == 0

            await a.publish_kv_events([AllBlocksCleared()])
            assert await a.lookup([11, 12, 13]) == [set()] * 3
            assert [k async for k in raw.scan_iter(match=f"{prefix}:kv:*")] == []
            assert a.buffered_events == 0

    run(scenario())


def test_index_entries_and_heartbeat_have_ttls(redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        async with (
            running(redis_url, prefix, "worker-a", index_ttl_s=60, heartbeat_interval_s=2) as [a],
            raw_client(redis_url) as raw,
        ):
            before = time.time_ns() // 1_000_000
            await a.publish_kv_events([stored(7)])
            block = f"{prefix}:kv:{MODEL}:block:7"
            for key in (block, f"{prefix}:kv:{MODEL}:worker:worker-a"):
                assert 0 < await raw.pttl(key) <= 60_000
            # The member's own expiry, which readers honour even while the key lives on.
            score = await raw.zscore(block, "worker-a")
            assert before + 60_000 <= score <= time.time() * 1000 + 60_000
            assert 0 < await raw.pttl(f"{prefix}:worker:worker-a") <= 6_000

    run(scenario())


def test_engine_events_are_accepted_and_junk_is_refused(redis_url: str, prefix: str) -> None:
    from engine.kv_events import AllBlocksCleared as EngineCleared
    from engine.kv_events import BlockRemoved as EngineRemoved
    from engine.kv_events import BlockStored as EngineStored

    async def scenario() -> None:
        async with running(redis_url, prefix, "worker-a") as [a]:
            await a.publish_kv_events(
                [
                    EngineStored(
                        block_hashes=[1, 2**64 - 1], parent_block_hash=None, token_ids=[], block_size=16
                    ),
                    EngineRemoved(block_hashes=[1]),
                ]
            )
            assert await a.lookup([1, 2**64 - 1]) == [set(), {"worker-a"}]
            with pytest.raises(TypeError):
                await a.publish_kv_events([stored(3), "not an event"])
            assert await a.lookup([3]) == [set()]  # nothing of a refused batch is applied
            await a.publish_kv_events([EngineCleared()])
            assert await a.lookup([2**64 - 1]) == [set()]

    run(scenario())


def test_two_workers_lookup_and_longest_prefix(redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        async with (
            running(redis_url, prefix, "worker-a", "worker-b") as [a, b],
            running(redis_url, prefix, "worker-c", model="other-model") as [c],
        ):
            await a.publish_kv_events([stored(1, 2, 3, 4)])
            await b.publish_kv_events([stored(1, 2), stored(9)])
            await c.publish_kv_events([stored(1, 2, 3)])
            both = {"worker-a", "worker-b"}
            assert await b.lookup([1, 2, 3, 9, 5]) == [both, both, {"worker-a"}, {"worker-b"}, set()]
            assert await a.longest_prefix([1, 2, 3, 4, 5]) == {"worker-a": 4, "worker-b": 2}
            assert await a.longest_prefix([1, 2, 9]) == {"worker-a": 2, "worker-b": 3}
            assert await a.longest_prefix([7, 1]) == {}
            assert await a.longest_prefix([]) == {}
            # Hashes are namespaced by model: the other model's worker sees only itself.
            assert await c.lookup([1, 9]) == [{"worker-c"}, set()]

            # Longer than one read chunk and than one write pipeline.
            long = list(range(1000, 4000))
            await a.publish_kv_events([stored(*long)])
            assert await b.longest_prefix([*long, 5]) == {"worker-a": 3000}

    run(scenario())


def test_dead_worker_ages_out_of_lookups(redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        async with running(redis_url, prefix, "worker-a") as [a], raw_client(redis_url) as raw:
            b = RedisState(
                redis_url,
                worker_id="worker-b",
                model=MODEL,
                key_prefix=prefix,
                heartbeat_interval_s=0.2,
                index_ttl_s=1.0,
            )
            await b.start()
            await b.publish_kv_events([stored(5)])
            await b.stop(deregister=False)  # as if it crashed
            assert await a.lookup([5]) == [{"worker-b"}]

            async def b_gone_from_live_lookup() -> bool:
                return await a.lookup([5]) == [set()]

            # First its heartbeat expires (3 x 0.2 s), then its index entries (1 s).
            await eventually(b_gone_from_live_lookup, "the dead worker to drop out of live lookups", 3)
            assert [w.worker for w in await a.live_workers()] == ["worker-a"]

            async def b_gone_from_index() -> bool:
                return await a.lookup([5], live_only=False) == [set()]

            await eventually(b_gone_from_index, "the dead worker's index entries to expire", 3)
            assert await raw.exists(f"{prefix}:kv:{MODEL}:block:5") == 0

    run(scenario())


def test_graceful_stop_deregisters_at_once(redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        async with running(redis_url, prefix, "worker-a") as [a]:
            b = RedisState(redis_url, worker_id="worker-b", model=MODEL, key_prefix=prefix)
            await b.start()
            await b.publish_kv_events([stored(5, 6)])
            assert await a.lookup([5, 6]) == [{"worker-b"}] * 2
            await b.stop()
            assert await a.lookup([5, 6], live_only=False) == [set()] * 2
            assert [w.worker for w in await a.live_workers()] == ["worker-a"]

    run(scenario())


def test_held_blocks_are_refreshed_before_they_expire(redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        async with (
            running(redis_url, prefix, "worker-a", index_ttl_s=1.0) as [a],
            raw_client(redis_url) as raw,
        ):
            await a.publish_kv_events([stored(42, 43), BlockRemoved(block_hashes=[43])])
            await asyncio.sleep(2.0)  # twice the TTL, with no new events
            assert await a.lookup([42, 43]) == [{"worker-a"}, set()]
            assert await raw.pttl(f"{prefix}:kv:{MODEL}:block:42") > 0

    run(scenario())


# -- liveness, load, cluster hit rate ------------------------------------------------------


def test_heartbeats_live_workers_and_cluster_hit_rate(redis_url: str, prefix: str) -> None:
    loads: dict[str, WorkerLoad] = {
        "worker-a": {"running": 2, "waiting": 1, "kv_usage": 0.5, "queries": 100, "hits": 40},
        "worker-b": {"queries": 300, "hits": 60},
        "worker-c": {"queries": 100, "hits": 100},
    }

    def load_of(worker: str) -> Callable[[], WorkerLoad]:
        return lambda: loads[worker]

    async def scenario() -> None:
        async with contextlib.AsyncExitStack() as stack:
            [a], [b] = [
                await stack.enter_async_context(running(redis_url, prefix, w, load_fn=load_of(w)))
                for w in ("worker-a", "worker-b")
            ]
            await stack.enter_async_context(
                running(redis_url, prefix, "worker-c", model="other-model", load_fn=load_of("worker-c"))
            )
            assert [w.worker for w in await b.live_workers()] == ["worker-a", "worker-b", "worker-c"]
            mine = await b.live_workers(MODEL)
            assert [w.worker for w in mine] == ["worker-a", "worker-b"]
            info = mine[0]
            assert (info.model, info.running, info.waiting, info.kv_usage) == (MODEL, 2, 1, 0.5)
            assert (info.queries, info.hits, info.hit_rate) == (100, 40, 0.4)
            assert abs(info.ts_ms - time.time() * 1000) < 10_000

            assert await a.cluster_hit_rate(MODEL) == pytest.approx(100 / 400)
            assert await a.cluster_hit_rate() == pytest.approx(200 / 500)
            loads["worker-a"] = {"queries": 200, "hits": 140}
            assert await a.heartbeat_now()
            assert await b.cluster_hit_rate(MODEL) == pytest.approx(200 / 500)
            assert await b.cluster_hit_rate("no-such-model") is None

    run(scenario())


# -- ASR stream state ----------------------------------------------------------------------


def new_stream_id() -> str:
    return f"stream with user text {uuid.uuid4().hex}"


def test_a_final_chunk_ends_its_stream(redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        async with running(redis_url, prefix, "worker-a", stream_state_ttl_s=120) as [a]:
            sid = new_stream_id()
            assert (await a.commit_chunk(sid, 0, "hello", b"r0")).applied
            last = await a.commit_chunk(sid, 1, "hello bye", b"r1", final=True)
            assert last.applied and last.state.final and await a.get_chunk_result(sid, 1) == b"r1"
            assert (await a.get_stream(sid)).final
            after = await a.commit_chunk(sid, 2, "hello bye again", b"r2")
            assert after.status == "out_of_order" and after.state.final and after.state.last_seq == 1
            assert await a.get_chunk_result(sid, 2) is None
            again = await a.commit_chunk(sid, 1, "hello bye", b"other", final=True)  # a redelivered final chunk
            assert again.status == "duplicate" and again.result == b"r1"
            claimed = await a.claim_stream(sid, "worker-b")
            assert claimed.final and claimed.last_seq == 1

    run(scenario())


def test_asr_commits_in_order_and_rejects_out_of_order(redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        async with (
            running(redis_url, prefix, "worker-a", stream_state_ttl_s=120) as [a],
            raw_client(redis_url) as raw,
        ):
            sid = new_stream_id()
            assert await a.get_stream(sid) is None
            first = await a.commit_chunk(sid, 0, "hello", b"result-0")
            assert first.applied and first.result == b"result-0"
            assert first.state is not None
            assert (first.state.stream_id, first.state.last_seq, first.state.text, first.state.owner) == (
                sid,
                0,
                "hello",
                "worker-a",
            )
            second = await a.commit_chunk(sid, 1, "hello world", b"result-1")
            assert second.applied

            gap = await a.commit_chunk(sid, 3, "skipped ahead", b"result-3")
            assert gap.status == "out_of_order" and not gap.applied and gap.result is None
            assert gap.state is not None and (gap.state.last_seq, gap.state.text) == (1, "hello world")
            assert await a.get_chunk_result(sid, 3) is None
            state = await a.get_stream(sid)
            assert state == second.state
            assert await a.get_chunk_result(sid, 0) == b"result-0"

            fresh = new_stream_id()
            late_start = await a.commit_chunk(fresh, 1, "x", b"x")
            assert late_start.status == "out_of_order" and late_start.state is None

            keys = [k.decode() async for k in raw.scan_iter(match=f"{prefix}:asr:*")]
            assert len(keys) == 3  # one state hash, two results
            assert not any("user text" in k for k in keys)  # stream ids never become key names
            for key in keys:
                assert 0 < await raw.pttl(key) <= 120_000

    run(scenario())


def test_asr_duplicate_seq_returns_the_first_result(redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        async with running(redis_url, prefix, "worker-a", "worker-b") as [a, b]:
            sid = new_stream_id()
            assert (await a.commit_chunk(sid, 0, "first", b"first-result")).applied
            again = await b.commit_chunk(sid, 0, "second", b"second-result")
            assert again.status == "duplicate" and again.result == b"first-result"
            assert again.state is not None and (again.state.text, again.state.owner) == ("first", "worker-a")
            assert (await a.commit_chunk(sid, 1, "first more", b"r1")).applied
            late = await b.commit_chunk(sid, 0, "second", b"second-result")
            assert late.status == "duplicate" and late.result == b"first-result"
            assert late.state is not None and late.state.last_seq == 1

    run(scenario())


def test_asr_concurrent_committers_apply_exactly_once(redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        async with running(redis_url, prefix, "worker-a", "worker-b") as [a, b]:
            for _ in range(10):
                sid = new_stream_id()
                for seq in range(3):
                    results = await asyncio.gather(
                        *(
                            w.commit_chunk(sid, seq, f"text {w_id} {seq}", f"{w_id}-{seq}".encode())
                            for _ in range(3)
                            for w_id, w in (("a", a), ("b", b))
                        )
                    )
                    applied = [r for r in results if r.applied]
                    assert len(applied) == 1
                    winner = applied[0].result
                    assert all(
                        r.status == "duplicate" and r.result == winner for r in results if not r.applied
                    )
                    assert await a.get_chunk_result(sid, seq) == winner
                state = await b.get_stream(sid)
                assert state is not None and state.last_seq == 2

    run(scenario())


def test_asr_claim_keeps_the_transcript(redis_url: str, prefix: str) -> None:
    async def scenario() -> None:
        async with running(redis_url, prefix, "worker-a", "worker-b") as [a, b]:
            sid = new_stream_id()
            claimed = await a.claim_stream(sid)
            assert claimed is not None
            assert (claimed.last_seq, claimed.text, claimed.owner) == (-1, "", "worker-a")
            assert (await a.commit_chunk(sid, 0, "so far", b"r0")).applied
            taken = await b.claim_stream(sid)
            assert taken is not None and (taken.last_seq, taken.text, taken.owner) == (
                0,
                "so far",
                "worker-b",
            )
            resumed = await b.commit_chunk(sid, 1, "so far and on", b"r1")
            assert resumed.applied and resumed.state is not None and resumed.state.owner == "worker-b"

    run(scenario())


# -- outages and credentials (private redis-servers) ---------------------------------------


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[Callable[..., PrivateRedis]]:
    """private_redis(password=None, start=True) -> a redis-server of this test's own, stopped after it."""
    servers: list[PrivateRedis] = []

    def make(password: str | None = None, start: bool = True) -> PrivateRedis:
        workdir = tmp_path / f"redis-{len(servers)}"
        workdir.mkdir()
        server = PrivateRedis(workdir, password)
        servers.append(server)
        if start:
            server.start()
        return server

    yield make
    for server in servers:
        server.stop()


def fast_state(url: str, errors: list[str], health: list[bool], **kwargs: Any) -> RedisState:
    """A worker that notices outages and recoveries within a fraction of a second."""
    return RedisState(
        url,
        worker_id="worker-a",
        model=MODEL,
        key_prefix="outage",
        socket_timeout_s=0.3,
        heartbeat_interval_s=0.2,
        reconnect_max_s=0.2,
        on_error=errors.append,
        on_health_change=health.append,
        **kwargs,
    )


async def assert_degraded_calls_return_defaults(state: RedisState) -> None:
    """Every call comes back at once with its safe default; only commit_chunk raises."""
    async with asyncio.timeout(2.0):
        assert await state.lookup([1, 2]) == [set(), set()]
        assert await state.longest_prefix([1, 2]) == {}
        assert await state.live_workers() == []
        assert await state.cluster_hit_rate() is None
        assert await state.heartbeat_now() is False
        assert await state.get_stream("s") is None
        assert await state.get_chunk_result("s", 0) is None
        assert await state.claim_stream("s") is None
        with pytest.raises(StateUnavailable):
            await state.commit_chunk("s", 0, "text", b"result")


def test_outage_buffers_events_and_recovers(private_redis: Callable[..., PrivateRedis]) -> None:
    server = private_redis()
    errors: list[str] = []
    health: list[bool] = []

    async def scenario() -> None:
        state = fast_state(server.url, errors, health)
        await state.start()
        try:
            assert state.healthy and health == [True]
            await state.publish_kv_events([stored(1, 2)])
            assert await state.lookup([1, 2]) == [{"worker-a"}] * 2

            await asyncio.to_thread(server.stop)
            async with asyncio.timeout(2.0):
                await state.publish_kv_events([stored(3, 4)])
                await state.publish_kv_events([BlockRemoved(block_hashes=[1])])
            assert not state.healthy and health == [True, False]
            assert state.buffered_events == 2 and state.dropped_events == 0
            await assert_degraded_calls_return_defaults(state)
            assert {"lookup", "live_workers", "commit_chunk", "claim_stream"} <= set(errors)

            # The same port, but an empty server: the worker must write back all it holds.
            await asyncio.to_thread(server.start)

            async def recovered() -> bool:
                return state.healthy and await state.lookup([1, 2, 3, 4]) == [set()] + [{"worker-a"}] * 3

            await eventually(recovered, "recovery and a full index")
            assert health == [True, False, True] and state.buffered_events == 0

            async def heartbeating() -> bool:
                return [w.worker for w in await state.live_workers()] == ["worker-a"]

            await eventually(heartbeating, "the heartbeat to come back")
            assert (await state.commit_chunk("s", 0, "text", b"result")).applied
        finally:
            async with asyncio.timeout(5.0):
                await state.stop()

    run(scenario())


def test_full_buffer_drops_oldest_and_resyncs(private_redis: Callable[..., PrivateRedis]) -> None:
    server = private_redis()
    errors: list[str] = []
    health: list[bool] = []

    async def scenario() -> None:
        state = fast_state(server.url, errors, health, event_buffer=3)
        await state.start()
        try:
            await asyncio.to_thread(server.stop)
            for h in (10, 11, 12, 13, 14):
                await state.publish_kv_events([stored(h)])
            assert state.buffered_events == 3 and state.dropped_events == 2
            await state.publish_kv_events([BlockRemoved(block_hashes=[10])])
            assert state.buffered_events == 3 and state.dropped_events == 3

            await asyncio.to_thread(server.start)

            async def resynced() -> bool:
                return await state.lookup([10, 11, 12, 13, 14]) == [set()] + [{"worker-a"}] * 4

            # The store of 11 was dropped, yet the resync writes what the worker holds.
            await eventually(resynced, "the index to match what the worker holds")

            await asyncio.to_thread(server.stop)
            await state.publish_kv_events([stored(20), stored(21)])
            await state.publish_kv_events([AllBlocksCleared()])
            assert state.buffered_events == 1  # a clear makes everything queued before it moot
        finally:
            async with asyncio.timeout(5.0):
                await state.stop()

    run(scenario())


def test_start_while_redis_is_down(private_redis: Callable[..., PrivateRedis]) -> None:
    server = private_redis(start=False)
    errors: list[str] = []
    health: list[bool] = []

    async def scenario() -> None:
        state = fast_state(server.url, errors, health)
        async with asyncio.timeout(2.0):
            await state.start()  # degraded, not an error
        try:
            assert not state.healthy and health == [] and set(errors) == {"ping"}
            await state.publish_kv_events([stored(7)])
            await assert_degraded_calls_return_defaults(state)
            await asyncio.to_thread(server.start)

            async def up() -> bool:
                return await state.lookup([7]) == [{"worker-a"}]

            await eventually(up, "the worker to connect and flush")
            assert health == [True]
        finally:
            async with asyncio.timeout(5.0):
                await state.stop()

    run(scenario())


def test_unresponsive_redis_times_out(private_redis: Callable[..., PrivateRedis]) -> None:
    server = private_redis()
    errors: list[str] = []
    health: list[bool] = []

    async def scenario() -> None:
        state = fast_state(server.url, errors, health)
        await state.start()
        try:
            server.pause()  # connections are accepted; nothing ever answers
            started = time.monotonic()
            assert await state.lookup([1]) == [set()]
            assert time.monotonic() - started < 1.5
            assert not state.healthy and "lookup" in errors
            await state.publish_kv_events([stored(1)])
            await assert_degraded_calls_return_defaults(state)
            server.resume()

            async def up() -> bool:
                return await state.lookup([1]) == [{"worker-a"}]

            await eventually(up, "the worker to recover after the pause")
        finally:
            server.resume()
            async with asyncio.timeout(5.0):
                await state.stop()

    run(scenario())


def test_calls_before_start_never_touch_the_network() -> None:
    async def scenario() -> None:
        state = RedisState(f"redis://127.0.0.1:{free_port()}/0", worker_id="w", model=MODEL)
        assert not state.healthy
        await assert_degraded_calls_return_defaults(state)
        await state.publish_kv_events([stored(1)])
        assert state.buffered_events == 2  # the initial clear of this worker's old entries, then ours
        await state.stop()

    run(scenario())


def test_wrong_password_is_a_clear_auth_error(
    private_redis: Callable[..., PrivateRedis], caplog: pytest.LogCaptureFixture
) -> None:
    right, wrong = "right-Pa55word-1f2e", "wrong-Pa55word-9c8d"
    server = private_redis(password=right)
    address = f"127.0.0.1:{server.port}"
    caplog.set_level(logging.DEBUG, logger="worker.state")

    async def expect_auth_error(url: str, password: str | None, leaked: str | None) -> None:
        state = RedisState(url, worker_id="w", model=MODEL, password=password, socket_timeout_s=1.0)
        async with asyncio.timeout(5.0):
            with pytest.raises(RedisAuthError) as caught:
                await state.start()
        message = str(caught.value)
        assert address in message and "rejected the credentials" in message
        if leaked is not None:
            assert leaked not in message and leaked not in repr(caught.value.__cause__)

    async def scenario() -> None:
        await expect_auth_error(server.url, wrong, wrong)
        await expect_auth_error(f"redis://:{wrong}@{address}/0", None, wrong)
        await expect_auth_error(server.url, None, None)

        async with running(server.url, "auth", "worker-a", password=right) as [state]:
            assert state.healthy
            await state.publish_kv_events([stored(1)])
            assert await state.lookup([1]) == [{"worker-a"}]

    run(scenario())
    assert right not in caplog.text and wrong not in caplog.text
