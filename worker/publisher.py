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
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError, ProducerFenced

from schemas import ErrorInfo
from worker.offsets import Release

log = logging.getLogger(__name__)

# NOTE: every record produced here must fit aiokafka's max_request_size, 1 MiB by default, which
# these producers keep (and a broker's default message.max.bytes is about the same). A record
# over it is refused before it is sent, and a refused release is retried on every flush, so it
# wedges its partition for good. Dead letters are the one output that echoes input bytes, so
# they are cut to fit (fit_dead_letter); the rest are bounded by max_tokens and the schemas.
MAX_RECORD_BYTES = 1_048_576
# Room left in a record for the dead-letter envelope: topic name, reason, worker id, framing.
DEAD_LETTER_MAX_BYTES = MAX_RECORD_BYTES - 64 * 1024


def fit_dead_letter(payload: bytes, key: bytes | None, headers: list[tuple[str, bytes]],
                    reason: ErrorInfo) -> tuple[bytes, bytes | None, list[tuple[str, bytes]], ErrorInfo]:
    """The payload, key and headers a dead letter can keep, and its reason saying what was cut."""
    extras = len(key or b"") + sum(len(k) + len(v) for k, v in headers)
    if len(payload) + extras <= DEAD_LETTER_MAX_BYTES:
        return payload, key, headers, reason
    note = ""
    if extras > DEAD_LETTER_MAX_BYTES // 2:
        key, headers, extras, note = None, [], 0, "; key and headers dropped"
    room = DEAD_LETTER_MAX_BYTES - extras
    note = f" [dead letter keeps the first {min(room, len(payload))} of {len(payload)} payload bytes{note}]"
    return payload[:room], key, headers, ErrorInfo(code=reason.code, message=reason.message + note)


class PartitionLost(Exception):
    """The partition now belongs to another worker; drop its in-flight work."""


class TransactionalPublisher:
    def __init__(self, client_kwargs: dict, group_id: str, txn_prefix: str, transaction_timeout_ms: int,
                 on_transaction: Callable[[str], None] | None = None) -> None:
        self._kwargs = client_kwargs
        self._group_id = group_id
        self._prefix = txn_prefix
        self._timeout_ms = transaction_timeout_ms
        self._on_txn = on_transaction or (lambda outcome: None)
        self._producers: dict[TopicPartition, AIOKafkaProducer] = {}
        # One transaction at a time per partition: the flush loop and a rebalance may both flush it.
        self._locks: dict[TopicPartition, asyncio.Lock] = defaultdict(asyncio.Lock)
        # Begun and not yet committed or aborted: a publish cancelled part-way leaves its partition here.
        self._open: set[TopicPartition] = set()

    def transactional_id(self, tp: TopicPartition) -> str:
        return f"{self._prefix}.{self._group_id}.{tp.topic}.{tp.partition}"

    async def add_partitions(self, tps: list[TopicPartition]) -> None:
        new = [tp for tp in tps if tp not in self._producers]
        await asyncio.gather(*(self._start(tp) for tp in new))

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
        await producer.start()
        self._producers[tp] = producer

    async def remove_partitions(self, tps: list[TopicPartition]) -> None:
        producers = [self._producers.pop(tp) for tp in tps if tp in self._producers]
        self._open.difference_update(tps)
        await asyncio.gather(*(p.stop() for p in producers), return_exceptions=True)

    async def publish(self, release: Release) -> bool:
        """Commit one release; False means retry later. Raises PartitionLost if fenced."""
        tp = TopicPartition(release.topic, release.partition)
        async with self._locks[tp]:
            return await self._publish(tp, release)

    async def _publish(self, tp: TopicPartition, release: Release) -> bool:
        producer = self._producers.get(tp)
        if producer is not None and tp in self._open:
            # An earlier publish was cancelled mid-transaction (a rebalance or shutdown): its
            # transaction is still open, holding back read_committed readers. End it first.
            await self._recover(tp, producer)
            producer = self._producers.get(tp)
        if producer is None:
            return False  # not started yet, or being restarted after an error: `ensure` retries it
        try:
            await producer.begin_transaction()
            self._open.add(tp)
            for rec in release.records:
                await producer.send(rec.topic, rec.value, key=rec.key, headers=list(rec.headers))
            await producer.send_offsets_to_transaction({tp: release.commit_offset}, self._group_id)
            await producer.commit_transaction()
            self._open.discard(tp)
            self._on_txn("committed")
            return True
        except ProducerFenced as exc:
            self._on_txn("fenced")
            await self.remove_partitions([tp])
            raise PartitionLost(f"{tp}: fenced by a newer owner") from exc
        except Exception as exc:
            # A Kafka error, or aiokafka refusing a state change: either way the transaction
            # must not stay open (an open one stalls every read_committed reader of the topic).
            log.warning("transaction for %s failed, will retry: %r", tp, exc)
            self._on_txn("aborted")
            await self._recover(tp, producer)
            return False

    async def _recover(self, tp: TopicPartition, producer: AIOKafkaProducer) -> None:
        try:
            await producer.abort_transaction()
            self._open.discard(tp)
        except Exception:
            # The producer is in an unknown state: replace it; InitProducerId aborts
            # whatever it left open.
            await self.remove_partitions([tp])
            try:
                await self._start(tp)
            except Exception as exc:
                log.warning("could not restart the producer for %s yet: %r", tp, exc)

    async def ensure(self, tps: list[TopicPartition]) -> None:
        """Start producers that a failed recovery left missing."""
        missing = [tp for tp in tps if tp not in self._producers]
        if missing:
            try:
                await self.add_partitions(missing)
            except Exception as exc:
                log.warning("producers for %s not ready: %r", missing, exc)

    async def close(self) -> None:
        await self.remove_partitions(list(self._producers))


class AtLeastOncePublisher:
    def __init__(self, client_kwargs: dict, commit: Callable[[dict[TopicPartition, int]], Awaitable[None]],
                 on_transaction: Callable[[str], None] | None = None) -> None:
        self._producer = AIOKafkaProducer(**client_kwargs, acks="all", enable_idempotence=True, linger_ms=2)
        self._commit = commit
        self._on_txn = on_transaction or (lambda outcome: None)

    async def start(self) -> None:
        await self._producer.start()

    async def add_partitions(self, tps: list[TopicPartition]) -> None:
        return None

    async def remove_partitions(self, tps: list[TopicPartition]) -> None:
        return None

    async def ensure(self, tps: list[TopicPartition]) -> None:
        return None

    async def publish(self, release: Release) -> bool:
        tp = TopicPartition(release.topic, release.partition)
        try:
            futures = [await self._producer.send(r.topic, r.value, key=r.key, headers=list(r.headers))
                       for r in release.records]
            await asyncio.gather(*futures)
            # Only now are the outputs durable; the offset may follow.
            await self._commit({tp: release.commit_offset})
            self._on_txn("committed")
            return True
        except KafkaError as exc:
            log.warning("at-least-once publish for %s failed, will retry: %r", tp, exc)
            self._on_txn("aborted")
            return False

    async def close(self) -> None:
        await self._producer.stop()


class DeltaPublisher:
    """Token deltas for streaming: best effort, outside any transaction."""

    def __init__(self, client_kwargs: dict, on_error: Callable[[], None] | None = None) -> None:
        self._producer = AIOKafkaProducer(**client_kwargs, acks=1, linger_ms=5)
        self._on_error = on_error or (lambda: None)

    async def start(self) -> None:
        await self._producer.start()

    async def send(self, topic: str, key: bytes, value: bytes, headers: list[tuple[str, bytes]]) -> None:
        try:
            await self._producer.send(topic, value, key=key, headers=headers)
        except KafkaError as exc:
            log.debug("delta dropped: %r", exc)
            self._on_error()

    async def close(self) -> None:
        await self._producer.stop()
