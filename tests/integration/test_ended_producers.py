"""Producers that aiokafka has ended, against the real broker: the streaming-delta producer, the
at-least-once results producer and the client's request producer are replaced, so deltas, results and
requests keep flowing.

aiokafka ends a producer for good when its sender task fails (it raised "Unexpected error in sender
routine" in a fault test, after a broker restart): the task's done-callback fails everything pending and
every later send raises that error. The tests put a producer in exactly that state through aiokafka's own
callback, with a sender task that fails, since a real failure cannot be called up on demand.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from worker.client import RequestProducer
from worker.offsets import OutRecord, Release
from worker.publisher import AtLeastOncePublisher, DeltaPublisher, sender_died

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


async def end(producer: AIOKafkaProducer, topic: str) -> None:
    """Fail the producer's sender task the way aiokafka's does when its routine dies."""
    sender = producer._sender
    sender.sender_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):  # the routine may end quietly on cancellation
        await sender.sender_task

    async def routine_fails() -> None:
        raise KafkaError("Unexpected error during batch delivery")

    sender._sender_task = asyncio.create_task(routine_fails())
    sender._sender_task.add_done_callback(sender._fail_all)
    await asyncio.sleep(0.01)
    assert sender_died(producer)
    with pytest.raises(KafkaError):  # the state being tested: every send fails from now on
        await producer.send(topic, b"never sent")


async def read_all(bootstrap: str, topic: str, n: int) -> list[bytes]:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                enable_auto_commit=False)
    await consumer.start()
    values: list[bytes] = []
    try:
        async with asyncio.timeout(30):
            while len(values) < n:
                batch = await consumer.getmany(timeout_ms=500)
                values += [r.value for recs in batch.values() for r in recs]
    finally:
        await consumer.stop()
    return values


async def _deltas_keep_flowing_after_their_producer_ended(bootstrap: str, topic: str) -> None:
    errors: list[int] = []
    deltas = DeltaPublisher({"bootstrap_servers": bootstrap}, on_error=lambda: errors.append(1))
    await deltas.start()
    try:
        await deltas.send(topic, b"s", b"before", [])
        await deltas._producer.producer.flush()
        await end(deltas._producer.producer, topic)
        await deltas.send(topic, b"s", b"after", [])  # before: dropped, and so was every later delta
        await deltas.send(topic, b"s", b"later", [])
        await deltas._producer.producer.flush()
    finally:
        await deltas.close()
    assert await read_all(bootstrap, topic, 3) == [b"before", b"after", b"later"] and not errors


async def _at_least_once_results_resume_after_their_producer_ended(bootstrap: str, topic: str) -> None:
    commits: list[dict] = []

    async def commit(offsets) -> None:
        commits.append(offsets)

    publisher = AtLeastOncePublisher({"bootstrap_servers": bootstrap}, commit)
    await publisher.start()
    try:
        await end(publisher._producer.producer, topic)
        release = Release("requests", 0, [OutRecord(topic, b"k", b"result")], commit_offset=8, offsets=[7])
        assert await publisher.publish(release) is False  # fails, and replaces the ended producer
        assert await publisher.publish(release) is True  # before: False on every flush, for good
    finally:
        await publisher.close()
    assert commits == [{TopicPartition("requests", 0): 8}]
    assert await read_all(bootstrap, topic, 1) == [b"result"]


def test_deltas_keep_flowing_after_their_producer_ended(kafka_bootstrap, make_topic):
    asyncio.run(_deltas_keep_flowing_after_their_producer_ended(kafka_bootstrap, make_topic("deltas")))


def test_at_least_once_results_resume_after_their_producer_ended(kafka_bootstrap, make_topic):
    asyncio.run(_at_least_once_results_resume_after_their_producer_ended(kafka_bootstrap, make_topic("results")))


async def _a_client_keeps_sending_requests_after_its_producer_ended(bootstrap: str, topic: str) -> None:
    async with RequestProducer(bootstrap) as producer:
        await (await producer.send(topic, b"first"))
        await end(producer._producer.producer, topic)
        delivered = await (await producer.send(topic, b"second"))  # before: KafkaError on every send, for good
    assert delivered.topic == topic
    assert await read_all(bootstrap, topic, 2) == [b"first", b"second"]


def test_a_client_keeps_sending_requests_after_its_producer_ended(kafka_bootstrap, make_topic):
    asyncio.run(_a_client_keeps_sending_requests_after_its_producer_ended(kafka_bootstrap, make_topic("requests")))
