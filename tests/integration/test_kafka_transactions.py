"""aiokafka's transactional producer against the real broker of the local stack.

The worker's exactly-once delivery rests on two broker guarantees, checked here
end to end: read_committed consumers see committed records and never aborted
ones, and offsets sent with send_offsets_to_transaction become the group's
committed offsets only when the transaction commits. The worker's
TransactionalPublisher gets its rebalance race checked against the same broker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from worker.offsets import OutRecord, Release
from worker.publisher import TransactionalPublisher

# Generous because the first test of a fresh machine also pays for the Maven fetch and broker start.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SCENARIO_TIMEOUT_S = 60.0


def run(scenario) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(SCENARIO_TIMEOUT_S):
            await scenario

    asyncio.run(bounded())


def transactional_producer(bootstrap: str, transactional_id: str) -> AIOKafkaProducer:
    return AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        transactional_id=transactional_id,
        enable_idempotence=True,
        request_timeout_ms=20_000,
    )


async def read_all(
    bootstrap: str, topic: str, isolation_level: str, expected: int, settle_s: float = 1.0
) -> list[bytes]:
    """Every value in partition 0 from the start, read until `expected` arrived and then `settle_s` of quiet."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        isolation_level=isolation_level,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        values: list[bytes] = []
        quiet_since = None
        loop = asyncio.get_running_loop()
        # Keep reading a little after reaching `expected`, so a record that should have been
        # filtered out gets the chance to show up and fail the test.
        while quiet_since is None or loop.time() - quiet_since < settle_s:
            batch = await consumer.getmany(timeout_ms=200)
            got = [r.value for records in batch.values() for r in records]
            values.extend(got)
            if got:
                quiet_since = None
            elif len(values) >= expected and quiet_since is None:
                quiet_since = loop.time()
        return values
    finally:
        await consumer.stop()


async def group_offset(admin: AIOKafkaAdminClient, group_id: str, tp: TopicPartition) -> int | None:
    offsets = await admin.list_consumer_group_offsets(group_id, partitions=[tp])
    meta = offsets.get(tp)
    return None if meta is None or meta.offset < 0 else meta.offset


async def wait_group_offset(admin: AIOKafkaAdminClient, group_id: str, tp: TopicPartition,
                            expected: int) -> int | None:
    # NOTE: commit_transaction returns once the coordinator has logged the commit; the
    # markers that make the offsets visible to OffsetFetch land a moment later, and
    # aiokafka's OffsetFetch (< v7) cannot ask the broker to wait for them (require_stable).
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 15.0
    while (seen := await group_offset(admin, group_id, tp)) != expected and loop.time() < deadline:
        await asyncio.sleep(0.1)
    return seen


def test_read_committed_sees_committed_and_not_aborted(
    kafka_bootstrap: str, make_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    topic = make_topic("out", partitions=1)

    async def scenario() -> None:
        producer = transactional_producer(kafka_bootstrap, unique_name("txn"))
        await producer.start()
        try:
            async with producer.transaction():
                await producer.send_and_wait(topic, b"committed-1")

            await producer.begin_transaction()
            await producer.send_and_wait(topic, b"aborted-1")
            await producer.send_and_wait(topic, b"aborted-2")
            await producer.abort_transaction()

            async with producer.transaction():
                await producer.send_and_wait(topic, b"committed-2")
        finally:
            await producer.stop()

        committed = await read_all(kafka_bootstrap, topic, "read_committed", expected=2)
        assert committed == [b"committed-1", b"committed-2"]
        # The aborted records really are in the log; read_committed filtered them out.
        everything = await read_all(kafka_bootstrap, topic, "read_uncommitted", expected=4)
        assert everything == [b"committed-1", b"aborted-1", b"aborted-2", b"committed-2"]

    run(scenario())


def test_send_offsets_to_transaction_commits_group_offsets_only_on_commit(
    kafka_bootstrap: str, make_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    source = make_topic("in", partitions=1)
    sink = make_topic("out", partitions=1)
    group_id = unique_name("group")
    tp = TopicPartition(source, 0)

    async def committed_offset(admin: AIOKafkaAdminClient) -> int | None:
        return await group_offset(admin, group_id, tp)

    async def wait_committed(admin: AIOKafkaAdminClient, expected: int) -> int | None:
        return await wait_group_offset(admin, group_id, tp, expected)

    async def scenario() -> None:
        plain = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
        await plain.start()
        try:
            for i in range(3):
                await plain.send_and_wait(source, f"request-{i}".encode())
        finally:
            await plain.stop()

        # The same shape as the worker: a group member consumes, and results plus the
        # consumed offsets go out in one transaction.
        consumer = AIOKafkaConsumer(
            source,
            bootstrap_servers=kafka_bootstrap,
            group_id=group_id,
            isolation_level="read_committed",
            auto_offset_reset="earliest",
            enable_auto_commit=False,
        )
        producer = transactional_producer(kafka_bootstrap, unique_name("txn"))
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await consumer.start()
        await producer.start()
        await admin.start()
        try:
            records = []
            while len(records) < 3:
                batch = await consumer.getmany(timeout_ms=500)
                records.extend(r for rs in batch.values() for r in rs)
            assert [r.offset for r in records] == [0, 1, 2]

            # Aborted: results for all three and offset 3 must leave no trace.
            await producer.begin_transaction()
            for r in records:
                await producer.send_and_wait(sink, b"aborted:" + r.value)
            await producer.send_offsets_to_transaction({tp: 3}, group_id)
            await producer.abort_transaction()
            assert await committed_offset(admin) is None

            # Committed: the first two. Had the aborted offset 3 leaked, 2 would never show up.
            async with producer.transaction():
                for r in records[:2]:
                    await producer.send_and_wait(sink, b"done:" + r.value)
                await producer.send_offsets_to_transaction({tp: 2}, group_id)
            assert await wait_committed(admin, 2) == 2

            async with producer.transaction():
                await producer.send_and_wait(sink, b"done:" + records[2].value)
                await producer.send_offsets_to_transaction({tp: 3}, group_id)
            assert await wait_committed(admin, 3) == 3
        finally:
            await admin.close()
            await producer.stop()
            await consumer.stop()

        results = await read_all(kafka_bootstrap, sink, "read_committed", expected=3)
        assert results == [b"done:request-0", b"done:request-1", b"done:request-2"]

    run(scenario())


def test_publisher_gives_a_partition_up_mid_publish_without_hanging_or_losing_the_release(
    kafka_bootstrap: str, make_topic: Callable[..., str], unique_name: Callable[[str], str]
) -> None:
    """The race the fault suite found: a rebalance revokes a partition (remove_partitions) while the
    flush loop's publish of it is between steps. aiokafka never answers a transaction call made
    on a stopped producer, so that publish used to wait for ever, and the worker's flush loop
    with it. Now the removal waits for the publish, which commits."""
    source = make_topic("in", partitions=1)
    sink = make_topic("out", partitions=1)
    group_id = unique_name("group")
    tp = TopicPartition(source, 0)
    outcomes: list[str] = []
    expected = [f"result-{i}".encode() for i in range(50)]

    async def scenario() -> None:
        pub = TransactionalPublisher({"bootstrap_servers": kafka_bootstrap, "request_timeout_ms": 20_000}, group_id,
                                     unique_name("txn"), 60_000, outcomes.append, publish_timeout_s=20.0)
        assert await pub.add_partitions([tp]) == []
        records = [OutRecord(sink, b"k", value) for value in expected]
        publishing = asyncio.create_task(pub.publish(Release(source, 0, records, commit_offset=50)))
        while not any(stage.startswith(("send", "add offset")) for _, stage, _ in pub.busy()):
            await asyncio.sleep(0)  # until the publish is inside its transaction
        await pub.remove_partitions([tp])
        assert publishing.done() and publishing.result() is True
        assert not pub.has_producer(tp) and outcomes == ["committed"]
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        try:
            assert await wait_group_offset(admin, group_id, tp, 50) == 50
        finally:
            await admin.close()
        assert await read_all(kafka_bootstrap, sink, "read_committed", expected=50) == expected

    run(scenario())
