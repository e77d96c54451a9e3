"""The worker end to end against the real Kafka and Redis of the local stack.

Results are read the way clients must read them: read_committed, from the end
offsets taken before the requests were sent. "Exactly once" is checked by
reading on past the last expected result and counting every id.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from schemas import decode_dead_letter
from tests.integration.worker_harness import chat, lost_and_duplicated, send_and_collect, send_and_watch
from worker.client import TopicReader

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("pipelined", [None, True], ids=["default", "pipelined"])
def test_mixed_json_and_msgpack_requests_get_exactly_one_result_each(worker_setup, kafka_bootstrap, pipelined):
    # "pipelined" forces the engine's pipelined scheduling (the GPU default) on this CPU worker.
    topics, start = worker_setup
    w = start(execution={"async_scheduling": pipelined})
    w.wait_ready()
    reqs = [chat(f"r{i}", f"question number {i}") for i in range(40)]
    sends = [(topics.chat, r, "json" if i % 2 else "msgpack") for i, r in enumerate(reqs)]
    got = asyncio.run(send_and_collect(kafka_bootstrap, topics, sends, [r.id for r in reqs]))
    assert sorted(got) == sorted(r.id for r in reqs)
    assert all(len(v) == 1 for v in got.values()), {k: len(v) for k, v in got.items() if len(v) != 1}
    assert all(v[0].status == "ok" and v[0].usage.completion_tokens > 0 for v in got.values())
    assert all(v[0].worker == "w1" for v in got.values())
    metrics = w.metrics()
    assert 'infinilm_requests_total{kind="chat",status="ok"} 40.0' in metrics


def test_bad_input_gets_an_error_result_or_a_dlq_record_and_the_worker_keeps_serving(worker_setup, kafka_bootstrap):
    topics, start = worker_setup
    w = start(kafka={"max_message_bytes": 65536}, model=None)
    w.wait_ready()
    too_long = chat("too-long", "x" * 600)  # the tiny model has 512 positions; one token per byte
    sends = [
        (topics.chat, b"\x00\x01garbage that is not json or msgpack", "raw", "g1"),
        (topics.chat, b'{"id": "wrong-types", "kind": "chat", "messages": "not a list"}', "json"),
        (topics.chat, b'{"id": "missing-fields", "kind": "chat"}', "json"),
        (topics.chat, b'{"id": "bad-value", "kind": "chat", "messages": [{"role": "user", "content": "hi"}], '
                      b'"max_tokens": -5}', "json"),
        (topics.chat, b'{"id": "unknown-kind", "kind": "translate", "text": "hola"}', "json"),
        (topics.chat, b'{"id": "oversized", "kind": "chat", "messages": [{"role": "user", "content": "'
                      + b"y" * 70000 + b'"}]}', "json"),
        (topics.chat, too_long, "json"),
        (topics.chat, chat("still-fine"), "msgpack"),
    ]
    expect = ["wrong-types", "missing-fields", "bad-value", "unknown-kind", "too-long", "still-fine"]

    async def run():
        async with TopicReader(kafka_bootstrap, topics.dlq) as dlq:
            got = await send_and_collect(kafka_bootstrap, topics, sends, expect)
            letters = [rec async for rec in dlq.records(5.0)]
        return got, letters

    got, letters = asyncio.run(run())
    codes = {rid: (res[0].status, res[0].error.code if res[0].error else None) for rid, res in got.items()}
    assert codes == {
        "wrong-types": ("error", "bad_request"),
        "missing-fields": ("error", "bad_request"),
        "bad-value": ("error", "invalid_request"),
        "unknown-kind": ("error", "unsupported_kind"),
        "too-long": ("error", "prompt_too_long"),
        "still-fine": ("ok", None),
    }
    assert all(len(v) == 1 for v in got.values())
    dead = [decode_dead_letter(r.value) for r in letters]
    assert sorted(d.reason.code for d in dead) == ["bad_request", "bad_request"]
    assert sorted(d.payload[:12] for d in dead) == [b"\x00\x01garbage th", b'{"id": "over']
    # The oversized record keeps the head that fits one record of max_message_bytes, and says so.
    [cut] = [d for d in dead if d.payload.startswith(b'{"id": "over')]
    assert 65536 // 2 < len(cut.payload) < 65536 and all(len(r.value) <= 65536 for r in letters)
    assert f"dead letter keeps the first {len(cut.payload)} of {70000 + 82} payload bytes" in cut.reason.message
    assert all(d.topic == topics.chat for d in dead)
    assert w.proc.poll() is None, "the worker died"


@pytest.mark.slow
def test_sigkill_one_of_two_workers_loses_nothing_and_duplicates_nothing(worker_setup, kafka_bootstrap):
    topics, start = worker_setup
    w1, w2 = start("w1"), start("w2")
    w1.wait_ready(assigned=False)
    w2.wait_ready(assigned=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # both members hold partitions
        if all((w.ready() or {}).get("assigned_partitions", 0) > 0 for w in (w1, w2)):
            break
        time.sleep(0.5)
    reqs = [chat(f"k{i}", f"tell me about number {i}", max_tokens=128) for i in range(90)]

    killed = []

    def kill_w1_mid_run(result) -> None:
        # w1 has just committed a transaction and has more in flight: kill it now.
        if not killed and result.worker == "w1":
            w1.signal(signal.SIGKILL)
            killed.append(True)

    seen = asyncio.run(send_and_watch(kafka_bootstrap, topics, reqs, kill_w1_mid_run))
    assert killed
    missing, dupes = lost_and_duplicated(reqs, seen)
    assert not missing, f"lost: {missing}"
    assert not dupes, f"duplicated: {dupes}"
    assert any(v[0].worker == "w2" for v in seen.values())


@pytest.mark.slow
def test_generation_longer_than_max_poll_interval_causes_no_rebalance(worker_setup, kafka_bootstrap):
    topics, start = worker_setup
    # max_poll_interval 2.5 s; SmolLM2 without packed weight copies (the engine's slower path) needs more than
    # that for 250 tokens on a small CPU host (docs/perf/worker-notes.md).
    w = start(model="smollm2", kafka={"max_poll_interval_ms": 2500}, memory={"cpu_prepack_weights": False})
    w.wait_ready(timeout=300)
    req = chat("long-one", "Write a long story about a lighthouse keeper.", max_tokens=250)
    got = asyncio.run(send_and_collect(kafka_bootstrap, topics, [(topics.chat, req, "json")], [req.id],
                                       timeout=240, linger=8))
    assert len(got.get("long-one", [])) == 1
    events = [e.get("event") for e in w.log_events()]
    assert events.count("partitions assigned") == 1, events
    assert "partitions revoked" not in events
    took_ms = got["long-one"][0].timing.total_ms  # the worker's own time for the request, not the linger after it
    if took_ms <= 2500:
        pytest.skip(f"the generation took {took_ms:.0f} ms, within max_poll_interval: it proves nothing on this host")


def test_results_keep_flowing_while_redis_is_down(worker_setup, kafka_bootstrap, tmp_path):
    from tests.integration.redis_server import PrivateRedis

    topics, start = worker_setup
    redis = PrivateRedis(tmp_path / "redis")
    redis.start()
    try:
        w = start(redis={"url": redis.url, "heartbeat_interval_s": 1})
        w.wait_ready()
        first = [chat(f"a{i}") for i in range(5)]
        got = asyncio.run(send_and_collect(kafka_bootstrap, topics, [(topics.chat, r, "json") for r in first],
                                           [r.id for r in first], linger=0.5))
        assert len(got) == 5
        redis.stop()
        second = [chat(f"b{i}") for i in range(5)]
        got = asyncio.run(send_and_collect(kafka_bootstrap, topics, [(topics.chat, r, "json") for r in second],
                                           [r.id for r in second], linger=0.5))
        assert sorted(got) == sorted(r.id for r in second)
        assert all(v[0].status == "ok" for v in got.values())
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (w.ready() or {}).get("redis") != "degraded":
            time.sleep(0.5)
        assert w.ready()["redis"] == "degraded"
        assert "infinilm_redis_up 0.0" in w.metrics()
        redis.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (w.ready() or {}).get("redis") != "ok":
            time.sleep(0.5)
        assert w.ready()["redis"] == "ok"
    finally:
        redis.stop()


@pytest.mark.slow
@pytest.mark.parametrize("pipelined", [None, True], ids=["default", "pipelined"])
def test_sigterm_under_load_finishes_or_hands_over_without_loss_or_duplicates(worker_setup, kafka_bootstrap,
                                                                              pipelined):
    # "pipelined": w1's engine has a step in flight whenever it is asked to drain.
    topics, start = worker_setup
    w1 = start("w1", execution={"async_scheduling": pipelined})
    w1.wait_ready()
    reqs = [chat(f"t{i}", f"graceful shutdown {i}", max_tokens=128) for i in range(60)]

    replacement = []

    def terminate_w1_mid_run(result) -> None:
        # Mid-load: SIGTERM w1 and bring up a replacement in the same group.
        if not replacement:
            w1.signal(signal.SIGTERM)
            replacement.append(start("w2"))

    seen = asyncio.run(send_and_watch(kafka_bootstrap, topics, reqs, terminate_w1_mid_run, fmt="json"))
    assert w1.wait(60) == 0, w1.logs()[-3000:]
    missing, dupes = lost_and_duplicated(reqs, seen)
    assert not missing and not dupes, (missing, dupes)
    events = [e.get("event") for e in w1.log_events()]
    assert "shutting down" in events and "worker stopped" in events


def test_a_request_past_its_deadline_gets_deadline_exceeded(worker_setup, kafka_bootstrap):
    topics, start = worker_setup
    w = start()
    w.wait_ready()
    past = int(time.time() * 1000) - 1000
    future = int(time.time() * 1000) + 600_000
    sends = [(topics.chat, chat("late", deadline_ms=past), "json"),
             (topics.chat, chat("in-time", deadline_ms=future), "json")]
    got = asyncio.run(send_and_collect(kafka_bootstrap, topics, sends, ["late", "in-time"], linger=0.5))
    assert got["late"][0].error.code == "deadline_exceeded"
    assert got["in-time"][0].status == "ok"


@pytest.mark.parametrize("problem", ["missing", "broken_config"])
def test_a_model_that_cannot_load_is_one_cannot_start_event_and_exit_code_2(worker_setup, tmp_path, problem):
    _, start = worker_setup
    model = tmp_path / "model"
    if problem == "broken_config":
        model.mkdir()
        (model / "config.json").write_text("{not json")
    w = start(model=str(model))
    assert w.wait(timeout=120) == 2, w.logs()[-3000:]
    [event] = [e for e in w.log_events() if e.get("event") == "cannot start"]
    assert event["level"] == "error" and event["reason"].startswith(f"model {str(model)!r}: ")
    assert ("unknown model" if problem == "missing" else "not valid JSON") in event["reason"]
    assert "Traceback" not in w.logs()


def test_a_record_limit_over_the_topics_is_one_cannot_start_event_and_exit_code_3(worker_setup):
    """kafka.max_message_bytes over the results topic's max.message.bytes (the local stack's topics take
    2 MiB): a result that large would be refused by the broker, so the worker does not start."""
    _, start = worker_setup
    w = start(kafka={"max_message_bytes": 4 << 20})
    assert w.wait(timeout=120) == 3, w.logs()[-3000:]
    [event] = [e for e in w.log_events() if e.get("event") == "cannot start"]
    assert event["reason"].startswith("kafka.max_message_bytes is 4194304, over the max.message.bytes of "), event
    assert "(2097152)" in event["reason"] and "Traceback" not in w.logs()
    assert "worker started" not in w.logs()
