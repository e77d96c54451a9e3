"""worker.client against the real broker: a new group can start at the topics' current end."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from worker.client import start_group_at_end


async def _produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for i, v in enumerate(values):
            await producer.send_and_wait(topic, v, partition=i % 2)
    finally:
        await producer.stop()


async def _read_as_group(bootstrap: str, group: str, topic: str, want: int) -> list[bytes]:
    """Join `group` and read from its committed offsets (earliest where none) until `want` records came."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
                                auto_offset_reset="earliest")
    await consumer.start()
    got: list[bytes] = []
    try:
        async with asyncio.timeout(60):
            while len(got) < want:
                batch = await consumer.getmany(timeout_ms=500)
                got += [rec.value for recs in batch.values() for rec in recs]
        # Nothing more arrives after the wanted records.
        batch = await consumer.getmany(timeout_ms=1000)
        got += [rec.value for recs in batch.values() for rec in recs]
    finally:
        await consumer.stop()
    return got


def test_a_group_started_at_the_end_reads_only_what_comes_after(kafka_bootstrap, make_topic, unique_name):
    topic = make_topic("requests", partitions=2)
    asyncio.run(_produce(kafka_bootstrap, topic, [b"old-0", b"old-1", b"old-2"]))
    group = unique_name("group")
    ends = asyncio.run(start_group_at_end(kafka_bootstrap, group, [topic]))
    assert sorted((tp.partition, off) for tp, off in ends.items()) == [(0, 2), (1, 1)]
    asyncio.run(_produce(kafka_bootstrap, topic, [b"new-0", b"new-1"]))
    assert sorted(asyncio.run(_read_as_group(kafka_bootstrap, group, topic, want=2))) == [b"new-0", b"new-1"]
    # Without it, a new group starts from the beginning: all five.
    other = unique_name("group")
    assert len(asyncio.run(_read_as_group(kafka_bootstrap, other, topic, want=5))) == 5


def test_starting_a_group_on_a_missing_topic_is_a_clear_error(kafka_bootstrap, unique_name):
    with pytest.raises(RuntimeError, match="does not exist"):
        asyncio.run(start_group_at_end(kafka_bootstrap, unique_name("group"), [unique_name("missing")]))
