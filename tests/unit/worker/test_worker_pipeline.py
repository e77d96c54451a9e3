"""One request's path through the worker's parts: intake -> in-flight table -> completion -> tracker.

No engine, no Kafka: a fake engine loop records the jobs and aborts it is given, and the
test hands completion the engine events a real loop would deliver.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import msgspec
from aiokafka import TopicPartition
from prometheus_client import CollectorRegistry

from engine import RequestError, RequestOutput, SamplingParams
from engine.outputs import RequestMetrics
from schemas import Result, Usage, decode_dead_letter, decode_delta, decode_result
from worker.batcher import make_batcher
from worker.completion import Completion
from worker.config import ServiceConfig
from worker.engine_loop import EngineEvent
from worker.handlers import HandlerContext, Prepared, Work
from worker.inflight import InFlightTable, deadline_message
from worker.intake import Intake
from worker.metrics import WorkerMetrics
from worker.offsets import PartitionTracker

TOPIC = "requests"
TP = TopicPartition(TOPIC, 0)


class FakeEngineLoop:
    def __init__(self) -> None:
        self.jobs: list[str] = []
        self.aborted: list[str] = []

    def submit(self, jobs) -> None:
        self.jobs.extend(j.request_id for j in jobs)

    def abort(self, ids) -> None:
        self.aborted.extend(ids)


class TwoRounds:
    """A chat handler stand-in: two jobs, then a second round of one, then the result."""

    kind = "chat"

    async def prepare(self, request, ctx) -> Prepared:
        return Prepared(work=[Work([1, 2, 3], SamplingParams(max_tokens=4)) for _ in range(2)])

    async def finish(self, request, prepared, outputs, ctx):
        if len(outputs) == 2:
            return Prepared(work=[Work([4, 5], SamplingParams(max_tokens=4))])
        return Result(id=request.id, kind="chat", text=outputs[0].text)


class RefusesAsr:
    kind = "asr"
    defer_prepare = True

    async def prepare(self, request, ctx) -> Prepared:
        raise RequestError("no predecessor", code="bad_request")


class FakePartitions:
    def __init__(self) -> None:
        self.trackers = {TP: PartitionTracker(TOPIC, 0, start_offset=0)}

    def update_pause(self) -> None:
        pass

    def fetched_before_setup(self, tp, offset) -> None:
        raise AssertionError("the partition is set up")


def _parts(batcher=None, max_running: int = 64, chat=None, deltas=None, config=None, max_record_bytes: int = 1 << 20):
    config = config or ServiceConfig()
    topics = SimpleNamespace(request_topics={"chat": TOPIC}, results="results", deltas="deltas", dlq="dlq")
    metrics = WorkerMetrics(CollectorRegistry())
    ctx = HandlerContext(tokenizer=None, max_model_len=512, max_num_batched_tokens=512, worker_id="w1",
                         model_name="m", config=config, metrics=metrics)
    engine_loop, partitions, ready = FakeEngineLoop(), FakePartitions(), asyncio.Event()
    batcher = make_batcher("fifo", max_batch_size=1, batch_timeout_s=0.0) if batcher is None else batcher
    table = InFlightTable(batcher, engine_loop, metrics, on_failed=lambda fl, code, msg: completion.complete_failure(
        fl, code, msg), max_running=max_running)
    completion = Completion(table=table, trackers=partitions.trackers, deltas=deltas, ctx=ctx, metrics=metrics,
                            topics=topics, log_prompts=False, redis=None, results_ready=ready,
                            on_progress=partitions.update_pause, max_record_bytes=max_record_bytes)
    intake = Intake(consumer=None, partitions=partitions, handlers={"chat": chat or TwoRounds(), "asr": RefusesAsr()}, ctx=ctx, table=table,
                    completion=completion, metrics=metrics, dlq_topic="dlq", max_message_bytes=1 << 20,
                    results_ready=ready)
    return intake, table, completion, engine_loop, partitions.trackers[TP], ready


def _record(offset: int, value: bytes):
    return SimpleNamespace(topic=TOPIC, partition=0, offset=offset, value=value, key=None,
                           headers=[("content-type", b"application/json")])


def _done(engine_id: str, text: str) -> RequestOutput:
    return RequestOutput(engine_id, None, [], [], text, [], text, finished=True, finish_reason="stop")


async def _a_request_with_a_second_round():
    intake, table, completion, engine_loop, tracker, ready = _parts()
    chat = b'{"id": "c1", "kind": "chat", "messages": [{"role": "user", "content": "hi"}]}'
    assert await intake.take(_record(0, chat))
    assert engine_loop.jobs == ["requests/0/0/0", "requests/0/0/1"] and len(table) == 2
    await completion.on_engine_event(EngineEvent(outputs=[_done("requests/0/0/0", "a")]))
    assert len(table) == 1 and tracker.release() is None
    await completion.on_engine_event(EngineEvent(outputs=[_done("requests/0/0/1", "b")]))
    assert engine_loop.jobs[2:] == ["requests/0/0/r2/0"] and len(table) == 1  # the second round
    await completion.on_engine_event(EngineEvent(outputs=[_done("requests/0/0/r2/0", "final")]))
    assert len(table) == 0 and ready.is_set()
    release = tracker.release()
    [record] = release.records
    result = decode_result(record.value)
    assert (record.topic, record.key, result.id, result.text, result.worker) == ("results", b"c1", "c1", "final", "w1")


async def _a_failed_job_aborts_its_sibling_and_answers_once():
    intake, table, completion, engine_loop, tracker, _ = _parts()
    chat = b'{"id": "c2", "kind": "chat", "messages": [{"role": "user", "content": "hi"}]}'
    await intake.take(_record(0, chat))
    failed = _done("requests/0/0/0", "")
    failed.error, failed.finish_reason = SimpleNamespace(code="internal", message="boom"), "error"
    await completion.on_engine_event(EngineEvent(outputs=[failed, _done("requests/0/0/1", "late")]))
    assert engine_loop.aborted == ["requests/0/0/0", "requests/0/0/1"] and len(table) == 0
    [record] = tracker.release().records
    result = decode_result(record.value)
    assert (result.status, result.error.code, result.error.message) == ("error", "internal", "boom")


async def _an_undecodable_record_is_dead_lettered_and_a_bad_request_answered():
    intake, table, _, engine_loop, tracker, _ = _parts()
    assert await intake.take(_record(0, b"\x00\x01 not json"))
    assert await intake.take(_record(1, b'{"id": "bad", "kind": "chat"}'))
    assert not engine_loop.jobs and len(table) == 0
    dead, answered = tracker.release().records
    assert dead.topic == "dlq" and answered.topic == "results"
    assert decode_result(answered.value).error.code == "bad_request"


async def _an_asr_error_is_keyed_by_its_stream_and_carries_its_seq():
    intake, _, _, _, tracker, _ = _parts()
    asr = b'{"id": "a1", "kind": "asr", "stream_id": "s9", "seq": 3, "text": "hello"}'
    assert await intake.take(_record(0, asr))
    await asyncio.gather(*intake.preparing)  # the asr handler prepares beside the consume loop
    [record] = tracker.release().records
    result = decode_result(record.value)
    assert (record.key, result.stream_id, result.seq, result.status) == (b"s9", "s9", 3, "error")


class OneJob:
    """One job per request; the request "bad" finishes with a result that cannot be encoded."""

    kind = "chat"

    async def prepare(self, request, ctx) -> Prepared:
        return Prepared(work=[Work([1, 2, 3], SamplingParams(max_tokens=4))])

    async def finish(self, request, prepared, outputs, ctx):
        return Result(id=request.id, kind="chat", text=object() if request.id == "bad" else outputs[0].text)


async def _a_request_that_breaks_completion_costs_the_others_of_its_step_nothing():
    intake, table, completion, _, tracker, _ = _parts(chat=OneJob())
    for offset, rid in enumerate(("bad", "good")):
        chat = b'{"id": "%s", "kind": "chat", "messages": [{"role": "user", "content": "hi"}]}' % rid.encode()
        await intake.take(_record(offset, chat))
    await completion.on_engine_event(EngineEvent(outputs=[_done("requests/0/0/0", "x"), _done("requests/0/1/0", "ok")]))
    # Before, the first request's exception ended the event: the second's output was dropped, neither
    # offset was ever answered, and the partition waited on them for good.
    results = [decode_result(r.value) for r in tracker.release().records]
    assert [(r.id, r.status) for r in results] == [("bad", "error"), ("good", "ok")] and len(table) == 0
    assert results[0].error.code == "internal" and results[1].text == "ok"


async def _a_result_its_partition_no_longer_waits_for_is_dropped_not_raised():
    intake, table, completion, _, tracker, _ = _parts(chat=OneJob())
    chat = b'{"id": "c3", "kind": "chat", "messages": [{"role": "user", "content": "hi"}]}'
    await intake.take(_record(0, chat))
    tracker.complete(0, [])  # answered meanwhile (say, by a deadline failure racing the output)
    await completion.on_engine_event(EngineEvent(outputs=[_done("requests/0/0/0", "late")]))
    assert len(table) == 0 and [r.value for r in tracker.release().records] == []


def test_a_request_that_breaks_completion_costs_the_others_of_its_step_nothing():
    asyncio.run(_a_request_that_breaks_completion_costs_the_others_of_its_step_nothing())


def test_a_result_its_partition_no_longer_waits_for_is_dropped_not_raised():
    asyncio.run(_a_result_its_partition_no_longer_waits_for_is_dropped_not_raised())


def test_a_request_with_a_second_round():
    asyncio.run(_a_request_with_a_second_round())


def test_a_failed_job_aborts_its_sibling_and_answers_once():
    asyncio.run(_a_failed_job_aborts_its_sibling_and_answers_once())


def test_an_undecodable_record_is_dead_lettered_and_a_bad_request_answered():
    asyncio.run(_an_undecodable_record_is_dead_lettered_and_a_bad_request_answered())


def test_an_asr_error_is_keyed_by_its_stream_and_carries_its_seq():
    asyncio.run(_an_asr_error_is_keyed_by_its_stream_and_carries_its_seq())


async def _the_batcher_holds_work_only_while_the_engine_is_full():
    # A window that would hold every job for a minute, in front of an engine that runs 3 jobs at once.
    batcher = make_batcher("dynamic_bucket", max_seq_len=512, max_batch_size=16, batch_timeout_s=60.0)
    intake, table, completion, engine_loop, _, _ = _parts(batcher, max_running=3)
    chat = b'{"id": "c%d", "kind": "chat", "messages": [{"role": "user", "content": "hi"}]}'
    assert await intake.take(_record(0, chat % 0))
    assert engine_loop.jobs == ["requests/0/0/0", "requests/0/0/1"]  # no wait: the engine had room
    assert await intake.take(_record(1, chat % 1))
    assert engine_loop.jobs[2:] == ["requests/0/1/0"] and len(batcher) == 1  # full: the last job waits
    await completion.on_engine_event(EngineEvent(outputs=[_done("requests/0/0/0", "a")]))
    assert table.room() == 1 and len(batcher) == 1
    stopping = asyncio.Event()
    timer = asyncio.create_task(table.run_batch_timer(stopping))
    await asyncio.sleep(0.05)  # one turn of the timer, woken by the finished job
    stopping.set()
    table._wakeup.set()
    await timer
    assert engine_loop.jobs[3:] == ["requests/0/1/1"] and len(batcher) == 0 and table.room() == 0


def test_the_batcher_holds_work_only_while_the_engine_is_full():
    asyncio.run(_the_batcher_holds_work_only_while_the_engine_is_full())


async def _a_running_request_past_its_deadline_is_aborted_and_answered_deadline_exceeded():
    intake, table, _, engine_loop, tracker, _ = _parts()
    deadline = int(time.time() * 1000) + 3_600_000  # an hour ahead: it starts in time
    on_time = b'{"id": "c1", "kind": "chat", "messages": [{"role": "user", "content": "hi"}], "deadline_ms": %d}'
    no_deadline = b'{"id": "c2", "kind": "chat", "messages": [{"role": "user", "content": "hi"}]}'
    assert await intake.take(_record(0, on_time % deadline)) and await intake.take(_record(1, no_deadline))
    assert len(engine_loop.jobs) == 4 and table.expire(now_ms=deadline) == 0
    assert table.expire(now_ms=deadline + 1) == 1
    assert sorted(engine_loop.aborted) == ["requests/0/0/0", "requests/0/0/1"] and len(table) == 2
    [record] = tracker.release().records
    result = decode_result(record.value)
    assert (result.id, result.status, result.error.code) == ("c1", "error", "deadline_exceeded")


def test_a_running_request_past_its_deadline_is_aborted_and_answered_deadline_exceeded():
    asyncio.run(_a_running_request_past_its_deadline_is_aborted_and_answered_deadline_exceeded())


async def _a_tombstone_is_dead_lettered_as_one():
    intake, _, _, _, tracker, _ = _parts()
    assert await intake.take(_record(0, None))
    [dead] = tracker.release().records
    letter = decode_dead_letter(dead.value)
    assert dead.topic == "dlq" and letter.reason.message == "empty payload (a tombstone record has no value)"


def test_a_tombstone_is_dead_lettered_as_one():
    asyncio.run(_a_tombstone_is_dead_lettered_as_one())


def test_a_deadline_sent_as_a_duration_is_named_as_one():
    now = float(int(time.time() * 1000))
    assert deadline_message(int(now) - 5, now, "finished").startswith("deadline passed 5 ms before the request")
    message = deadline_message(5000, now, "could start")
    assert message.endswith("(deadline_ms is a Unix epoch time in milliseconds; 5000 is 5 s after 1970)")


class RecordedDeltas:
    """The delta publisher's interface, keeping what was sent."""

    def __init__(self) -> None:
        self.sent = []

    async def send(self, topic, key, value, headers) -> None:
        self.sent.append(decode_delta(value))

    def seen(self) -> list[tuple]:
        return [(d.index, d.text, d.finished, d.finish_reason, d.restart) for d in self.sent]


class StreamsAndRepairs:
    """A streamed chat whose first answer breaks a rule: a second round of one job, then the result."""

    kind = "chat"

    async def prepare(self, request, ctx) -> Prepared:
        return Prepared(work=[Work([1, 2, 3], SamplingParams(max_tokens=4), stream=True)])

    async def finish(self, request, prepared, outputs, ctx):
        (out,) = outputs
        if len(out.prompt_token_ids) == 3 and request.id == "repaired":
            return Prepared(work=[Work([1, 2, 3, 4], SamplingParams(max_tokens=4), stream=True)])
        return Result(id=request.id, kind="chat", text=out.text, finish_reason=out.finish_reason,
                      usage=Usage(prompt_tokens=len(out.prompt_token_ids), completion_tokens=len(out.token_ids),
                                  cached_tokens=out.num_cached_tokens))


def _step(engine_id, prompt, tokens, text, new_text, *, finished=False, cached=0, first_token_at=None):
    metrics = RequestMetrics(time.monotonic(), first_token_at, first_token_at, None)
    return RequestOutput(engine_id, None, prompt, tokens, text, tokens[-1:], new_text, finished=finished,
                         finish_reason="stop" if finished else None, num_cached_tokens=cached, metrics=metrics)


async def _a_request_past_its_deadline_mid_generation_reports_what_it_consumed_and_ends_its_stream():
    deltas = RecordedDeltas()
    intake, table, completion, _, tracker, _ = _parts(chat=StreamsAndRepairs(), deltas=deltas)
    deadline = int(time.time() * 1000) + 3_600_000
    chat = b'{"id": "late", "kind": "chat", "messages": [{"role": "user", "content": "hi"}], "deadline_ms": %d}'
    assert await intake.take(_record(0, chat % deadline))
    first_token_at = time.monotonic()
    await completion.on_engine_event(EngineEvent(outputs=[
        _step("requests/0/0/0", [1, 2, 3], [7, 8], "ab", "ab", cached=2, first_token_at=first_token_at)]))
    await asyncio.sleep(0.02)
    assert table.expire(now_ms=deadline + 1) == 1
    await asyncio.sleep(0)  # the stream's last delta goes out from a task
    [record] = tracker.release().records
    result = decode_result(record.value)
    assert (result.status, result.error.code) == ("error", "deadline_exceeded")
    # Before, a request failed mid-generation reported no tokens at all, and its ttft was its total time.
    assert result.usage == Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=2)
    assert 0 < result.timing.ttft_ms < result.timing.total_ms - 10
    # A streaming client learns that the stream ended (before, its last delta never came).
    assert deltas.seen() == [(0, "ab", False, None, False), (1, "", True, "error", False)]


def test_a_request_past_its_deadline_mid_generation_reports_what_it_consumed_and_ends_its_stream():
    asyncio.run(_a_request_past_its_deadline_mid_generation_reports_what_it_consumed_and_ends_its_stream())


async def _a_repaired_answer_streams_after_a_restart_and_its_usage_counts_both_rounds():
    deltas = RecordedDeltas()
    intake, table, completion, engine_loop, tracker, _ = _parts(chat=StreamsAndRepairs(), deltas=deltas)
    chat = b'{"id": "repaired", "kind": "chat", "messages": [{"role": "user", "content": "hi"}]}'
    assert await intake.take(_record(0, chat))
    first_token_at = time.monotonic()
    await completion.on_engine_event(EngineEvent(outputs=[_step("requests/0/0/0", [1, 2, 3], [7], "bad ", "bad ")]))
    await completion.on_engine_event(EngineEvent(outputs=[
        _step("requests/0/0/0", [1, 2, 3], [7, 8], "bad one", "one", finished=True, cached=1,
              first_token_at=first_token_at)]))
    assert engine_loop.jobs == ["requests/0/0/0", "requests/0/0/r2/0"] and tracker.release() is None
    await asyncio.sleep(0.1)
    repair_token_at = time.monotonic()
    await completion.on_engine_event(EngineEvent(outputs=[_step("requests/0/0/r2/0", [1, 2, 3, 4], [5], "good ", "good ")]))
    await completion.on_engine_event(EngineEvent(outputs=[
        _step("requests/0/0/r2/0", [1, 2, 3, 4], [5, 6, 9], "good one", "one", finished=True, cached=3,
              first_token_at=repair_token_at)]))
    [record] = tracker.release().records
    result = decode_result(record.value)
    assert (result.status, result.text) == ("ok", "good one") and len(table) == 0
    assert result.usage == Usage(prompt_tokens=3 + 4, completion_tokens=2 + 3, cached_tokens=1 + 3)
    # The first token is the first round's: the one a streaming client saw.
    assert result.timing.ttft_ms < (repair_token_at - first_token_at) * 1000
    # The first answer's text is voided by a restart delta, then the repaired answer streams to its end.
    # Before, the stream showed the first answer and ended there, while the result held the second.
    assert deltas.seen() == [(0, "bad ", False, None, False), (1, "one", False, None, False),
                             (2, "", False, None, True), (3, "good ", False, None, False),
                             (4, "one", True, "stop", False)]


def test_a_repaired_answer_streams_after_a_restart_and_its_usage_counts_both_rounds():
    asyncio.run(_a_repaired_answer_streams_after_a_restart_and_its_usage_counts_both_rounds())


async def _unknown_fields_are_named_in_the_result_or_rejected():
    typo = b'{"id": "t1", "kind": "chat", "max_token": 5, "messages": [{"role": "user", "content": "hi", "nmae": 1}]}'
    intake, _, completion, _, tracker, _ = _parts(chat=OneJob())
    assert await intake.take(_record(0, typo))
    await completion.on_engine_event(EngineEvent(outputs=[_done("requests/0/0/0", "ok")]))
    [record] = tracker.release().records
    served = decode_result(record.value)
    assert (served.status, served.text, served.ignored_fields) == ("ok", "ok", ["max_token", "messages[0].nmae"])
    assert intake.metrics.registry.get_sample_value("infinilm_request_fields_ignored_total", {"kind": "chat"}) == 1

    config = ServiceConfig()
    config = msgspec.structs.replace(config, worker=msgspec.structs.replace(config.worker, unknown_fields="reject"))
    intake, table, _, engine_loop, tracker, _ = _parts(chat=OneJob(), config=config)
    assert await intake.take(_record(0, typo))
    assert not engine_loop.jobs and len(table) == 0
    [record] = tracker.release().records
    rejected = decode_result(record.value)
    assert (rejected.status, rejected.error.code) == ("error", "invalid_request")
    assert "`max_token` (did you mean `max_tokens`?), `messages[0].nmae`" in rejected.error.message
    assert rejected.ignored_fields == ["max_token", "messages[0].nmae"]


def test_unknown_fields_are_named_in_the_result_or_rejected():
    asyncio.run(_unknown_fields_are_named_in_the_result_or_rejected())


class LongAnswers:
    """A chat handler whose answer is its output's text repeated `times` (the request's max_tokens), with a
    logprob entry for each repeat when the request asks for them."""

    kind = "chat"

    async def prepare(self, request, ctx) -> Prepared:
        return Prepared(work=[Work([1, 2, 3], SamplingParams(max_tokens=4))])

    async def finish(self, request, prepared, outputs, ctx):
        from schemas import TokenLogprob, TopLogprob

        times = request.max_tokens
        entries = [TokenLogprob(token_id=i, token="word", logprob=-0.5, top=[
            TopLogprob(token_id=j, token=f"alt{j}", logprob=-1.0) for j in range(request.top_logprobs)])
            for i in range(times)] if request.logprobs else None
        return Result(id=request.id, kind="chat", text=outputs[0].text * times, finish_reason="length",
                      usage=Usage(prompt_tokens=3, completion_tokens=times), logprobs=entries)


async def _a_result_over_the_record_limit_is_cut_to_fit_or_answered_result_too_large():
    limit = 16 << 10
    intake, _, completion, _, tracker, _ = _parts(chat=LongAnswers(), max_record_bytes=limit)
    requests = [b'{"id": "lp", "kind": "chat", "max_tokens": 400, "logprobs": true, "top_logprobs": 5, '
                b'"messages": [{"role": "user", "content": "hi"}]}',
                b'{"id": "long", "kind": "chat", "max_tokens": 9000, "messages": [{"role": "user", "content": "hi"}]}']
    for offset, value in enumerate(requests):
        assert await intake.take(_record(offset, value))
        await completion.on_engine_event(EngineEvent(outputs=[_done(f"requests/0/{offset}/0", "word ")]))
    records = tracker.release().records
    assert all(len(r.value) <= limit for r in records)  # before: refused by the producer, for ever
    cut, refused = (decode_result(r.value) for r in records)
    assert (cut.status, cut.text, cut.truncated) == ("ok", "word " * 400, ["logprobs"])
    assert 0 < len(cut.logprobs) < 400 and cut.usage.completion_tokens == 400
    assert (refused.status, refused.error.code, refused.usage.completion_tokens) == ("error", "result_too_large", 9000)
    sample = intake.metrics.registry.get_sample_value
    assert sample("infinilm_results_truncated_total", {"kind": "chat", "field": "logprobs"}) == 1
    assert sample("infinilm_requests_total", {"kind": "chat", "status": "ok"}) == 1
    assert sample("infinilm_requests_total", {"kind": "chat", "status": "result_too_large"}) == 1


def test_a_result_over_the_record_limit_is_cut_to_fit_or_answered_result_too_large():
    asyncio.run(_a_result_over_the_record_limit_is_cut_to_fit_or_answered_result_too_large())
