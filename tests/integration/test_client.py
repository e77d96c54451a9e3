"""worker.client and the `infinilm produce` / `consume` commands against the real broker: a new group can
start at the topics' current end; a request produced from the command line gets its committed result."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from typer.testing import CliRunner

from cli import app
from worker.client import MissingTopicError, RequestProducer, start_group_at_end

runner = CliRunner()


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


def test_sending_to_a_missing_topic_is_a_clear_error_within_seconds(kafka_bootstrap, unique_name):
    # aiokafka alone waits out its request timeout and then says "UnknownTopicOrPartitionError".
    async def send() -> None:
        async with RequestProducer(kafka_bootstrap) as producer:
            await producer.send(unique_name("missing"), b"{}", "json")

    with pytest.raises(MissingTopicError, match="does not exist"):
        asyncio.run(send())


def test_produce_waits_for_the_committed_result_and_consume_prints_it(worker_setup, unique_name):
    _, start = worker_setup
    worker = start()
    worker.wait_ready()
    config = str(worker.config)
    answers = {}
    for fmt in ("json", "msgpack"):
        rid = unique_name(fmt)
        result = runner.invoke(app, ["produce", "-c", config, "--text", "Say hi.", "--max-tokens", "4", "--id", rid,
                                     "--format", fmt, "--stream", "--wait", "--timeout", "120"])
        assert result.exit_code == 0, (result.output, worker.logs()[-3000:])
        answer = json.loads(result.stdout.strip().splitlines()[-1])
        assert (answer["id"], answer["status"], answer["kind"]) == (rid, "ok", "chat"), answer
        assert 1 <= answer["usage"]["completion_tokens"] <= 4
        assert answer["text"] in result.stderr  # --stream printed the deltas as they came
        answers[rid] = answer
    printed = runner.invoke(app, ["consume", "-c", config, "--from-beginning", "--max", "2", "--timeout", "30"])
    assert printed.exit_code == 0, printed.output
    assert {json.loads(line)["id"]: json.loads(line) for line in printed.stdout.splitlines()} == answers
    rid = unique_name("logprobs")
    result = runner.invoke(app, ["produce", "-c", config, "--text", "Say hi.", "--system", "Answer in one word.",
                                 "--max-tokens", "3", "--top-logprobs", "2", "--id", rid, "--wait", "--timeout", "120"])
    assert result.exit_code == 0, (result.output, worker.logs()[-3000:])
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer["status"] == "ok" and len(answer["logprobs"]) == answer["usage"]["completion_tokens"], answer
    assert all(len(entry["top"]) == 2 and entry["logprob"] <= 0 for entry in answer["logprobs"]), answer
    # One request's result picked out of the topic, read from its start.
    printed = runner.invoke(app, ["consume", "-c", config, "--from-beginning", "--id", rid, "--timeout", "30"])
    assert printed.exit_code == 0, printed.output
    assert [json.loads(line) for line in printed.stdout.splitlines()] == [answer]
    missing = runner.invoke(app, ["consume", "-c", config, "--topic", unique_name("missing"), "--timeout", "1"])
    assert missing.exit_code == 1 and "does not exist" in missing.stderr, missing.output


def test_produce_sends_a_request_file_as_written_and_reads_one_from_stdin(worker_setup, unique_name, tmp_path):
    _, start = worker_setup
    worker = start()
    worker.wait_ready()
    config = str(worker.config)
    rid = unique_name("file")
    request = tmp_path / "request.json"
    # What the options cannot say: a system message, rules, and (allowed here) a key the worker does not read.
    request.write_text(json.dumps({
        "id": rid, "kind": "chat", "max_tokens": 4, "temperature": 0, "rules": ["forbid: zebra"], "top_n": 3,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]}))
    result = runner.invoke(app, ["produce", "-c", config, "--file", str(request), "--allow-unknown", "--wait",
                                 "--timeout", "120"])
    assert result.exit_code == 0, (result.output, worker.logs()[-3000:])
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert (answer["id"], answer["status"], answer["ignored_fields"]) == (rid, "ok", ["top_n"]), answer
    assert answer["compliance"]["passed"] is True
    chunk = json.dumps({"kind": "asr", "stream_id": unique_name("call"), "seq": 0, "text": "so um hello there"})
    result = runner.invoke(app, ["produce", "-c", config, "--file", "-", "--format", "msgpack", "--wait",
                                 "--timeout", "120"], input=chunk)
    assert result.exit_code == 0, (result.output, worker.logs()[-3000:])
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert (answer["kind"], answer["status"], answer["seq"]) == ("asr", "ok", 0), answer
    assert "ignored_fields" not in answer  # msgpack goes out from the decoded request


def test_a_service_client_gets_each_of_many_requests_its_committed_result(worker_setup, kafka_bootstrap):
    """worker.client.ServiceClient against a real worker: chat, asr and risk requests at once, each answered
    with its own result, an error included; a chat streamed; a request with no worker to answer it times out."""
    from schemas import AsrRequest, ChatRequest, Message, RiskItem, RiskRequest
    from worker.client import ServiceClient
    from worker.config_sections import TopicsConfig

    topics, start = worker_setup
    worker = start()
    worker.wait_ready()
    chats = [ChatRequest(id=f"chat-{i}", messages=[Message(role="user", content=f"Say {i}.")], max_tokens=3)
             for i in range(6)]
    others = [AsrRequest(id="asr-0", stream_id="call-1", seq=0, text="so um hello there"),
              RiskRequest(id="risk-0", items=[RiskItem(id="i0", text="a payment")], labels=["low", "high"]),
              ChatRequest(id="too-long", messages=[Message(role="user", content="x " * 600)], max_tokens=3)]

    async def run():
        async with ServiceClient(kafka_bootstrap, TopicsConfig(**topics.as_dict()), fmt="json",
                                 streaming=True) as client:
            results = await asyncio.gather(*(client.request(r, timeout=120) for r in [*chats, *others]))
            streamed = ChatRequest(id="streamed", messages=[Message(role="user", content="Count to five.")],
                                   max_tokens=12)
            updates = [u async for u in client.stream(streamed, timeout=120)]
        worker.stop()
        # Text as it came, each a longer start of the answer, then the result (deltas read after it are not
        # waited for: the result's text is the answer of record).
        texts = [u.text for u in updates[:-1]]
        assert texts and all(u.result is None and not u.event for u in updates[:-1]), updates
        answer = updates[-1].result
        assert answer.status == "ok" and updates[-1].text == answer.text
        assert all(a.startswith(b) and a != b for a, b in zip(texts[1:], texts, strict=False))
        assert answer.text.startswith(texts[-1])
        async with ServiceClient(kafka_bootstrap, TopicsConfig(**topics.as_dict())) as client:
            with pytest.raises(TimeoutError):
                await client.request(chats[0], timeout=3)
        return results

    results = asyncio.run(run())
    assert [r.id for r in results] == [r.id for r in [*chats, *others]]
    assert [r.status for r in results[:-1]] == ["ok"] * 8, results
    assert (results[-1].status, results[-1].error.code) == ("error", "prompt_too_long")
    assert (results[6].kind, results[6].seq, results[7].items[0].id) == ("asr", 0, "i0")
