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


class GatedPublisher(FakePublisher):
    """Publishes hold until the test opens their gate; records every release it was given."""

    def __init__(self, consumer: FakeConsumer) -> None:
        super().__init__(consumer)
        self.gates: list[asyncio.Future] = []
        self.published: list[list[int]] = []

    async def publish(self, release):
        gate = asyncio.get_running_loop().create_future()
        self.gates.append(gate)
        outcome = await gate
        if outcome is True:
            self.published.append(list(release.offsets))
        return outcome


async def _a_revoked_partitions_flush_waits_for_the_publish_in_progress_then_sends_the_rest():
    consumer = FakeConsumer([TP0], committed={TP0: 0})
    publisher = GatedPublisher(consumer)
    w, flusher = partitions(consumer, publisher)
    await w.on_assigned({TP0})
    tracker = w.trackers[TP0]
    for off in (0, 1):
        tracker.register(off)
    tracker.complete(0, [OutRecord("results", b"0", b"v0")])
    loop_flush = asyncio.create_task(flusher.flush_all())  # the flush loop's: publishes offset 0
    await asyncio.sleep(0)
    tracker.complete(1, [OutRecord("results", b"1", b"v1")])
    revoke_flush = asyncio.create_task(flusher.flush_all(only=[TP0], complete=True))
    await asyncio.sleep(0)
    assert len(publisher.gates) == 1  # no second release while the first is being published
    publisher.gates[0].set_result(False)  # the first transaction failed: its records go back
    await loop_flush
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(publisher.gates) == 2
    publisher.gates[1].set_result(True)
    await revoke_flush
    # Before, the revocation's flush took offset 1 alone beside the failing publish of 0 and committed
    # past it, so offset 0's result was never published.
    assert publisher.published == [[0, 1]] and tracker.committed == 2 and not tracker.publishing


def test_a_revoked_partitions_flush_waits_for_the_publish_in_progress_then_sends_the_rest():
    asyncio.run(asyncio.wait_for(_a_revoked_partitions_flush_waits_for_the_publish_in_progress_then_sends_the_rest(),
                                 timeout=10))


async def _a_stalled_partition_is_set_up_again_and_a_busy_or_moving_one_is_not():
    consumer = FakeConsumer([TP0, TP1], committed={TP0: 10, TP1: 5})
    publisher = FakePublisher(consumer)
    w, flusher = partitions(consumer, publisher)
    await w.on_assigned({TP0, TP1})
    limit = w.config.worker.stall_resync_s
    w.trackers[TP0].register(10)  # taken, and nothing works on it: it would hold TP0 back for good
    w.trackers[TP1].register(5)  # taken and being generated
    working = {TP0: set(), TP1: {5}}
    positions, ends = {TP0: 11, TP1: 6}, {TP0: 11, TP1: 6}

    async def check(now):
        return await w.check_progress(now, positions, ends, lambda tp: working[tp])

    assert await check(100.0) == [] and await check(100.0 + limit - 1) == []
    assert await check(100.0 + limit) == [(TP0, "orphaned")]
    assert TP0 not in w.trackers and w.awaiting_setup[TP0].reason.startswith("resync: no progress")
    # Its producer went first: the set-up's new one fences whatever the old one left.
    assert TP0 not in publisher.producers and TP1 in publisher.producers
    await flusher.flush_all()  # the flush loop sets it up again from the committed offset
    await w.setup_retry
    assert w.trackers[TP0].next_offset == 10 and consumer.position[TP0] == 10 and TP0 not in consumer.paused
    assert TP0 in publisher.producers
    assert await check(100.0 + 10 * limit) == []  # TP1's request is still being worked on: never a stall

    # Records in the log that are not fetched: a stall too, unless the worker paused fetching (engine full).
    positions[TP0], ends[TP0] = 10, 14
    assert await check(1000.0) == []
    positions[TP0] = 12  # it moved: the wait starts again
    assert await check(1000.0 + limit) == []
    w.paused = True
    assert await check(1000.0 + 3 * limit) == []
    w.paused = False
    assert await check(2000.0) == []
    w.trackers[TP0].register(12)
    w.trackers[TP0].complete(12, [OutRecord("results", b"k", b"v")])
    w.trackers[TP0].release()  # a release being published: no stall is declared under it
    positions[TP0] = 13
    assert await check(2100.0) == [] and await check(2100.0 + limit) == []


def test_a_stalled_partition_is_set_up_again_and_a_busy_or_moving_one_is_not():
    asyncio.run(_a_stalled_partition_is_set_up_again_and_a_busy_or_moving_one_is_not())
