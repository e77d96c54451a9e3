"""The three workloads through the real Kafka and Redis: chat streaming, ASR streams, risk scoring."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import time

import msgpack
import pytest

from schemas import AsrRequest, Delta, RiskItem, RiskRequest, decode_delta
from tests.integration.worker_harness import chat, send_and_collect
from worker.client import RequestProducer, StreamText, TopicReader, collect_results

pytestmark = pytest.mark.integration


PIPELINED = pytest.mark.parametrize("pipelined", [None, True], ids=["default", "pipelined"])


@PIPELINED
def test_streamed_chat_deltas_arrive_in_order_and_add_up_to_the_result(worker_setup, kafka_bootstrap, pipelined):
    topics, start = worker_setup
    w = start(model="smollm2", execution={"async_scheduling": pipelined})
    w.wait_ready(timeout=300)
    req = chat("s1", "Count from one to ten in words.", max_tokens=40, stream=True)
    # Any visible character breaks this rule, so the first answer is generated again (and breaks it again).
    repaired = chat("s2", "Name three colours.", max_tokens=12, stream=True, rules=[r"forbid_regex: \S"])
    scored = chat("s3", "Name a colour.", max_tokens=6, logprobs=True, top_logprobs=2)

    async def run():
        async with TopicReader(kafka_bootstrap, topics.deltas) as deltas:
            got = await send_and_collect(kafka_bootstrap, topics, [(topics.chat, req, "json"),
                                                                   (topics.chat, repaired, "json"),
                                                                   (topics.chat, scored, "msgpack")],
                                         ["s1", "s2", "s3"], linger=0.5)
            pieces: dict[str, list[Delta]] = {"s1": [], "s2": []}
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not all(p and p[-1].finished for p in pieces.values()):
                for d in (decode_delta(r.value) for r in await deltas.poll()):
                    pieces.setdefault(d.id, []).append(d)
        return got, pieces

    got, pieces = asyncio.run(run())
    for rid in ("s1", "s2"):
        result, streamed = got[rid][0], pieces[rid]
        assert result.status == "ok" and result.text
        assert [d.index for d in streamed] == list(range(len(streamed)))
        assert streamed[-1].finished and streamed[-1].finish_reason == result.finish_reason
        # What a client shows: the text after the last restart.
        shown = StreamText()
        for d in streamed:
            shown.add(d)
        assert (shown.text, shown.missing, shown.finished) == (result.text, 0, True)
    assert not any(d.restart for d in pieces["s1"])
    # s2's first answer was voided by one restart (the second breaks the rule too, and is reported so).
    assert sum(d.restart for d in pieces["s2"]) == 1 and got["s2"][0].compliance.passed is False
    # Logprobs through the real worker: one entry per generated token, greedy picks the most likely one.
    entries = got["s3"][0].logprobs
    assert len(entries) == got["s3"][0].usage.completion_tokens and all(len(e.top) == 2 for e in entries)
    assert all((e.top[0].token_id, e.top[0].logprob) == (e.token_id, e.logprob) for e in entries)
    assert got["s1"][0].logprobs is None


async def read_topic(bootstrap: str, topic: str, count: int, timeout_s: float = 30) -> list:
    """The first `count` committed records of `topic`, raw, in each partition's order."""
    records = []
    async with TopicReader(bootstrap, topic, from_beginning=True) as reader:
        deadline = time.monotonic() + timeout_s
        while len(records) < count and time.monotonic() < deadline:
            records += await reader.poll()
    return sorted(records, key=lambda rec: (rec.partition, rec.offset))


def asr(stream: str, seq: int, text: str, rid: str | None = None) -> AsrRequest:
    return AsrRequest(id=rid or f"{stream}-{seq}", stream_id=stream, seq=seq, text=text)


# The first chunk is long enough that the committed transcript fills a KV block (16 tokens) before chunk 2.
CHUNKS = ["okay so the meeting is moved to tuesday at ten thirty in the main conference room with the finance team",
          "please bring the budget report", "and the slides for the quarterly review"]


@PIPELINED
def test_asr_stream_results_in_seq_order_with_state_in_redis(worker_setup, kafka_bootstrap, redis_url, pipelined):
    # "pipelined": the engine builds each step before the previous one's tokens are known.
    topics, start = worker_setup
    # The chunks arrive together, so chunk 2 waits for two corrections: the default gap timeout (30 s) is one
    # a busy CI machine cannot reach. A chunk whose predecessors never come: test_asr_and_risk_errors_are_answered.
    w = start(model="smollm2", execution={"async_scheduling": pipelined})
    w.wait_ready(timeout=300)
    chunks = [asr("st1", i, t) for i, t in enumerate(CHUNKS)]
    # A duplicate of chunk 1.
    sends = [(topics.asr, c, "json") for c in chunks] + [
        (topics.asr, asr("st1", 1, CHUNKS[1], rid="st1-1-again"), "json")]
    expect = [c.id for c in chunks] + ["st1-1-again"]
    got = asyncio.run(send_and_collect(kafka_bootstrap, topics, sends, expect, timeout=240, linger=1))
    results = [got[c.id][0] for c in chunks]
    assert all(r.status == "ok" for r in results), [r.error for r in results]
    # The order a client sees: the results topic itself, read raw. All five are keyed by the stream, so they
    # share one partition, where the three chunks' results come in seq order.
    raw = asyncio.run(read_topic(kafka_bootstrap, topics.results, count=len(expect)))
    assert {rec.key for rec in raw} == {b"st1"} and len({rec.partition for rec in raw}) == 1
    seqs = [v["seq"] for v in (json.loads(rec.value) for rec in raw) if v["id"] in {c.id for c in chunks}]
    assert seqs == [0, 1, 2]
    for prev, cur in itertools.pairwise(results):
        assert cur.committed_text.startswith(prev.committed_text)
    again = got["st1-1-again"][0]
    assert (again.text, again.committed_text, again.seq) == (results[1].text, results[1].committed_text, 1)
    # Later chunks reuse the transcript's KV from the prefix cache.
    assert results[2].usage.cached_tokens > 0


def test_asr_stream_continues_on_another_worker(worker_setup, kafka_bootstrap):
    topics, start = worker_setup
    w1 = start("w1", model="smollm2")
    w1.wait_ready(timeout=300)
    first = [asr("mv", i, t) for i, t in enumerate(CHUNKS[:2])]
    got = asyncio.run(send_and_collect(kafka_bootstrap, topics, [(topics.asr, c, "json") for c in first],
                                       [c.id for c in first], timeout=240, linger=0.5))
    committed = got["mv-1"][0].committed_text
    w1.stop()
    w2 = start("w2", model="smollm2")
    w2.wait_ready(timeout=300)
    nxt = asr("mv", 2, CHUNKS[2])
    got = asyncio.run(send_and_collect(kafka_bootstrap, topics, [(topics.asr, nxt, "json")], [nxt.id],
                                       timeout=240, linger=0.5))
    res = got["mv-2"][0]
    assert res.status == "ok" and res.worker == "w2"
    assert res.committed_text.startswith(committed) and len(res.committed_text) > len(committed)


def test_risk_request_scores_every_item(worker_setup, kafka_bootstrap):
    topics, start = worker_setup
    w = start(model="smollm2")
    w.wait_ready(timeout=300)
    items = [RiskItem(id=f"i{k}", text=t) for k, t in enumerate([
        "Wire of $9,900 to a new overseas account, the third today.", "Monthly rent to the usual landlord.",
        "Card used in two countries within ten minutes.", "Refund of a coffee order."])]
    req = RiskRequest(id="risk-1", items=items, labels=["low", "medium", "high"])
    got = asyncio.run(send_and_collect(kafka_bootstrap, topics, [(topics.risk, req, "msgpack")], ["risk-1"],
                                       timeout=240, linger=0.5))
    res = got["risk-1"][0]
    assert res.status == "ok", res.error
    assert [it.id for it in res.items] == ["i0", "i1", "i2", "i3"]
    for it in res.items:
        assert set(it.scores) == {"low", "medium", "high"}
        assert sum(it.scores.values()) == pytest.approx(1.0, abs=1e-6)
        assert it.label == max(it.scores, key=it.scores.get)


def test_asr_and_risk_errors_are_answered(worker_setup, kafka_bootstrap):
    topics, start = worker_setup
    w = start(asr={"gap_timeout_s": 2})
    w.wait_ready()
    sends = [(topics.risk, b'{"id": "no-items", "kind": "risk", "items": [], "labels": ["a"]}', "json"),
             (topics.asr, b'{"id": "neg-seq", "kind": "asr", "stream_id": "x", "seq": -1, "text": "t"}', "json"),
             (topics.asr, asr("gap", 5, "lost in a gap"), "json")]  # chunks 0 to 4 never come
    got = asyncio.run(send_and_collect(kafka_bootstrap, topics, sends, ["no-items", "neg-seq", "gap-5"], linger=0.5))
    assert got["no-items"][0].error.code == "invalid_request"
    assert got["neg-seq"][0].error.code == "invalid_request"
    # Keyed and ordered with its stream, as every ASR result is.
    assert (got["neg-seq"][0].stream_id, got["neg-seq"][0].seq) == ("x", -1)
    gap = got["gap-5"][0].error
    assert gap.code == "sequence_gap" and "waited 2s for chunk 0" in gap.message, gap


def test_a_chat_past_its_deadline_mid_generation_reports_its_tokens_and_ends_its_stream(worker_setup, kafka_bootstrap):
    topics, start = worker_setup
    w = start(model="smollm2")
    w.wait_ready(timeout=300)
    # The worker is stopped from its first delta until past the deadline: the request is then mid-generation.
    deadline_ms = int(time.time() * 1000) + 8_000
    req = chat("late", "Write a long essay about the history of Rome.", max_tokens=1000, stream=True,
               deadline_ms=deadline_ms)

    async def deltas_of(reader, pieces: list[Delta]) -> None:
        pieces += [d for d in (decode_delta(r.value) for r in await reader.poll()) if d.id == "late"]

    async def run():
        async with TopicReader(kafka_bootstrap, topics.results) as results, \
                TopicReader(kafka_bootstrap, topics.deltas) as deltas:
            async with RequestProducer(kafka_bootstrap) as producer:
                await producer.send(topics.chat, req, "json")
            pieces: list[Delta] = []
            until = time.monotonic() + 60
            while not pieces and time.monotonic() < until:
                await deltas_of(deltas, pieces)
            assert pieces and not pieces[0].finished, "no delta before the deadline"
            os.kill(w.proc.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(max(0.0, deadline_ms / 1000 - time.time()) + 0.5)
            finally:
                os.kill(w.proc.pid, signal.SIGCONT)
            got = await collect_results(results, ["late"], 60)
            until = time.monotonic() + 30
            while not pieces[-1].finished and time.monotonic() < until:
                await deltas_of(deltas, pieces)
        return got, pieces

    got, pieces = asyncio.run(run())
    [result] = got["late"]
    assert (result.status, result.error.code) == ("error", "deadline_exceeded")
    # The tokens it consumed before it failed: the prompt, and at least the generated text that was streamed.
    assert result.usage.prompt_tokens > 10 and result.usage.completion_tokens >= 1
    assert 0 < result.timing.ttft_ms < result.timing.total_ms
    assert [d.index for d in pieces] == list(range(len(pieces)))
    assert (pieces[-1].finished, pieces[-1].finish_reason) == (True, "error")


def test_keys_no_field_reads_are_named_in_the_result(worker_setup, kafka_bootstrap):
    topics, start = worker_setup
    w = start()
    w.wait_ready()
    typo = {"id": "typo", "kind": "chat", "max_token": 4, "messages": [{"role": "user", "content": "hi"}]}
    risk = {"id": "risk-typo", "kind": "risk", "labels": ["a", "b"], "items": [{"id": "i0", "text": "t", "lable": "a"}]}
    sends = [(topics.chat, json.dumps(typo).encode(), "json"), (topics.risk, msgpack.packb(risk), "msgpack")]
    got = asyncio.run(send_and_collect(kafka_bootstrap, topics, sends, ["typo", "risk-typo"], linger=0.5))
    assert (got["typo"][0].status, got["typo"][0].ignored_fields) == ("ok", ["max_token"])
    assert (got["risk-typo"][0].status, got["risk-typo"][0].ignored_fields) == ("ok", ["items[0].lable"])
    assert 'infinilm_request_fields_ignored_total{kind="chat"} 1.0' in w.metrics()


def test_results_over_the_record_limit_are_cut_or_refused_and_their_partitions_go_on(worker_setup, kafka_bootstrap):
    """A result the producers could not send would hold up its partition for good; here one is cut to fit
    and one answered result_too_large, and the requests after them on the same topics are answered."""
    topics, start = worker_setup
    w = start(kafka={"max_message_bytes": 16384})
    w.wait_ready()
    scored = chat("scored", "Tell me a long story.", max_tokens=64, logprobs=True, top_logprobs=20)
    # Each item's result scores every label: 60 items by 8 labels is a small request (under the 16 KiB that
    # requests are held to as well) and a large result.
    wide = RiskRequest(id="wide", items=[RiskItem(id=f"item-{i:02d}", text="a payment") for i in range(60)],
                       labels=[f"risk-level-{j}" for j in range(8)])
    after = [chat("chat-after", max_tokens=2),
             RiskRequest(id="risk-after", items=[RiskItem(id="i0", text="a payment")], labels=["low", "high"])]
    sends = [(topics.chat, scored, "json"), (topics.risk, wide, "json"),
             (topics.chat, after[0], "json"), (topics.risk, after[1], "json")]
    got = asyncio.run(send_and_collect(kafka_bootstrap, topics, sends, ["scored", "wide", "chat-after", "risk-after"],
                                       linger=0.5, timeout=180))
    [cut], [refused] = got["scored"], got["wide"]
    assert cut.usage.completion_tokens > 20, cut  # enough entries (about 1.2 kB each) to pass 16 KiB
    assert (cut.status, cut.truncated) == ("ok", ["logprobs"]) and 0 < len(cut.logprobs) < cut.usage.completion_tokens
    assert all(len(entry.top) == 20 for entry in cut.logprobs)
    assert (refused.status, refused.error.code, refused.kind) == ("error", "result_too_large", "risk"), refused
    assert refused.usage.prompt_tokens > 0
    assert [got[rid][0].status for rid in ("chat-after", "risk-after")] == ["ok", "ok"]
    metrics = w.metrics()
    assert 'infinilm_results_truncated_total{field="logprobs",kind="chat"} 1.0' in metrics
    assert 'infinilm_requests_total{kind="risk",status="result_too_large"} 1.0' in metrics
