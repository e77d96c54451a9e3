"""worker.client.ServiceClient without a broker: results matched to their requests by id, duplicates and
strangers ignored, timeouts, a failed reader, a closed client. With a real broker and worker:
tests/integration/test_client.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from schemas import ChatRequest, Message, Result, SchemaError, encode, error_result
from tests.unit.stubs import AsyncStub
from worker import client as client_module
from worker.client import ClientClosed, ServiceClient


def chat(rid: str, **kw) -> ChatRequest:
    return ChatRequest(id=rid, messages=[Message(role="user", content="hi")], max_tokens=4, **kw)


class Broker:
    """Stands in for the producer and the topic readers: records what was sent; the test pushes results and deltas."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, ChatRequest, str]] = []
        self.results: asyncio.Queue = asyncio.Queue()
        self.deltas: asyncio.Queue = asyncio.Queue()
        self.fail_with: Exception | None = None
        broker = self

        class Producer(AsyncStub):
            async def send(self, topic, request, fmt="msgpack", key=None):
                broker.sent.append((topic, request, fmt))
                done = asyncio.get_running_loop().create_future()
                done.set_result(None)
                return done

        class Reader(AsyncStub):
            def __init__(self, bootstrap_servers: str, topic: str, **kwargs) -> None:
                self.topic = topic
                self.queue = broker.deltas if topic.endswith("deltas") else broker.results

            async def poll(self, timeout_ms: int = 200) -> list:
                if broker.fail_with is not None:
                    raise broker.fail_with
                try:
                    value = await asyncio.wait_for(self.queue.get(), timeout_ms / 1000)
                except TimeoutError:
                    return []
                return [SimpleNamespace(value=value)]

        self.Producer, self.Reader = Producer, Reader


@pytest.fixture
def broker(monkeypatch) -> Broker:
    broker = Broker()
    monkeypatch.setattr(client_module, "RequestProducer", broker.Producer)
    monkeypatch.setattr(client_module, "TopicReader", broker.Reader)
    return broker


def test_each_request_gets_its_own_result_and_a_second_copy_or_a_stranger_changes_nothing(broker):
    async def run():
        async with ServiceClient("broker:9092", fmt="json") as client:
            waiting = [asyncio.create_task(client.request(chat(rid))) for rid in ("a", "b")]
            while len(broker.sent) < 2:
                await asyncio.sleep(0.01)
            for value in (encode(Result(id="other", kind="chat", text="not mine"), "json"), b"not a result",
                          encode(Result(id="b", kind="chat", text="B"), "msgpack"),
                          encode(error_result("a", "chat", "overloaded", "busy"), "json"),
                          encode(Result(id="a", kind="chat", text="a second copy"), "json")):
                broker.results.put_nowait(value)
            return await asyncio.gather(*waiting)

    a, b = asyncio.run(run())
    assert (a.status, a.error.code, b.text) == ("error", "overloaded", "B")
    assert [(topic, req.id, fmt) for topic, req, fmt in broker.sent] == [
        ("infinilm.requests.chat", "a", "json"), ("infinilm.requests.chat", "b", "json")]


def test_a_request_a_worker_would_refuse_is_not_sent_and_an_id_waits_once(broker):
    async def run():
        async with ServiceClient("broker:9092") as client:
            with pytest.raises(SchemaError, match="max_tokens"):
                await client.request(ChatRequest(id="bad", messages=[Message(role="user", content="hi")],
                                                 max_tokens=0))
            first = asyncio.create_task(client.request(chat("same"), timeout=5))
            await asyncio.sleep(0.05)
            with pytest.raises(ValueError, match="already waiting"):
                await client.request(chat("same"))
            broker.results.put_nowait(encode(Result(id="same", kind="chat", text="once"), "msgpack"))
            return await first

    assert asyncio.run(run()).text == "once"
    assert [req.id for _, req, _ in broker.sent] == ["same"]


def test_no_result_in_time_is_a_timeout_and_the_id_can_be_sent_again(broker):
    async def run():
        async with ServiceClient("broker:9092") as client:
            with pytest.raises(TimeoutError):
                await client.request(chat("slow"), timeout=0.2)
            again = asyncio.create_task(client.request(chat("slow"), timeout=5))
            await asyncio.sleep(0.05)
            broker.results.put_nowait(encode(Result(id="slow", kind="chat", text="late"), "msgpack"))
            return await again

    assert asyncio.run(run()).text == "late"


def test_a_failed_reader_ends_the_waits_and_later_requests_with_client_closed(broker):
    async def run():
        async with ServiceClient("broker:9092") as client:
            waiting = asyncio.create_task(client.request(chat("w"), timeout=5))
            await asyncio.sleep(0.05)
            broker.fail_with = RuntimeError("connection lost for good")
            with pytest.raises(ClientClosed, match="connection lost for good"):
                await waiting
            with pytest.raises(ClientClosed, match="a reader of the client failed"):
                await client.request(chat("after"))

    asyncio.run(run())


def test_a_client_not_open_or_closed_meanwhile_ends_the_wait_with_client_closed(broker):
    async def run():
        client = ServiceClient("broker:9092")
        with pytest.raises(ClientClosed, match="not open"):
            await client.request(chat("early"))
        async with client:
            waiting = asyncio.create_task(client.request(chat("w2"), timeout=5))
            await asyncio.sleep(0.05)
        with pytest.raises(ClientClosed, match="closed before the result came"):
            await waiting

    asyncio.run(run())


def test_stream_yields_the_text_to_show_then_the_result(broker):
    from schemas import Delta

    async def run():
        async with ServiceClient("broker:9092", streaming=True) as client:
            updates = []

            async def consume():
                async for update in client.stream(chat("s")):
                    updates.append(update)

            task = asyncio.create_task(consume())
            while not broker.sent:
                await asyncio.sleep(0.01)
            for delta in (Delta(id="s", index=0, text="Bad"), Delta(id="other", index=0, text="NOT MINE"),
                          Delta(id="s", index=1, restart=True), Delta(id="s", index=2, text="Go"),
                          Delta(id="s", index=2, text="Go"), Delta(id="s", index=3, text="od")):
                broker.deltas.put_nowait(encode(delta, "msgpack"))
            while len(updates) < 4:
                await asyncio.sleep(0.01)
            broker.results.put_nowait(encode(Result(id="s", kind="chat", text="Good", finish_reason="stop"), "json"))
            await task
            return updates

    updates = asyncio.run(run())
    # A duplicate delta shows nothing new; the restart empties the text; the result ends the stream.
    assert [(u.text, u.event, u.result is None) for u in updates] == [
        ("Bad", "", True), ("", "restart", True), ("Go", "", True), ("Good", "", True), ("Good", "", False)]
    assert updates[-1].result.finish_reason == "stop"
    [(_, sent, _)] = broker.sent
    assert sent.stream is True  # the request was sent with stream on, though made without it


def test_stream_needs_a_streaming_client_and_a_chat(broker):
    from schemas import AsrRequest

    async def run():
        async with ServiceClient("broker:9092") as client:
            with pytest.raises(ValueError, match="streaming=True"):
                async for _ in client.stream(chat("s")):
                    pass
        async with ServiceClient("broker:9092", streaming=True) as client:
            with pytest.raises(ValueError, match="only chat requests stream, not asr"):
                async for _ in client.stream(AsrRequest(id="a", stream_id="s", seq=0, text="hi")):
                    pass
            with pytest.raises(TimeoutError):
                async for _ in client.stream(chat("quiet"), timeout=0.2):
                    pass
            waiting = asyncio.create_task(client.request(chat("twice"), timeout=5))
            await asyncio.sleep(0.05)
            with pytest.raises(ValueError, match="already waiting"):
                async for _ in client.stream(chat("twice")):
                    pass
            # The refused stream took nothing of the request already waiting under its id.
            broker.results.put_nowait(encode(Result(id="twice", kind="chat", text="once"), "msgpack"))
            assert (await waiting).text == "once"

    asyncio.run(run())
    assert [req.id for _, req, _ in broker.sent] == ["quiet", "twice"]
