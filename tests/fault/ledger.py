"""Requests out, committed results in, and the two numbers that matter: lost and duplicated.

The live view (`Ledger`, fed by `follow`) tells a scenario when to inject a
fault and when everything has arrived. The verdict (`audit`) does not trust it:
a fresh read_committed consumer reads the results topic from the beginning up
to its end offsets, after the workers are done, and counts every id.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError

from schemas import ChatRequest, Message, Result, SchemaError, content_type_of, decode_request, decode_result
from worker.client import RequestProducer, TopicReader

WORDS = (
    "kafka", "worker", "offset", "partition", "result", "engine", "token", "cache", "prefix", "batch",
    "stream", "broker", "redis", "commit", "transaction", "fence", "epoch", "leader", "replica",
    "lighthouse", "river", "mountain", "harbour",
)


def chat_requests(prefix: str, n: int, seed: int, max_tokens: tuple[int, int] = (16, 160)) -> list[tuple[ChatRequest, str]]:
    """`n` chat requests, half JSON and half msgpack in seeded order, greedy, of seeded lengths."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = " ".join(rng.choices(WORDS, k=rng.randint(4, 40)))
        req = ChatRequest(id=f"{prefix}-{i}", messages=[Message(role="user", content=text)],
                          max_tokens=rng.randint(*max_tokens), temperature=0.0)
        out.append((req, rng.choice(("json", "msgpack"))))
    return out


@dataclass
class Ledger:
    expected: set[str]
    sent_at: dict[str, float] = field(default_factory=dict)
    first_read_at: dict[str, float] = field(default_factory=dict)
    results: dict[str, list[Result]] = field(default_factory=lambda: defaultdict(list))
    undelivered: dict[str, str] = field(default_factory=dict)  # request id -> why the broker did not take it

    @classmethod
    def of(cls, ids: Iterable[str]) -> Ledger:
        return cls(set(ids))

    def add(self, result: Result, now: float) -> None:
        if result.id not in self.expected:
            return
        self.results[result.id].append(result)
        self.first_read_at.setdefault(result.id, now)

    @property
    def answered(self) -> int:
        return len(self.first_read_at)

    @property
    def complete(self) -> bool:
        return self.answered >= len(self.expected)

    def answered_since(self, t: float) -> int:
        return sum(1 for at in self.first_read_at.values() if at >= t)


async def follow(reader: TopicReader, ledger: Ledger) -> None:
    """Feed the ledger until cancelled; a broker outage only makes polls fail for a while."""
    while True:
        try:
            records = await reader.poll()
        except KafkaError:
            await asyncio.sleep(0.5)
            continue
        now = time.monotonic()
        for rec in records:
            with contextlib.suppress(SchemaError):
                ledger.add(decode_result(rec.value), now)


class Load:
    """Sends requests at a steady rate; `hold()` pauses it with everything sent delivered."""

    def __init__(self, bootstrap: str, topic: str, requests: list[tuple[ChatRequest, str]], rate: float,
                 ledger: Ledger) -> None:
        # Idempotent, so the producer's own retries never put a request on the topic twice
        # (a duplicate request would read as a duplicated result).
        self._producer = RequestProducer(bootstrap, enable_idempotence=True)
        self.topic = topic
        self.requests = requests
        self.rate = rate
        self.ledger = ledger
        self._open = asyncio.Event()
        self._open.set()
        self._sending = asyncio.Lock()
        self.sent = 0

    async def __aenter__(self) -> Load:
        await self._producer.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        await self._producer.__aexit__(*exc)

    async def run(self) -> None:
        interval = 1.0 / self.rate
        due = time.monotonic()
        for req, fmt in self.requests:
            if not self._open.is_set():
                await self._open.wait()
                due = time.monotonic()
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            due += interval
            async with self._sending:
                delivery = await self._producer.send(self.topic, req, fmt)
                delivery.add_done_callback(lambda f, rid=req.id: self._delivered(rid, f))
                self.ledger.sent_at[req.id] = time.monotonic()
                self.sent += 1
        await self._producer.flush()

    def _delivered(self, rid: str, delivery: asyncio.Future) -> None:
        # A request the broker never took reads as lost: the report must tell that from a worker's loss.
        if not delivery.cancelled() and delivery.exception() is not None:
            self.ledger.undelivered[rid] = repr(delivery.exception())

    async def hold(self) -> None:
        self._open.clear()
        async with self._sending:
            await self._producer.flush()

    def release(self) -> None:
        self._open.set()


@dataclass
class Audit:
    expected: int
    records: int  # committed records in the results topic
    lost: list[str]
    duplicated: dict[str, int]
    errors: dict[str, str]  # id -> error code, for expected ids answered with an error
    unexpected: int  # committed results whose id nobody sent

    @property
    def ok(self) -> bool:
        return not self.lost and not self.duplicated


async def read_committed(bootstrap: str, topic: str, timeout_s: float = 60.0) -> list:
    """Every committed record of `topic`, from the beginning to the end offsets taken now."""
    # No group: aiokafka assigns every partition of the subscribed topic and commits nothing.
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, isolation_level="read_committed",
                                auto_offset_reset="earliest", enable_auto_commit=False, max_partition_fetch_bytes=8 << 20)
    await consumer.start()
    records = []
    try:
        deadline = time.monotonic() + timeout_s
        while not consumer.assignment() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        tps = list(consumer.assignment())
        # With read_committed these are the last stable offsets: nothing past an open transaction.
        ends = await consumer.end_offsets(tps)
        while time.monotonic() < deadline:
            pending = [tp for tp in tps if await consumer.position(tp) < ends[tp]]
            if not pending:
                return records
            batch = await consumer.getmany(*pending, timeout_ms=500)
            records += [rec for recs in batch.values() for rec in recs]
        raise TimeoutError(f"{topic}: did not reach the end offsets {ends} in {timeout_s}s")
    finally:
        await consumer.stop()


async def where_requests_are(bootstrap: str, topic: str, ids: Iterable[str]) -> dict:
    """Where the requests `ids` sit in their request topic, for a run that lost them: how many never
    reached it (the test's producer failed) and, for the rest, each partition's count and lowest offset
    (one partition holding them all, from some offset on, points at that partition's worker)."""
    wanted = set(ids)
    found: dict[str, tuple[int, int]] = {}
    for rec in await read_committed(bootstrap, topic):
        try:
            rid = decode_request(rec.value, content_type_of(rec.headers)).id
        except SchemaError:
            continue
        if rid in wanted:
            found.setdefault(rid, (rec.partition, rec.offset))
    partitions: dict[int, dict[str, int]] = {}
    for part, offset in found.values():
        entry = partitions.setdefault(part, {"count": 0, "from_offset": offset})
        entry["count"] += 1
        entry["from_offset"] = min(entry["from_offset"], offset)
    return {"not_in_request_topic": len(wanted - set(found)), "by_partition": partitions}


async def audit(bootstrap: str, topic: str, expected: Iterable[str]) -> Audit:
    expected = set(expected)
    records = await read_committed(bootstrap, topic)
    counts: Counter[str] = Counter()
    errors: dict[str, str] = {}
    unexpected = 0
    for rec in records:
        try:
            result = decode_result(rec.value)
        except SchemaError:
            unexpected += 1
            continue
        if result.id not in expected:
            unexpected += 1
            continue
        counts[result.id] += 1
        if result.status != "ok":
            errors[result.id] = result.error.code if result.error else "?"
    return Audit(
        expected=len(expected), records=len(records), lost=sorted(expected - set(counts)),
        duplicated={rid: n for rid, n in counts.items() if n > 1}, errors=errors, unexpected=unexpected,
    )
