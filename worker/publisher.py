"""Publishing results with their consumed offsets.

Exactly-once: one transactional producer per assigned input partition, with
the stable transactional id `<prefix>.<group>.<topic>.<partition>`. Each
release (a partition's finished outputs plus the offset after them) is one
transaction: send the records, `send_offsets_to_transaction`, commit.

NOTE: why per partition and not per worker. aiokafka sends TxnOffsetCommit at
version 0, which carries no consumer-group generation, so the broker cannot
fence a stale member by group membership (KIP-447 needs v3). Keying the
transactional id on the input partition restores fencing: the new owner's
InitProducerId bumps the epoch, which aborts the old owner's open transaction
and makes any late commit from it fail with ProducerFenced. It also finishes a
transaction the old owner left half-committed before the new owner reads the
group's offsets.

At-least-once (config fallback): records are sent with acks=all and awaited,
and only then is the offset committed through the consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError, ProducerFenced

from worker.offsets import Release

log = logging.getLogger(__name__)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


class PartitionLost(Exception):
    """The partition now belongs to another worker; drop its in-flight work."""


class PartitionResync(Exception):
    """Whether the partition's last transaction committed is not known here (it timed out, or
    failed and could not be aborted). Drop its in-flight work and set it up again: a new producer
    finishes that transaction, and the group's committed offset then says where to resume."""


class TransactionalPublisher:
    def __init__(self, client_kwargs: dict, group_id: str, txn_prefix: str, transaction_timeout_ms: int,
                 on_transaction: Callable[[str], None] | None = None, publish_timeout_s: float = 30.0) -> None:
        self._kwargs = client_kwargs
        self._group_id = group_id
        self._prefix = txn_prefix
        self._timeout_ms = transaction_timeout_ms
        self._publish_timeout_s = publish_timeout_s
        self._on_txn = on_transaction or (lambda outcome: None)
        self._producers: dict[TopicPartition, AIOKafkaProducer] = {}
        # One transaction at a time per partition: the flush loop and a rebalance may both flush it,
        # and a producer is only stopped between transactions (see remove_partitions).
        self._locks: dict[TopicPartition, asyncio.Lock] = defaultdict(asyncio.Lock)
        # Begun and not yet committed or aborted: a publish cancelled part-way leaves its partition here.
        self._open: set[TopicPartition] = set()
        # What each publish in progress is doing and since when, for the worker's stall watchdog;
        # keyed by publish, as a second publish of a partition may wait behind the first.
        self._stage: dict[int, tuple[TopicPartition, str, float]] = {}
        self._starting: dict[TopicPartition, float] = {}  # producers in start() (InitProducerId), since when

    def transactional_id(self, tp: TopicPartition) -> str:
        return f"{self._prefix}.{self._group_id}.{tp.topic}.{tp.partition}"

    async def add_partitions(self, tps: list[TopicPartition]) -> list[TopicPartition]:
        """Start the producers `tps` lack; returns those that could not be started (logged)."""
        new = [tp for tp in tps if tp not in self._producers and tp not in self._starting]
        outcomes = await asyncio.gather(*(self._start(tp) for tp in new), return_exceptions=True)
        failed = [tp for tp in tps if tp in self._starting]  # another caller's start still running
        for tp, outcome in zip(new, outcomes, strict=True):
            if isinstance(outcome, asyncio.CancelledError):
                raise outcome
            if isinstance(outcome, BaseException):
                log.warning("could not start the producer for %s yet: %r", tp, outcome)
                failed.append(tp)
        return failed

    async def _start(self, tp: TopicPartition) -> None:
        producer = AIOKafkaProducer(
            **self._kwargs,
            transactional_id=self.transactional_id(tp),
            enable_idempotence=True,
            transaction_timeout_ms=self._timeout_ms,
            acks="all",
            linger_ms=2,
        )
        # start() runs InitProducerId: this fences the previous owner and waits
        # for any transaction it left in flight to finish.
        self._starting[tp] = time.monotonic()
        try:
            async with asyncio.timeout(self._publish_timeout_s):
                await producer.start()
        except BaseException:
            await self._stop(producer)  # its connections would leak
            raise
        finally:
            self._starting.pop(tp, None)
        self._producers[tp] = producer

    async def _stop(self, producer: AIOKafkaProducer) -> None:
        # Bounded: stop() flushes what the producer holds, which can wait on an absent broker.
        # A producer left behind is harmless, as the partition's next producer fences it.
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self._publish_timeout_s):
                await producer.stop()

    async def remove_partitions(self, tps: list[TopicPartition]) -> None:
        await asyncio.gather(*(self._remove(tp) for tp in tps))

    async def _remove(self, tp: TopicPartition) -> None:
        # NOTE: never stop a producer under a transaction in progress. aiokafka resolves
        # commit_transaction() and send_offsets_to_transaction() from the sender task that
        # stop() cancels, so the publish awaiting them would wait for ever, holding the
        # partition's lock and the worker's flush loop with it (seen as workers that stopped
        # committing after a rebalance, until shutdown). The lock waits for at most one
        # publish, which is itself bounded.
        async with self._locks[tp]:
            producer = self._producers.pop(tp, None)
            self._open.discard(tp)
            if producer is not None:
                await self._stop(producer)

    async def publish(self, release: Release) -> bool:
        """Commit one release; False means retry later (nothing of it was committed).

        Raises PartitionLost if fenced, PartitionResync if the outcome is not known.
        """
        tp = TopicPartition(release.topic, release.partition)
        key = id(release)

        def stage(name: str) -> None:
            self._stage[key] = (tp, name, time.monotonic())

        stage("waiting for the partition's previous transaction")
        try:
            async with self._locks[tp]:
                try:
                    async with asyncio.timeout(self._publish_timeout_s):
                        return await self._publish(tp, release, stage)
                except TimeoutError:
                    at = self._stage[key][1]
                    log.warning("transaction for %s did not finish in %.0f s (at: %s); resyncing the partition",
                                tp, self._publish_timeout_s, at)
                    self._on_txn("timed_out")
                    await self._drop_producer(tp)
                    raise PartitionResync(f"{tp}: transaction timed out at {at}") from None
        finally:
            self._stage.pop(key, None)

    def busy(self, now: float | None = None) -> list[tuple[TopicPartition, str, float]]:
        """Publishes in progress: (partition, stage, seconds in that stage)."""
        now = time.monotonic() if now is None else now
        starting = [(tp, "start producer (InitProducerId)", now - since) for tp, since in self._starting.items()]
        return starting + [(tp, stage, now - since) for tp, stage, since in self._stage.values()]

    def has_producer(self, tp: TopicPartition) -> bool:
        return tp in self._producers

    async def _drop_producer(self, tp: TopicPartition) -> None:
        """Forget and stop the producer (lock held by the caller); the next set-up fences it."""
        producer = self._producers.pop(tp, None)
        self._open.discard(tp)
        if producer is not None:
            await self._stop(producer)

    async def _publish(self, tp: TopicPartition, release: Release, stage: Callable[[str], None]) -> bool:
        producer = self._producers.get(tp)
        if producer is not None and tp in self._open:
            # An earlier publish was cancelled mid-transaction (shutdown): its transaction is
            # still open, holding back read_committed readers. End it first.
            stage("aborting an interrupted transaction")
            await self._abort_or_resync(tp, producer)
        if producer is None:
            return False  # not set up (yet): the worker sets it up before it takes records
        try:
            stage("begin")
            await producer.begin_transaction()
            self._open.add(tp)
            stage(f"send {len(release.records)} records")
            for rec in release.records:
                sent = await producer.send(rec.topic, rec.value, key=rec.key, headers=list(rec.headers))
                # commit_transaction reports a failed send; without this, asyncio would also log
                # each failed record's future ("exception was never retrieved") when it is collected.
                sent.add_done_callback(_retrieve)
            stage(f"add offset {release.commit_offset}")
            await producer.send_offsets_to_transaction({tp: release.commit_offset}, self._group_id)
            stage("commit")
            await producer.commit_transaction()
            self._open.discard(tp)
            self._on_txn("committed")
            return True
        except ProducerFenced as exc:
            self._on_txn("fenced")
            await self._drop_producer(tp)
            raise PartitionLost(f"{tp}: fenced by a newer owner") from exc
        except Exception as exc:
            # A Kafka error, or aiokafka refusing a state change: either way the transaction
            # must not stay open (an open one stalls every read_committed reader of the topic).
            log.warning("transaction for %s failed, will retry: %r", tp, exc)
            self._on_txn("aborted")
            stage("aborting a failed transaction")
            await self._abort_or_resync(tp, producer)
            return False

    async def _abort_or_resync(self, tp: TopicPartition, producer: AIOKafkaProducer) -> None:
        try:
            await producer.abort_transaction()
            self._open.discard(tp)
        except Exception as exc:
            # Not aborted, so perhaps committed: only the partition's next producer (whose
            # InitProducerId finishes the transaction either way) and the group's offset can tell.
            await self._drop_producer(tp)
            raise PartitionResync(f"{tp}: transaction could not be aborted ({exc!r})") from exc

    async def close(self) -> None:
        await self.remove_partitions(list(self._producers))


def sender_died(producer: AIOKafkaProducer) -> bool:
    """Whether aiokafka has ended `producer` for good: its sender task failed (an unexpected error in
    it, seen after a broker restart; or a fatal one such as OutOfOrderSequenceNumber), and from then
    on every send raises that failure. aiokafka has no public call for this; a producer without the
    attribute reads as alive."""
    task = getattr(getattr(producer, "_sender", None), "sender_task", None)
    return task is not None and task.done() and not task.cancelled() and task.exception() is not None


class ReplaceableProducer:
    """A producer outside transactions that is replaced by a new one when aiokafka has ended it
    (sender_died), at most once per `retry_s`. A transactional producer is not: the partition's
    resync starts its next one (TransactionalPublisher)."""

    def __init__(self, make: Callable[[], AIOKafkaProducer], name: str, retry_s: float = 5.0,
                 start_timeout_s: float = 30.0) -> None:
        self._make = make
        self._name = name
        self._retry_s = retry_s
        self._start_timeout_s = start_timeout_s
        self._last_try = float("-inf")
        self.producer = make()

    async def start(self) -> None:
        await self.producer.start()

    async def replace_if_ended(self) -> bool:
        """Start a new producer in place of an ended one; True when the producer was replaced."""
        now = time.monotonic()
        if not sender_died(self.producer) or now - self._last_try < self._retry_s:
            return False
        self._last_try = now
        fresh = self._make()
        try:
            async with asyncio.timeout(self._start_timeout_s):
                await fresh.start()
        except Exception as exc:
            log.warning("the %s producer ended and a new one could not start yet: %r", self._name, exc)
            await _stop_quietly(fresh, self._start_timeout_s)
            return False
        ended, self.producer = self.producer, fresh
        log.warning("the %s producer had ended (%r); replaced it", self._name, ended._sender.sender_task.exception())
        await _stop_quietly(ended, self._start_timeout_s)
        return True

    async def send(self, topic: str, value: bytes, key: bytes | None, headers: list[tuple[str, bytes]]) -> asyncio.Future:
        """Send one record; returns its delivery future. An ended producer refuses a record before it
        takes it, so after a replacement the record is sent once more; other KafkaErrors propagate."""
        try:
            return await self.producer.send(topic, value, key=key, headers=headers)
        except KafkaError:
            if not await self.replace_if_ended():
                raise
        return await self.producer.send(topic, value, key=key, headers=headers)

    async def stop(self) -> None:
        await self.producer.stop()


async def _stop_quietly(producer: AIOKafkaProducer, timeout_s: float) -> None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(timeout_s):
            await producer.stop()


class AtLeastOncePublisher:
    def __init__(self, client_kwargs: dict, commit: Callable[[dict[TopicPartition, int]], Awaitable[None]],
                 on_transaction: Callable[[str], None] | None = None) -> None:
        self._producer = ReplaceableProducer(
            lambda: AIOKafkaProducer(**client_kwargs, acks="all", enable_idempotence=True, linger_ms=2), "results")
        self._commit = commit
        self._on_txn = on_transaction or (lambda outcome: None)

    async def start(self) -> None:
        await self._producer.start()

    async def add_partitions(self, tps: list[TopicPartition]) -> list[TopicPartition]:
        return []

    async def remove_partitions(self, tps: list[TopicPartition]) -> None:
        return None

    def busy(self, now: float | None = None) -> list[tuple[TopicPartition, str, float]]:
        return []

    def has_producer(self, tp: TopicPartition) -> bool:
        return True

    async def publish(self, release: Release) -> bool:
        tp = TopicPartition(release.topic, release.partition)
        producer = self._producer.producer
        try:
            futures = [await producer.send(r.topic, r.value, key=r.key, headers=list(r.headers))
                       for r in release.records]
            await asyncio.gather(*futures)
            # Only now are the outputs durable; the offset may follow.
            await self._commit({tp: release.commit_offset})
            self._on_txn("committed")
            return True
        except KafkaError as exc:
            log.warning("at-least-once publish for %s failed, will retry: %r", tp, exc)
            self._on_txn("aborted")
            # An ended producer would fail every retry for good: the next flush gets a new one.
            await self._producer.replace_if_ended()
            return False

    async def close(self) -> None:
        await self._producer.stop()


class DeltaPublisher:
    """Token deltas for streaming: best effort, outside any transaction."""

    def __init__(self, client_kwargs: dict, on_error: Callable[[], None] | None = None) -> None:
        self._producer = ReplaceableProducer(lambda: AIOKafkaProducer(**client_kwargs, acks=1, linger_ms=5), "deltas")
        self._on_error = on_error or (lambda: None)

    async def start(self) -> None:
        await self._producer.start()

    async def send(self, topic: str, key: bytes, value: bytes, headers: list[tuple[str, bytes]]) -> None:
        # A producer that aiokafka ended would drop every later delta, so streaming would stop for good:
        # ReplaceableProducer.send replaces it and sends the delta once more.
        try:
            sent = await self._producer.send(topic, value, key, headers)
        except KafkaError as exc:
            log.debug("delta dropped: %r", exc)
            self._on_error()
            return
        sent.add_done_callback(_retrieve)  # best effort: a lost delta is not an error anyone awaits

    async def close(self) -> None:
        await self._producer.stop()
