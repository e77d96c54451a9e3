"""Client side of the topics: produce requests, collect committed results.

Used by the CLI (`produce`, `consume`, `demo`), the end-to-end benchmark and
the integration tests, so all of them read results the way users must: with
isolation_level=read_committed, starting from the end offsets taken before
the requests were sent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import msgspec
from aiokafka import AIOKafkaClient, AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from schemas import Delta, Result, SchemaError, decode_delta, decode_result, encode, validate_request
from worker.publisher import ReplaceableProducer

CONTENT_TYPES = {"json": b"application/json", "msgpack": b"application/msgpack"}


class MissingTopicError(RuntimeError):
    """The topic has no partitions on the broker: it was never created (or was deleted)."""


class RequestProducer:
    def __init__(self, bootstrap_servers: str, **kwargs) -> None:
        # Replaced when aiokafka ends it (a failed sender task), so a long-lived client keeps sending.
        self._producer = ReplaceableProducer(
            lambda: AIOKafkaProducer(bootstrap_servers=bootstrap_servers, acks="all", linger_ms=5, **kwargs),
            "request")
        self._topics: set[str] = set()  # seen in the broker's metadata

    async def __aenter__(self) -> RequestProducer:
        try:
            await self._producer.start()
        except BaseException:
            await self._producer.stop()  # a failed start leaves its connections and tasks behind
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self._producer.stop()

    async def send(self, topic: str, request, fmt: str = "msgpack", key: str | None = None) -> asyncio.Future:
        """Send a request struct (or raw bytes, for tests of bad input); returns the record's delivery future.
        Raises MissingTopicError for a topic the broker lacks, within seconds (aiokafka itself waits out its
        request timeout)."""
        if topic not in self._topics:
            await _partitions(self._producer.producer.client, topic)
            self._topics.add(topic)
        value = request if isinstance(request, bytes) else encode(request, fmt)
        rid = key if key is not None else getattr(request, "stream_id", None) or getattr(request, "id", None)
        headers = [("content-type", CONTENT_TYPES[fmt])] if fmt in CONTENT_TYPES else []
        return await self._producer.send(topic, value, rid.encode() if rid else None, headers)

    async def flush(self) -> None:
        await self._producer.producer.flush()


async def _partitions(client: AIOKafkaClient, topic: str, attempts: int = 50) -> list[TopicPartition]:
    """The topic's partitions, waiting up to `attempts` tenths of a second for its metadata."""
    for _ in range(attempts):
        # An unassigned consumer's own metadata lacks the topic, and aiokafka has no
        # public per-topic lookup, so read a fresh full snapshot.
        cluster = await client.fetch_all_metadata()
        partitions = cluster.partitions_for_topic(topic)
        if partitions:
            return [TopicPartition(topic, p) for p in sorted(partitions)]
        await asyncio.sleep(0.1)
    raise MissingTopicError(f"topic {topic!r} does not exist (run `infinilm stack up` to create topics)")


async def start_group_at_end(bootstrap_servers: str, group_id: str, topics: Iterable[str],
                             **kwargs) -> dict[TopicPartition, int]:
    """Commit, for a consumer group that has no members yet, the topics' current end offsets.

    A new group otherwise starts from the beginning of each partition (the
    worker's `auto_offset_reset` is "earliest", so a fresh deployment serves
    the backlog). The demo, which joins with a new group every run, uses this
    to serve only what it sends itself instead of every earlier run's
    requests. Offsets already committed for the group are overwritten. Returns
    the committed offsets.
    """
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap_servers, group_id=group_id, enable_auto_commit=False,
                                isolation_level="read_committed", **kwargs)
    try:
        await consumer.start()
        tps = [tp for topic in topics for tp in await _partitions(consumer._client, topic)]
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        await consumer.commit(ends)
        return ends
    finally:
        await consumer.stop()


class TopicReader:
    """Reads a topic from the offsets it had when the reader was started."""

    def __init__(self, bootstrap_servers: str, topic: str, *, from_beginning: bool = False, **kwargs) -> None:
        self.topic = topic
        self._from_beginning = from_beginning
        self._consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap_servers, isolation_level="read_committed",
                                          enable_auto_commit=False, **kwargs)

    async def __aenter__(self) -> TopicReader:
        try:
            await self._consumer.start()
            tps = await _partitions(self._consumer._client, self.topic)
            self._consumer.assign(tps)
            if self._from_beginning:
                await self._consumer.seek_to_beginning(*tps)
            else:
                ends = await self._consumer.end_offsets(tps)
                for tp, off in ends.items():
                    self._consumer.seek(tp, off)
        except BaseException:
            await self._consumer.stop()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self._consumer.stop()

    async def poll(self, timeout_ms: int = 200) -> list:
        """One fetch: the records that arrived, possibly none."""
        batch = await self._consumer.getmany(timeout_ms=timeout_ms)
        return [rec for recs in batch.values() for rec in recs]

    async def records(self, timeout_s: float):
        """Yield raw records until `timeout_s` passes without a new one... or forever if None."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while deadline is None or time.monotonic() < deadline:
            batch = await self._consumer.getmany(timeout_ms=200)
            for recs in batch.values():
                for rec in recs:
                    yield rec
            if batch and timeout_s is not None:
                deadline = time.monotonic() + timeout_s


async def collect_results(reader: TopicReader, ids: Iterable[str], timeout_s: float,
                          on_result=None) -> dict[str, list[Result]]:
    """Read results until every id has one (or the timeout); duplicates are kept, to be counted."""
    wanted = set(ids)
    got: dict[str, list[Result]] = {}
    deadline = time.monotonic() + timeout_s
    async for rec in reader.records(timeout_s):
        try:
            result = decode_result(rec.value)
        except SchemaError:
            continue
        if result.id in wanted:
            got.setdefault(result.id, []).append(result)
            if on_result:
                on_result(result)
        if wanted <= set(got) or time.monotonic() > deadline:
            break
    return got


class ClientClosed(RuntimeError):
    """The ServiceClient was closed, or one of its readers failed, before the result came."""


@dataclass
class StreamUpdate:
    """What ServiceClient.stream yields: the text to show now, and on the last update the result."""

    text: str
    # "restart" or "moved" when the text started again (StreamText.add), else "".
    event: str = ""
    # The committed result, on the last update only; its text is the answer of record.
    result: Result | None = None


class ServiceClient:
    """An application's client of the service: send requests, await each one's committed result.

    ```python
    async with ServiceClient("127.0.0.1:9092") as client:
        result = await client.request(ChatRequest(id="c1", messages=[Message(role="user", content="Hi")]))
    ```

    One reader follows the results topic (read_committed) from the end offsets it took at start, before
    any request went out, so no result of a request sent through this client is missed; results are
    matched to requests by `id` (an asr chunk's too, though its record is keyed by its stream), and a
    second copy of a result (at-least-once delivery) is ignored. Requests are checked as a worker checks
    them before they are sent (schemas.SchemaError). Many requests may wait at once; each result is the
    worker's answer, errors included (`status`, `error`). With `streaming=True` a second reader follows
    the deltas topic, for `stream`.
    """

    def __init__(self, bootstrap_servers: str, topics=None, fmt: str = "msgpack", *, streaming: bool = False,
                 **kwargs) -> None:
        """`topics`: the deployment's topic names (a worker.config_sections.TopicsConfig; the defaults if
        None); `fmt`: the wire format of the requests, "msgpack" or "json"; `streaming`: also read the
        deltas topic, for `stream`; `kwargs`: aiokafka client settings (security, timeouts), as
        worker.kafka_clients.client_kwargs makes them."""
        if topics is None:
            from worker.config_sections import TopicsConfig

            topics = TopicsConfig()
        if fmt not in CONTENT_TYPES:
            raise ValueError(f"fmt must be json or msgpack, got {fmt!r}")
        self._topics = topics.request_topics
        self._fmt = fmt
        self._producer = RequestProducer(bootstrap_servers, **kwargs)
        # Each reader with what it does with a record; all are positioned before the first request goes out.
        self._readers = [(TopicReader(bootstrap_servers, topics.results, **kwargs), self._on_result)]
        if streaming:
            self._readers.append((TopicReader(bootstrap_servers, topics.deltas, **kwargs), self._on_delta))
        self._waiting: dict[str, asyncio.Future[Result]] = {}
        self._deltas: dict[str, asyncio.Queue[Delta]] = {}
        self._tasks: list[asyncio.Task] = []
        self._failure: BaseException | None = None
        self._closing = False

    async def __aenter__(self) -> ServiceClient:
        opened = []
        try:
            for reader, _ in self._readers:
                await reader.__aenter__()
                opened.append(reader)
            await self._producer.__aenter__()
        except BaseException:
            for reader in opened:
                await reader.__aexit__()
            raise
        self._tasks = [asyncio.create_task(self._read(reader, handle), name=f"infinilm-client-{reader.topic}")
                       for reader, handle in self._readers]
        return self

    async def __aexit__(self, *exc) -> None:
        self._closing = True
        # Cancelled again until done: Python 3.11's wait_for (under aiokafka's poll) can swallow a
        # cancellation that lands as its wait ends; the flag ends the loop after that poll anyway.
        while pending := [t for t in self._tasks if not t.done()]:
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=0.5)
        self._fail_waiting(ClientClosed("the client was closed before the result came"))
        try:
            await self._producer.__aexit__()
        finally:
            for reader, _ in self._readers:
                await reader.__aexit__()

    async def request(self, request, *, timeout: float | None = 120.0) -> Result:
        """Send `request` (a ChatRequest, AsrRequest or RiskRequest) and return its committed result.
        Raises SchemaError for a request a worker would refuse (nothing is sent), ValueError for an id
        already waiting here, TimeoutError when no result came within `timeout` seconds, and ClientClosed
        when the client stopped reading first."""
        future = await self._send(request)
        try:
            async with asyncio.timeout(timeout):
                return await future
        finally:
            self._waiting.pop(request.id, None)

    async def stream(self, request, *, timeout: float | None = 120.0) -> AsyncIterator[StreamUpdate]:
        """Send a chat `request` with `stream` on, and yield the text to show as its deltas arrive
        (StreamText's rules), then one last update with the committed result, whose text is the answer
        of record (deltas are best effort). Needs `streaming=True`; raises as `request` does, and
        TimeoutError when the result did not come within `timeout` seconds of the send."""
        if len(self._readers) < 2:
            raise ValueError("stream needs a client made with streaming=True (it reads the deltas topic)")
        if request.kind != "chat":
            raise ValueError(f"only chat requests stream, not {request.kind}")
        request = msgspec.structs.replace(request, stream=True)
        if request.id in self._waiting or request.id in self._deltas:  # checked before anything is registered
            raise ValueError(f"a request with id {request.id!r} is already waiting for its result")
        deltas: asyncio.Queue[Delta] = asyncio.Queue()
        self._deltas[request.id] = deltas
        shown, getting = StreamText(), None
        try:
            future = await self._send(request)
            async with asyncio.timeout(timeout):
                while not future.done():
                    getting = asyncio.ensure_future(deltas.get())
                    await asyncio.wait({getting, future}, return_when=asyncio.FIRST_COMPLETED)
                    if not getting.done():
                        continue
                    before = shown.text
                    event = shown.add(getting.result())
                    if event or shown.text != before:
                        yield StreamUpdate(shown.text, event)
            result = future.result()
            yield StreamUpdate(result.text, result=result)
        finally:
            if getting is not None:
                getting.cancel()
            self._waiting.pop(request.id, None)
            self._deltas.pop(request.id, None)

    async def _send(self, request) -> asyncio.Future[Result]:
        """Check `request`, register its result's future, send it; the caller pops the future when done."""
        validate_request(request)
        if self._failure is not None:
            raise ClientClosed(f"a reader of the client failed: {self._failure!r}")
        if not self._tasks or any(t.done() for t in self._tasks):
            raise ClientClosed("the client is not open: use `async with ServiceClient(...) as client`")
        if request.id in self._waiting:
            raise ValueError(f"a request with id {request.id!r} is already waiting for its result")
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._waiting[request.id] = future
        try:
            await (await self._producer.send(self._topics[request.kind], request, self._fmt))
        except BaseException:
            self._waiting.pop(request.id, None)
            raise
        return future

    async def _read(self, reader: TopicReader, handle) -> None:
        try:
            while not self._closing:
                for rec in await reader.poll(500):
                    handle(rec.value)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failure = exc
            self._fail_waiting(ClientClosed(f"a reader of the client failed: {exc!r}"))

    def _on_result(self, value: bytes) -> None:
        try:
            result = decode_result(value)
        except SchemaError:
            return  # not a result this client can read; not one of its requests either
        future = self._waiting.get(result.id)
        if future is not None and not future.done():
            future.set_result(result)

    def _on_delta(self, value: bytes) -> None:
        try:
            delta = decode_delta(value)
        except SchemaError:
            return
        queue = self._deltas.get(delta.id)
        if queue is not None:
            queue.put_nowait(delta)

    def _fail_waiting(self, exc: Exception) -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(exc)


@dataclass
class StreamText:
    """The text to show for one request's deltas, applied in the order read.

    A `restart` delta (a chat answer broke a rule and is generated again) and a second index 0 (the
    request moved to another worker, which streams it from the start) void the text before them. A
    delta whose index was seen already is a duplicate and changes nothing; a jump in index counts the
    deltas lost on the way (best effort) in `missing`. Once `finished`, `text` equals the result's text
    unless a delta was missing.
    """

    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    missing: int = 0
    _next: int = 0  # the index expected next

    def add(self, delta: Delta) -> str:
        """Apply `delta`; returns "restart" or "moved" when it started the text again, "" otherwise."""
        event = "restart" if delta.restart else "moved" if delta.index == 0 and self._next else ""
        if event:
            self.text, self.finished, self.finish_reason = "", False, None
        elif delta.index < self._next:
            return ""
        else:
            self.missing += delta.index - self._next
        self._next = delta.index + 1
        self.text += delta.text
        if delta.finished:
            self.finished, self.finish_reason = True, delta.finish_reason
        return event


def decode_any(topic_role: str, value: bytes) -> Result | Delta | object:
    if topic_role == "deltas":
        return decode_delta(value)
    return decode_result(value)
