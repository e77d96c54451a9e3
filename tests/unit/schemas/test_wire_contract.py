"""The wire contract: the exact keys a client sees on every record, read with plain `json.loads` and
`msgpack.unpackb`, never with our own decoders (which put defaults back and so hide a missing key).

tests/integration/test_console_clients.py checks the same key sets on what a real worker publishes.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest

from schemas import (
    Compliance,
    DeadLetter,
    Delta,
    ErrorInfo,
    Result,
    RiskItemResult,
    Timing,
    TokenLogprob,
    TopLogprob,
    Usage,
    Violation,
    decode_delta,
    decode_result,
    encode,
    error_result,
    result_key,
)

# Every result, whatever its kind and status.
RESULT_KEYS = {"v", "id", "kind", "status", "text", "finish_reason", "usage", "timing", "worker", "model"}
# What each kind adds on success.
KIND_KEYS = {
    "chat": set(),
    "chat+rules": {"compliance"},
    "chat+logprobs": {"logprobs"},
    "asr": {"stream_id", "seq", "committed_text"},
    "risk": {"items"},
    # Cut to fit one record (worker.record_size): said in `truncated`, and only those fields change.
    "chat+logprobs, truncated": {"logprobs", "truncated"},
    "asr, truncated": {"stream_id", "seq", "truncated"},
}
ERROR_KEYS = RESULT_KEYS | {"error"}
ASR_ERROR_KEYS = ERROR_KEYS | {"stream_id", "seq"}
USAGE_KEYS = {"prompt_tokens", "completion_tokens", "cached_tokens"}
TIMING_KEYS = {"queue_ms", "ttft_ms", "total_ms"}
COMPLIANCE_KEYS = {"passed", "violations"}
VIOLATION_KEYS = {"rule", "detail"}
RISK_ITEM_KEYS = {"id", "scores", "label"}
LOGPROB_KEYS = {"token_id", "token", "logprob", "top"}
TOP_LOGPROB_KEYS = {"token_id", "token", "logprob"}
DELTA_KEYS = {"v", "id", "index", "text", "finished", "finish_reason", "restart"}
DEAD_LETTER_KEYS = {"v", "topic", "partition", "offset", "payload", "reason", "ts_ms", "key", "headers", "worker"}


def plain(record: object, fmt: str) -> dict:
    """The record as a client that knows nothing of our schemas reads it."""
    data = encode(record, fmt)
    return json.loads(data) if fmt == "json" else msgpack.unpackb(data, raw=False)


def result_keys_ok(wire: dict, kind_key: str) -> None:
    """Assert an ok result's keys, nested ones included (shared with the integration tier)."""
    assert wire["status"] == "ok"
    assert set(wire) == RESULT_KEYS | KIND_KEYS[kind_key]
    assert set(wire["usage"]) == USAGE_KEYS and set(wire["timing"]) == TIMING_KEYS
    if "compliance" in wire:
        assert set(wire["compliance"]) == COMPLIANCE_KEYS
        assert all(set(v) == VIOLATION_KEYS for v in wire["compliance"]["violations"])
    for item in wire.get("items") or ():
        assert set(item) == RISK_ITEM_KEYS
    for entry in wire.get("logprobs") or ():
        assert set(entry) == LOGPROB_KEYS and all(set(t) == TOP_LOGPROB_KEYS for t in entry["top"])


def usage() -> Usage:
    return Usage(prompt_tokens=12, completion_tokens=5, cached_tokens=0)


# As the handlers build them (worker/handlers/*.py), then as the worker stamps them (timing, worker, model).
OK_RESULTS = {
    "chat": Result(id="c1", kind="chat", text="Paris.", finish_reason="stop", usage=usage()),
    "chat+rules": Result(id="c2", kind="chat", text="It costs 5.", finish_reason="stop", usage=usage(),
                         compliance=Compliance(passed=False, violations=[Violation(rule="forbid: guaranteed")])),
    "chat+logprobs": Result(id="c3", kind="chat", text="Hi", finish_reason="stop", usage=usage(), logprobs=[
        TokenLogprob(token_id=7, token="Hi", logprob=-0.1, top=[TopLogprob(token_id=7, token="Hi", logprob=-0.1)]),
        TokenLogprob(token_id=2, token="</s>", logprob=-0.5)]),
    "asr": Result(id="a1", kind="asr", text="So the meeting", finish_reason="stop", usage=usage(),
                  stream_id="call-42", seq=0, committed_text="So the meeting"),
    "risk": Result(id="r1", kind="risk", finish_reason="stop", usage=usage(),
                   items=[RiskItemResult(id="tx1", scores={"low": 0.2, "high": 0.8}, label="high")]),
    "chat+logprobs, truncated": Result(id="c4", kind="chat", text="Hi", finish_reason="stop", usage=usage(),
                                       logprobs=[TokenLogprob(token_id=7, token="Hi", logprob=-0.1)],
                                       truncated=["logprobs"]),
    "asr, truncated": Result(id="a2", kind="asr", text="So the meeting", finish_reason="stop", usage=usage(),
                             stream_id="call-42", seq=7, truncated=["committed_text"]),
}


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
@pytest.mark.parametrize("kind_key", sorted(OK_RESULTS))
def test_an_ok_result_has_status_and_exactly_its_kinds_keys(kind_key, fmt):
    result = OK_RESULTS[kind_key]
    wire = plain(Result(**{**{f: getattr(result, f) for f in result.__struct_fields__},
                           "timing": Timing(queue_ms=1.0, ttft_ms=2.0, total_ms=3.0), "worker": "w1",
                           "model": "smollm2"}), fmt)
    result_keys_ok(wire, kind_key)


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_status_text_and_finish_reason_are_written_even_at_their_defaults(fmt):
    wire = plain(Result(id="x", kind="risk"), fmt)
    assert (wire["status"], wire["text"], wire["finish_reason"], wire["worker"], wire["model"]) == (
        "ok", "", None, "", "")
    assert wire["usage"] == {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
@pytest.mark.parametrize("kind", ["chat", "risk", "", "translate"])
def test_an_error_result_has_status_error_and_its_error(kind, fmt):
    wire = plain(error_result("e1", kind or None, "invalid_request", "max_tokens must be >= 1"), fmt)
    assert set(wire) == ERROR_KEYS
    assert (wire["status"], wire["kind"], wire["finish_reason"]) == ("error", kind, None)
    assert wire["error"] == {"code": "invalid_request", "message": "max_tokens must be >= 1"}


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_an_asr_error_result_names_its_stream_and_is_keyed_by_it(fmt):
    result = error_result("a9", "asr", "sequence_gap", "waited", stream_id="call-42", seq=9)
    wire = plain(result, fmt)
    assert set(wire) == ASR_ERROR_KEYS
    assert (wire["stream_id"], wire["seq"], wire["status"]) == ("call-42", 9, "error")
    assert result_key(result) == b"call-42"


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_ignored_fields_are_written_only_when_the_request_had_some(fmt):
    named = plain(Result(id="x", kind="chat", ignored_fields=["max_token"]), fmt)
    assert set(named) == RESULT_KEYS | {"ignored_fields"} and named["ignored_fields"] == ["max_token"]
    assert "ignored_fields" not in plain(Result(id="x", kind="chat"), fmt)


def test_results_are_keyed_by_stream_id_for_asr_and_by_request_id_otherwise():
    assert result_key(OK_RESULTS["asr"]) == b"call-42"
    assert result_key(OK_RESULTS["chat"]) == b"c1"
    assert result_key(error_result("c3", "chat", "internal", "boom")) == b"c3"


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_every_delta_has_every_key(fmt):
    first = plain(Delta(id="s1", index=0, text="He"), fmt)
    last = plain(Delta(id="s1", index=3, finished=True, finish_reason="length"), fmt)
    assert set(first) == set(last) == DELTA_KEYS
    assert (first["finished"], first["finish_reason"], first["restart"]) == (False, None, False)
    assert (last["text"], last["finish_reason"]) == ("", "length")


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_a_delta_from_before_restart_existed_still_decodes(fmt):
    old = {"v": 1, "id": "s1", "index": 2, "text": "x", "finished": False, "finish_reason": None}
    wire = json.dumps(old).encode() if fmt == "json" else msgpack.packb(old)
    assert decode_delta(wire) == Delta(id="s1", index=2, text="x")


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_every_dead_letter_has_every_key(fmt):
    letter = DeadLetter(topic="infinilm.requests.chat", partition=2, offset=41, payload=b"\xff\x00",
                        reason=ErrorInfo(code="bad_request", message="unrecognized payload format"), ts_ms=1)
    wire = plain(letter, fmt)
    assert set(wire) == DEAD_LETTER_KEYS
    assert (wire["key"], wire["headers"], wire["worker"]) == (None, [], "")
    assert set(wire["reason"]) == {"code", "message"}


def test_the_readmes_result_records_are_byte_for_byte_what_a_worker_writes():
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    section = readme.split("### Results on the wire", 1)[1]
    block = section.split("```json\n", 1)[1].split("```", 1)[0]
    lines = block.strip().splitlines()
    assert len(lines) == 2
    for line in lines:
        assert encode(decode_result(line.encode()), "json") == line.encode()
    ok, error = (json.loads(line) for line in lines)
    result_keys_ok(ok, "chat")
    assert set(error) == ASR_ERROR_KEYS
