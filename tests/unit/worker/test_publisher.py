"""TransactionalPublisher's transaction bookkeeping, against a producer fake that enforces aiokafka's states.

The real thing runs in tests/integration and tests/fault; these cover the paths a broker rarely takes:
two flushes of one partition at once, a publish cancelled mid-transaction, a fenced producer, a
partition removed during a publish, a publish that never finishes, an abort that fails.
"""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaError, ProducerFenced

from worker.offsets import Release
from worker.publisher import (
    PartitionLost,
    PartitionResync,
    ReplaceableProducer,
    TransactionalPublisher,
    sender_died,
)

TP = TopicPartition("requests", 0)


class FakeProducer:
    """Raises as aiokafka does when a transaction is begun inside another one."""

    def __init__(self, send_delay: float = 0.0, fenced: bool = False) -> None:
        self.in_txn = False
        self.committed: list[int] = []
        self.aborted = 0
        self.send_delay = send_delay
        self.fenced = fenced
        self.stopped = False

    async def begin_transaction(self) -> None:
        if self.fenced:
            raise ProducerFenced()
        assert not self.in_txn, "Invalid state transition IN_TRANSACTION -> IN_TRANSACTION"
        self.in_txn = True

    async def send(self, topic, value, key=None, headers=None) -> asyncio.Future:
        await asyncio.sleep(self.send_delay)
        delivered = asyncio.get_running_loop().create_future()  # aiokafka: resolved once the broker has it
        delivered.set_result(None)
        return delivered

    async def send_offsets_to_transaction(self, offsets, group_id) -> None:
        self.pending = offsets[TP]

    async def commit_transaction(self) -> None:
        self.in_txn = False
        self.committed.append(self.pending)

    async def abort_transaction(self) -> None:
        self.in_txn = False
        self.aborted += 1

    async def stop(self) -> None:
        self.stopped = True


class StoppableProducer(FakeProducer):
    """Like aiokafka: once stopped, the transaction calls wait for a sender that is gone, for ever."""

    async def _gone(self) -> None:
        if self.stopped:
            await asyncio.Event().wait()

    async def send_offsets_to_transaction(self, offsets, group_id) -> None:
        await self._gone()
        await super().send_offsets_to_transaction(offsets, group_id)

    async def commit_transaction(self) -> None:
        await self._gone()
        await super().commit_transaction()

    async def abort_transaction(self) -> None:
        await self._gone()
        await super().abort_transaction()


def publisher(producer: FakeProducer, timeout_s: float = 30.0) -> tuple[TransactionalPublisher, list[str]]:
    outcomes: list[str] = []
    pub = TransactionalPublisher({}, "group", "txn", 60_000, outcomes.append, publish_timeout_s=timeout_s)
    pub._producers[TP] = producer
    return pub, outcomes


def release(offset: int) -> Release:
    return Release(TP.topic, TP.partition, records=[], commit_offset=offset)


async def _concurrent_flushes_of_one_partition_take_turns():
    producer = FakeProducer(send_delay=0.01)
    pub, outcomes = publisher(producer)
    rel = [Release(TP.topic, TP.partition, records=[_Rec()], commit_offset=n) for n in (5, 9)]
    assert await asyncio.gather(*(pub.publish(r) for r in rel)) == [True, True]
    assert producer.committed == [5, 9] and outcomes == ["committed", "committed"]


async def _a_publish_cancelled_mid_transaction_is_aborted_before_the_next():
    producer = FakeProducer(send_delay=10)
    pub, _ = publisher(producer)
    task = asyncio.create_task(pub.publish(Release(TP.topic, TP.partition, records=[_Rec()], commit_offset=3)))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert producer.in_txn  # left open, as a rebalance or shutdown can leave it
    producer.send_delay = 0
    assert await pub.publish(release(3)) is True
    assert producer.aborted == 1 and producer.committed == [3] and not producer.in_txn


async def _any_failure_rolls_the_transaction_back_and_asks_for_a_retry():
    producer = FakeProducer()
    pub, outcomes = publisher(producer)

    async def broken(*args, **kwargs):
        raise RuntimeError("not a KafkaError")

    producer.send_offsets_to_transaction = broken
    assert await pub.publish(release(4)) is False
    assert outcomes == ["aborted"] and producer.aborted == 1 and not producer.in_txn


async def _fenced_producer_gives_the_partition_up():
    producer = FakeProducer(fenced=True)
    pub, outcomes = publisher(producer)
    with pytest.raises(PartitionLost):
        await pub.publish(release(1))
    assert outcomes == ["fenced"] and producer.stopped and TP not in pub._producers


async def _removing_a_partition_waits_for_its_publish_instead_of_stranding_it():
    producer = StoppableProducer(send_delay=0.05)
    pub, outcomes = publisher(producer)
    rel = Release(TP.topic, TP.partition, records=[_Rec(), _Rec()], commit_offset=7)
    publishing = asyncio.create_task(pub.publish(rel))
    await asyncio.sleep(0.01)  # the publish is between its sends, as a rebalance can find it
    async with asyncio.timeout(5):  # before the fix the publish waited for ever on the stopped producer
        await pub.remove_partitions([TP])
        assert await publishing is True
    assert producer.committed == [7] and outcomes == ["committed"]
    assert producer.stopped and not pub.has_producer(TP)


async def _a_publish_that_does_not_finish_times_out_and_asks_for_a_resync():
    producer = FakeProducer(send_delay=10)
    pub, outcomes = publisher(producer, timeout_s=0.05)
    with pytest.raises(PartitionResync, match="timed out at send 1 records"):
        await pub.publish(Release(TP.topic, TP.partition, records=[_Rec()], commit_offset=2))
    assert outcomes == ["timed_out"] and producer.stopped and not pub.has_producer(TP)
    assert pub.busy() == []  # nothing left in progress for the watchdog


async def _a_failed_transaction_that_cannot_be_aborted_asks_for_a_resync():
    producer = FakeProducer()
    pub, outcomes = publisher(producer)

    async def broken(*args, **kwargs):
        raise RuntimeError("commit failed")

    async def abort_refused():
        raise RuntimeError("Invalid state transition")

    producer.commit_transaction = broken
    producer.abort_transaction = abort_refused
    with pytest.raises(PartitionResync, match="could not be aborted"):
        await pub.publish(release(4))
    assert outcomes == ["aborted"] and producer.stopped and not pub.has_producer(TP)


async def _busy_reports_the_stage_of_a_publish_in_progress():
    producer = FakeProducer(send_delay=10)
    pub, _ = publisher(producer)
    task = asyncio.create_task(pub.publish(Release(TP.topic, TP.partition, records=[_Rec()], commit_offset=3)))
    await asyncio.sleep(0.01)
    [(tp, stage, seconds)] = pub.busy()
    assert tp == TP and stage == "send 1 records" and 0 <= seconds < 5
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pub.busy() == []


class _Rec:
    topic, value, key, headers = "results", b"v", b"k", ()


def test_concurrent_flushes_of_one_partition_take_turns():
    asyncio.run(_concurrent_flushes_of_one_partition_take_turns())


def test_a_publish_cancelled_mid_transaction_is_aborted_before_the_next():
    asyncio.run(_a_publish_cancelled_mid_transaction_is_aborted_before_the_next())


def test_any_failure_rolls_the_transaction_back_and_asks_for_a_retry():
    asyncio.run(_any_failure_rolls_the_transaction_back_and_asks_for_a_retry())


def test_fenced_producer_gives_the_partition_up():
    asyncio.run(_fenced_producer_gives_the_partition_up())


def test_removing_a_partition_waits_for_its_publish_instead_of_stranding_it():
    asyncio.run(_removing_a_partition_waits_for_its_publish_instead_of_stranding_it())


def test_a_publish_that_does_not_finish_times_out_and_asks_for_a_resync():
    asyncio.run(_a_publish_that_does_not_finish_times_out_and_asks_for_a_resync())


def test_a_failed_transaction_that_cannot_be_aborted_asks_for_a_resync():
    asyncio.run(_a_failed_transaction_that_cannot_be_aborted_asks_for_a_resync())


def test_busy_reports_the_stage_of_a_publish_in_progress():
    asyncio.run(_busy_reports_the_stage_of_a_publish_in_progress())


class EndedOrAlive:
    """Just what ReplaceableProducer reads of an AIOKafkaProducer: start, stop and the sender's task."""

    def __init__(self, starts: bool = True) -> None:
        self.starts = starts
        self.stopped = False
        self._sender = type("Sender", (), {"sender_task": None})()

    async def start(self) -> None:
        if not self.starts:
            raise OSError("broker unreachable")
        self._sender.sender_task = asyncio.get_running_loop().create_future()  # running

    def end(self) -> None:
        self._sender.sender_task.set_exception(KafkaError("Unexpected error during batch delivery"))

    async def stop(self) -> None:
        self.stopped = True


async def _an_ended_producer_is_replaced_at_most_once_per_retry_interval():
    made: list[EndedOrAlive] = []

    def make() -> EndedOrAlive:
        made.append(EndedOrAlive(starts=len(made) != 1))  # the first replacement fails to start
        return made[-1]

    holder = ReplaceableProducer(make, "test", retry_s=60.0)
    await holder.start()
    assert not await holder.replace_if_ended()  # alive: kept
    made[0].end()
    assert sender_died(made[0])
    assert not await holder.replace_if_ended() and holder.producer is made[0] and made[1].stopped  # start failed
    assert not await holder.replace_if_ended() and len(made) == 2  # and no new try within retry_s
    holder._last_try -= 60.0
    assert await holder.replace_if_ended() and holder.producer is made[2] and made[0].stopped


def test_an_ended_producer_is_replaced_at_most_once_per_retry_interval():
    asyncio.run(_an_ended_producer_is_replaced_at_most_once_per_retry_interval())
