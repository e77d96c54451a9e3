"""Dead letters and results are cut to fit one produced record, or their publish would fail forever and wedge
a partition (worker.record_size)."""

from __future__ import annotations

import msgspec
import pytest
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from schemas import (
    DeadLetter,
    ErrorInfo,
    Result,
    RiskItemResult,
    Timing,
    TokenLogprob,
    TopLogprob,
    Usage,
    decode_dead_letter,
    decode_result,
    encode,
    result_key,
)
from worker.record_size import DEFAULT_MAX_RECORD_BYTES as MAX_RECORD_BYTES
from worker.record_size import RESULT_ROOM, dead_letter_room, fit_dead_letter, fit_result

DEAD_LETTER_MAX_BYTES = MAX_RECORD_BYTES - dead_letter_room(MAX_RECORD_BYTES)

REASON = ErrorInfo(code="bad_request", message="payload too large: 2000000 bytes exceeds the limit of 1048576 bytes")


def record_size(payload: bytes, key: bytes | None, headers: list[tuple[str, bytes]], reason: ErrorInfo) -> int:
    letter = DeadLetter(topic="t" * 249, partition=2**31 - 1, offset=2**63 - 1, payload=payload, reason=reason,
                        ts_ms=2**62, key=key, headers=headers, worker="w" * 256)
    value = encode(letter, "msgpack")
    assert decode_dead_letter(value).payload == payload
    return DefaultRecordBatchBuilder.estimate_size_in_bytes(None, value, [("content-type", b"application/msgpack")])


def test_a_letter_that_fits_is_kept_whole():
    payload, key, headers = b"x" * 70_000, b"k", [("content-type", b"application/json")]
    assert fit_dead_letter(payload, key, headers, REASON) == (payload, key, headers, REASON)


def test_an_oversized_payload_keeps_its_head_and_says_so():
    payload = bytes(range(256)) * 8000  # 2,048,000 bytes, the size of the broker's largest record
    kept, key, headers, reason = fit_dead_letter(payload, b"key", [("content-type", b"application/json")], REASON)
    assert payload.startswith(kept) and len(kept) + 3 + len("content-type") + 16 == DEAD_LETTER_MAX_BYTES
    assert key == b"key" and headers == [("content-type", b"application/json")]
    assert reason.code == "bad_request" and reason.message.startswith(REASON.message)
    assert f"keeps the first {len(kept)} of 2048000 payload bytes" in reason.message
    assert record_size(kept, key, headers, reason) <= MAX_RECORD_BYTES


def test_a_huge_key_or_headers_are_dropped_rather_than_the_whole_payload():
    kept, key, headers, reason = fit_dead_letter(b"p" * 10, b"k" * 900_000, [("h", b"v" * 200_000)], REASON)
    assert (kept, key, headers) == (b"p" * 10, None, [])
    assert "key and headers dropped" in reason.message
    assert record_size(kept, key, headers, reason) <= MAX_RECORD_BYTES


def test_a_letter_cut_at_the_smallest_limit_fits_it():
    limit = 16 << 10
    payload = b"z" * 100_000
    kept, key, headers, reason = fit_dead_letter(payload, b"k" * 300, [("content-type", b"x")], REASON, limit)
    assert payload.startswith(kept) and len(kept) > limit // 2
    assert record_size(kept, key, headers, reason) <= limit


# --- results -------------------------------------------------------------------------------------------

USAGE = Usage(prompt_tokens=40, completion_tokens=300, cached_tokens=16)
TIMING = Timing(queue_ms=1.0, ttft_ms=20.0, total_ms=900.0)
LIMIT = 32 << 10


def logprob(i: int) -> TokenLogprob:
    return TokenLogprob(token_id=i, token=f" tok{i}", logprob=-0.001 * i,
                        top=[TopLogprob(token_id=i + j, token=f" alt{j}", logprob=-1.0 - j) for j in range(20)])


def result_record_size(result: Result, value: bytes) -> int:
    return DefaultRecordBatchBuilder.estimate_size_in_bytes(result_key(result), value,
                                                            [("content-type", b"application/msgpack")])


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_a_result_that_fits_is_sent_as_it_is(fmt):
    result = Result(id="c1", kind="chat", text="hi", usage=USAGE, logprobs=[logprob(1)])
    fitted, value = fit_result(result, fmt, LIMIT)
    assert fitted is result and value == encode(result, fmt)


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_chat_logprobs_keep_the_most_first_entries_that_fit(fmt):
    entries = [logprob(i) for i in range(300)]
    result = Result(id="c" * 256, kind="chat", text="many words " * 300, finish_reason="length", usage=USAGE,
                    timing=TIMING, logprobs=entries, ignored_fields=["max_token"])
    fitted, value = fit_result(result, fmt, LIMIT)
    kept = len(fitted.logprobs)
    assert 0 < kept < len(entries) and fitted.logprobs == entries[:kept]
    assert fitted.truncated == ["logprobs"]
    assert msgspec.structs.replace(fitted, logprobs=entries, truncated=None) == result  # nothing else changed
    assert decode_result(value) == fitted and len(value) <= LIMIT - RESULT_ROOM
    assert result_record_size(fitted, value) <= LIMIT
    one_more = msgspec.structs.replace(fitted, logprobs=entries[:kept + 1])
    assert len(encode(one_more, fmt)) > LIMIT - RESULT_ROOM  # the most that fit, not just some


def test_an_asr_result_leaves_its_transcript_out_first():
    result = Result(id="a1", kind="asr", text="the new chunk", usage=USAGE, stream_id="call-42", seq=9,
                    committed_text="word " * 20_000)
    fitted, value = fit_result(result, "msgpack", LIMIT)
    assert (fitted.committed_text, fitted.truncated, fitted.text, fitted.seq) == (None, ["committed_text"],
                                                                                 "the new chunk", 9)
    assert len(value) <= LIMIT - RESULT_ROOM


@pytest.mark.parametrize(("result", "ask"), [
    (Result(id="r1", kind="risk", usage=USAGE, items=[
        RiskItemResult(id=f"item-{i}", scores={f"label-{j}": 0.01 for j in range(100)}, label="label-0")
        for i in range(100)]), "ask for fewer items or labels"),
    (Result(id="c1", kind="chat", text="x" * 40_000, usage=USAGE), "ask for fewer max_tokens or top_logprobs"),
    (Result(id="c2", kind="chat", text="x" * 40_000, usage=USAGE, logprobs=[logprob(0)]),
     "ask for fewer max_tokens or top_logprobs"),
    (Result(id="a2", kind="asr", text="y" * 40_000, usage=USAGE, stream_id="call-7", seq=3, committed_text="y"),
     "ask for shorter chunks"),
])
@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_a_result_that_cannot_be_cut_enough_is_answered_result_too_large(result, ask, fmt):
    result = msgspec.structs.replace(result, timing=TIMING, worker="w1", model="smollm2", ignored_fields=["x"])
    fitted, value = fit_result(result, fmt, LIMIT)
    assert (fitted.status, fitted.error.code, fitted.id, fitted.kind) == ("error", "result_too_large", result.id,
                                                                          result.kind)
    assert fitted.error.message.startswith(f"the answer takes {len(encode(result, fmt))} bytes as {fmt}, over the ")
    assert fitted.error.message.endswith(ask)
    # What the client needs to account for it and to find it: usage, timing, its stream and seq.
    assert (fitted.usage, fitted.timing, fitted.worker, fitted.model, fitted.ignored_fields) == (
        USAGE, TIMING, "w1", "smollm2", ["x"])
    assert (fitted.stream_id, fitted.seq) == (result.stream_id, result.seq)
    assert decode_result(value) == fitted and len(value) <= LIMIT - RESULT_ROOM
