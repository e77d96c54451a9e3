"""How the worker takes a partition on, and takes it on again: producer first, then the committed offset.

A consumer and a publisher fake stand in for aiokafka; the real broker runs these paths in
tests/integration/test_worker.py and tests/fault. Covered here: a producer that fails to start
leaves its partition paused until a retry succeeds; the position is set from the committed
offset read after the producer started (and the tracker skips records below it); a partition
whose transaction outcome is unknown, or whose producer was fenced, is set up again.
"""

from __future__ import annotations

import asyncio

from aiokafka import TopicPartition

from worker.config import ServiceConfig
from worker.flusher import Flusher
from worker.offsets import OutRecord
from worker.partitions import Partitions
from worker.publisher import PartitionLost, PartitionResync

TP0 = TopicPartition("requests", 0)
TP1 = TopicPartition("requests", 1)


class FakeConsumer:
    def __init__(self, assigned, committed) -> None:
        self.assigned = set(assigned)
        self.offsets = dict(committed)  # what the group has committed, read by committed()
        self.position: dict[TopicPartition, int] = {}
        self.paused: set[TopicPartition] = set()
        self.log: list[str] = []

    def assignment(self):
        return set(self.assigned)

    def seek(self, tp, offset) -> None:
        self.position[tp] = offset

    def pause(self, *tps) -> None:
        self.paused.update(tps)

    def resume(self, *tps) -> None:
        self.paused.difference_update(tps)

    async def committed(self, tp):
        self.log.append(f"committed {tp.partition}")
        return self.offsets.get(tp)


class FakePublisher:
    def __init__(self, consumer: FakeConsumer, fail_starts: int = 0) -> None:
        self.consumer = consumer
        self.fail_starts = fail_starts
        self.producers: set[TopicPartition] = set()
        self.outcome: object = True

    async def add_partitions(self, tps):
        failed = []
        for tp in tps:
            if self.fail_starts:
                self.fail_starts -= 1
                failed.append(tp)
            else:
                self.consumer.log.append(f"producer {tp.partition}")
                self.producers.add(tp)
        return failed

    async def remove_partitions(self, tps) -> None:
        self.producers.difference_update(tps)

    async def publish(self, release):
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    def busy(self, now=None):
        return []


def partitions(consumer: FakeConsumer, publisher: FakePublisher) -> tuple[Partitions, Flusher]:
    """Partitions and the flusher with Kafka clients replaced and no requests in flight."""
    p = Partitions(consumer, publisher, ServiceConfig(), asyncio.Event(), forget_work=lambda tp: 0)
    p.active = True
    return p, Flusher(p, publisher, flush_interval_s=0.05, eager=True, stopping=asyncio.Event())


async def _producer_first_then_the_committed_offset():
    consumer = FakeConsumer([TP0, TP1], committed={TP0: 40})
    w, _ = partitions(consumer, FakePublisher(consumer))
    await w.on_assigned({TP0, TP1})
    # Each partition's offset is read only after its producer fenced the previous owner.
    assert consumer.log.index("producer 0") < consumer.log.index("committed 0")
    assert consumer.log.index("producer 1") < consumer.log.index("committed 1")
    assert consumer.position == {TP0: 40, TP1: 0}  # nothing committed on 1: from the start of the log (0, or the reset policy)
    assert w.trackers[TP0].next_offset == 40 and w.trackers[TP1].next_offset == 0
    assert not consumer.paused and not w.awaiting_setup


async def _a_producer_that_fails_to_start_keeps_its_partition_paused_until_a_retry():
    consumer = FakeConsumer([TP0, TP1], committed={TP0: 5, TP1: 9})
    w, flusher = partitions(consumer, FakePublisher(consumer, fail_starts=1))
    await w.on_assigned({TP0, TP1})
    assert set(w.trackers) == {TP1} and consumer.paused == {TP0}
    assert w.awaiting_setup[TP0].reason == "assigned: set-up failed"
    w.awaiting_setup[TP0].retry_at = 0.0  # its wait is over
    await flusher.flush_all()  # nothing to publish: the flush loop still starts the retry
    await w.setup_retry
    assert set(w.trackers) == {TP0, TP1} and not consumer.paused and not w.awaiting_setup
    assert consumer.position == {TP0: 5, TP1: 9}


async def _a_partition_revoked_during_its_set_up_gets_no_producer():
    consumer = FakeConsumer([TP0], committed={})
    publisher = FakePublisher(consumer)
    w, _ = partitions(consumer, publisher)
    started = publisher.add_partitions

    async def revoked_meanwhile(tps):
        failed = await started(tps)
        consumer.assigned.clear()
        return failed

    publisher.add_partitions = revoked_meanwhile
    await w.on_assigned({TP0})
    assert not w.trackers and not publisher.producers


async def _an_unknown_outcome_resyncs_and_fencing_waits_before_trying_again():
    consumer = FakeConsumer([TP0, TP1], committed={TP0: 3, TP1: 7})
    publisher = FakePublisher(consumer)
    w, flusher = partitions(consumer, publisher)
    await w.on_assigned({TP0, TP1})
    for tp in (TP0, TP1):
        w.trackers[tp].register(10)
        w.trackers[tp].complete(10, [OutRecord("results", b"k", b"v")])

    publisher.outcome = PartitionResync("requests-0: transaction timed out at commit")
    await flusher.flush_all(only=[TP0])
    assert TP0 not in w.trackers and TP0 in consumer.paused
    assert w.awaiting_setup[TP0].reason.startswith("resync")
    consumer.offsets[TP0] = 11  # the new producer finished the transaction: it had committed
    publisher.outcome = PartitionLost("requests-1: fenced by a newer owner")
    await flusher.flush_all()  # TP1 fenced; TP0's resync starts at once
    await w.setup_retry
    assert consumer.position[TP0] == 11 and w.trackers[TP0].next_offset == 11 and TP0 not in consumer.paused
    wait = w.awaiting_setup[TP1]
    assert wait.reason == "fenced by another producer"
    assert wait.retry_at - wait.since >= 10.0 and TP1 in consumer.paused


def test_producer_first_then_the_committed_offset():
    asyncio.run(_producer_first_then_the_committed_offset())


def test_a_producer_that_fails_to_start_keeps_its_partition_paused_until_a_retry():
    asyncio.run(_a_producer_that_fails_to_start_keeps_its_partition_paused_until_a_retry())


def test_a_partition_revoked_during_its_set_up_gets_no_producer():
    asyncio.run(_a_partition_revoked_during_its_set_up_gets_no_producer())


def test_an_unknown_outcome_resyncs_and_fencing_waits_before_trying_again():
    asyncio.run(_an_unknown_outcome_resyncs_and_fencing_waits_before_trying_again())


def test_unread_fenced_futures_are_not_logged_as_errors_and_other_loop_errors_still_are():
    from aiokafka.errors import ProducerFenced

    from worker.lifecycle import quiet_fenced_futures

    class Loop:
        def __init__(self) -> None:
            self.seen: list[dict] = []

        def default_exception_handler(self, context) -> None:
            self.seen.append(context)

    loop = Loop()
    quiet_fenced_futures(loop, {"message": "Future exception was never retrieved", "exception": ProducerFenced()})
    assert loop.seen == []
    other = {"message": "Future exception was never retrieved", "exception": RuntimeError("boom")}
    quiet_fenced_futures(loop, other)
    fenced_elsewhere = {"message": "Task exception was never retrieved", "exception": ProducerFenced()}
    quiet_fenced_futures(loop, fenced_elsewhere)
    assert loop.seen == [other, fenced_elsewhere]
