"""Wire types: round trips, every error path, format selection and id recovery."""

from __future__ import annotations

import base64
import json
import math
import subprocess
import sys

import msgpack
import msgspec
import pytest

import schemas
from schemas import (
    CONTENT_TYPES,
    DEFAULT_MAX_BYTES,
    AllBlocksCleared,
    AsrRequest,
    BlockRemoved,
    BlockStored,
    ChatRequest,
    Compliance,
    DeadLetter,
    Delta,
    ErrorCode,
    ErrorInfo,
    KVEventBatch,
    Message,
    RequestLimits,
    Result,
    RiskItem,
    RiskItemResult,
    RiskRequest,
    SchemaError,
    Timing,
    Usage,
    Violation,
    content_type_of,
    decode_dead_letter,
    decode_delta,
    decode_kv_event_batch,
    decode_request,
    decode_result,
    encode,
    error_result,
    format_for_content_type,
    sniff_format,
)

FORMATS = ["json", "msgpack"]


def _raw(obj: dict, fmt: str) -> bytes:
    """Encode a plain dict, bypassing our types, as a client in another language would."""
    return json.dumps(obj).encode() if fmt == "json" else msgpack.packb(obj)


def _chat(**overrides) -> dict:
    return {"id": "req-1", "kind": "chat", "messages": [{"role": "user", "content": "hi"}], **overrides}


def _asr(**overrides) -> dict:
    return {"id": "req-2", "kind": "asr", "stream_id": "s-1", "seq": 0, "text": "helo world", **overrides}


def _risk(**overrides) -> dict:
    return {
        "id": "req-3",
        "kind": "risk",
        "items": [{"id": "a", "text": "t1"}, {"id": "b", "text": "t2"}],
        "labels": ["safe", "fraud"],
        **overrides,
    }


def _error(payload: bytes, content_type: str | None = None, **kwargs) -> SchemaError:
    with pytest.raises(SchemaError) as info:
        decode_request(payload, content_type, **kwargs)
    return info.value


FULL_CHAT = ChatRequest(
    id="chat-1",
    messages=[Message(role="system", content="be brief"), Message(role="user", content="héllo ☃")],
    max_tokens=64,
    temperature=0.0,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    seed=2**64 - 1,
    stop=["\n\n", "END"],
    stream=True,
    deadline_ms=1_764_000_000_000,
    rules=["no pii"],
    deterministic=True,
    tenant="acme",
    mask_policy="causal",
)
FULL_ASR = AsrRequest(id="asr-1", stream_id="call-9", seq=3, text="so um yeah", final=True)
FULL_RISK = RiskRequest(
    id="risk-1",
    items=[RiskItem(id="1", text="wire me money"), RiskItem(id="2", text="hello")],
    labels=["fraud", "spam", "ok"],
    instruction="score each text",
)


# --- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("request_", [FULL_CHAT, FULL_ASR, FULL_RISK], ids=["chat", "asr", "risk"])
def test_requests_round_trip_with_header_and_sniffed(request_, fmt):
    payload = encode(request_, fmt)
    assert decode_request(payload, CONTENT_TYPES[fmt]) == request_
    assert decode_request(payload) == request_
    assert decode_request(payload).kind == type(request_).__struct_config__.tag


@pytest.mark.parametrize("fmt", FORMATS)
def test_minimal_chat_gets_documented_defaults(fmt):
    req = decode_request(_raw(_chat(), fmt))
    assert isinstance(req, ChatRequest)
    assert req.v == 1
    assert req.messages == [Message(role="user", content="hi")]
    # max_tokens None: the worker's chat.default_max_tokens.
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k, req.min_p) == (None, 1.0, 1.0, -1, 0.0)
    assert (req.seed, req.stop, req.stream, req.deadline_ms) == (None, None, False, None)
    assert (req.rules, req.deterministic, req.tenant, req.mask_policy) == ([], None, None, None)


def test_stop_accepts_a_string_or_a_list():
    assert decode_request(_raw(_chat(stop="END"), "json")).stop_list == ["END"]
    assert decode_request(_raw(_chat(stop=["a", "b"]), "json")).stop_list == ["a", "b"]
    assert decode_request(_raw(_chat(), "json")).stop_list == []


def test_version_is_always_written_even_though_it_is_the_default():
    for record in (ChatRequest(id="x", messages=[]), Delta(id="x", index=0), Result(id="x", kind="chat")):
        assert msgspec.json.decode(encode(record, "json"))["v"] == 1


def test_unknown_fields_are_ignored_for_forward_compatibility():
    req = decode_request(_raw(_chat(future_field={"a": [1, 2]}), "json"))
    assert req == decode_request(_raw(_chat(), "json"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_results_round_trip_with_kind_specific_fields(fmt):
    results = [
        Result(
            id="chat-1",
            kind="chat",
            text="hi",
            finish_reason="stop",
            usage=Usage(prompt_tokens=10, completion_tokens=2, cached_tokens=8),
            timing=Timing(queue_ms=1.5, ttft_ms=20.0, total_ms=31.25),
            worker="w-0",
            model="smollm2",
            compliance=Compliance(passed=False, violations=[Violation(rule="no pii", detail="phone")]),
        ),
        Result(id="asr-1", kind="asr", text="so yeah", stream_id="call-9", seq=3, committed_text="so"),
        Result(
            id="risk-1",
            kind="risk",
            items=[RiskItemResult(id="1", scores={"fraud": 0.9, "ok": 0.1}, label="fraud")],
        ),
        error_result("x", "asr", ErrorCode.sequence_gap, "expected seq 4", worker="w-1"),
    ]
    for result in results:
        assert decode_result(encode(result, fmt)) == result
        assert decode_result(encode(result, fmt), CONTENT_TYPES[fmt]) == result


def test_error_result():
    result = error_result("r", None, "overloaded", "busy", model="m")
    assert (result.status, result.kind, result.model) == ("error", "", "m")
    assert result.error == ErrorInfo(code="overloaded", message="busy")
    with pytest.raises(ValueError):
        error_result("r", "chat", "not_a_code", "x")


@pytest.mark.parametrize("fmt", FORMATS)
def test_delta_round_trip(fmt):
    for delta in (
        Delta(id="r", index=0, text="He"),
        Delta(id="r", index=7, finished=True, finish_reason="length"),
    ):
        assert decode_delta(encode(delta, fmt)) == delta


@pytest.mark.parametrize("fmt", FORMATS)
def test_dead_letter_carries_raw_bytes_losslessly(fmt):
    raw = bytes(range(256)) * 3
    record = DeadLetter(
        topic="infinilm.requests.chat",
        partition=3,
        offset=12345,
        payload=raw,
        reason=ErrorInfo(code=ErrorCode.bad_request, message="invalid json payload"),
        ts_ms=1_764_000_000_123,
        key=b"\x00key",
        headers=[("content-type", b"application/json"), ("trace", b"\xff\xfe")],
        worker="w-2",
    )
    decoded = decode_dead_letter(encode(record, fmt))
    assert decoded == record
    assert decoded.payload == raw
    if fmt == "json":
        assert msgspec.json.decode(encode(record, "json"))["payload"] == base64.b64encode(raw).decode()
    else:
        # msgpack bin 16 (0xc5) for a 768-byte payload, not a str.
        assert b"\xc5" + len(raw).to_bytes(2, "big") + raw in encode(record, "msgpack")


@pytest.mark.parametrize("fmt", FORMATS)
def test_kv_event_batch_round_trip(fmt):
    batch = KVEventBatch(
        worker="w-0",
        ts_ms=1_764_000_000_000,
        model="smollm2",
        events=[
            BlockStored(
                block_hashes=[2**64 - 1, 7], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2
            ),
            BlockStored(block_hashes=[9], parent_block_hash=7, block_size=2, medium="gpu"),
            BlockRemoved(block_hashes=[7, 9]),
            AllBlocksCleared(),
        ],
    )
    assert decode_kv_event_batch(encode(batch, fmt)) == batch
    wire = msgspec.json.decode(encode(batch, "json"))
    assert [e["type"] for e in wire["events"]] == [
        "block_stored",
        "block_stored",
        "block_removed",
        "all_blocks_cleared",
    ]
    assert [type(e).type for e in batch.events] == [e["type"] for e in wire["events"]]


def test_encode_rejects_unknown_format():
    with pytest.raises(ValueError):
        encode(FULL_ASR, "xml")


# --- format selection ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content_type", "expected"),
    [
        ("application/json", "json"),
        ("application/json; charset=utf-8", "json"),
        ("  Application/JSON ;charset=UTF-8", "json"),
        (b"application/json", "json"),
        ("application/vnd.infinilm+json", "json"),
        ("application/msgpack", "msgpack"),
        ("application/x-msgpack", "msgpack"),
        ("application/vnd.msgpack", "msgpack"),
        (b"application/x-msgpack; v=1", "msgpack"),
        ("text/plain", None),
        ("", None),
        (None, None),
    ],
)
def test_format_for_content_type(content_type, expected):
    assert format_for_content_type(content_type) == expected


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (b'{"a":1}', "json"),
        (b' \t\r\n {"a":1}', "json"),
        (b"\x81\xa1a\x01", "msgpack"),
        (b"\x80", "msgpack"),
        (b"\xde\x00\x01", "msgpack"),
        (b"\xdf\x00\x00\x00\x01", "msgpack"),
        (b"[1]", None),
        (b"\x91\x01", None),
        (b"x{", None),
        (b"", None),
    ],
)
def test_sniff_format(payload, expected):
    assert sniff_format(payload) == expected


def test_content_type_of_kafka_headers():
    assert (
        content_type_of([("trace", b"1"), ("Content-Type", b"application/msgpack")]) == "application/msgpack"
    )
    assert content_type_of([("content-type", "application/json")]) == "application/json"
    assert content_type_of([("content-type", None)]) is None
    assert content_type_of([]) is None
    assert content_type_of(None) is None


def test_header_decides_over_sniffing():
    msgpack_payload = _raw(_chat(), "msgpack")
    assert decode_request(msgpack_payload, "application/x-msgpack").id == "req-1"
    err = _error(msgpack_payload, "application/json")
    assert err.code is ErrorCode.bad_request
    assert "json" in err.message


def test_unknown_content_type_falls_back_to_sniffing():
    assert decode_request(_raw(_chat(), "json"), "text/plain").id == "req-1"
    assert decode_request(_raw(_chat(), "msgpack"), "application/octet-stream").id == "req-1"


def test_bytes_like_payloads_are_accepted():
    payload = _raw(_chat(), "json")
    assert decode_request(bytearray(payload)).id == "req-1"
    assert decode_request(memoryview(payload)).id == "req-1"


# --- size limit ----------------------------------------------------------------------------


def test_size_limit_is_checked_before_decoding():
    # Malformed bytes over the limit report the size, not a parse error: nothing was parsed.
    err = _error(b"{" + b"\xff" * DEFAULT_MAX_BYTES)
    assert err.code is ErrorCode.bad_request
    assert "too large" in err.message
    assert err.request_id is None


def test_size_limit_boundary_and_parameter():
    payload = _raw(_chat(), "json")
    assert decode_request(payload, max_bytes=len(payload)).id == "req-1"
    err = _error(payload, max_bytes=len(payload) - 1)
    assert (err.code, err.request_id) == (ErrorCode.bad_request, None)
    assert "too large" in err.message


# --- bad_request ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "content_type", "needle"),
    [
        (b"", None, "empty"),
        (b"hello", None, "unrecognized payload format"),
        (b"[1, 2]", None, "unrecognized payload format"),
        (b'{"id": "x", "kind": "chat"', None, "truncated"),
        (b'{"id": "x", "kind": "chat", "messages": []} trailing', None, "malformed"),
        (b'{"id": "x", "kind": "chat", "messages": []}', "application/msgpack", "msgpack"),
        (b'{"id": "x", "kind": "chat", "messages": [], "max_tokens": 1e999}', None, "out of range"),
        (b'{"id": "x", "kind": "chat", "messages": [], "temperature": NaN}', None, "malformed"),
        (
            b'{"id": "x", "kind": "chat", "messages": [{"role": "user", "content": "\\ud800"}]}',
            None,
            "invalid json",
        ),
        (b"\x82\xa2id\xa1x\xa4kind\xa3\xff\xfe\xfd", None, "UTF-8"),
        (b"\x81\xa2id", None, "truncated"),
    ],
)
def test_undecodable_payloads_are_bad_request(payload, content_type, needle):
    err = _error(payload, content_type)
    assert err.code is ErrorCode.bad_request
    assert needle in err.message


@pytest.mark.parametrize("payload", [None, "a str", 42])
def test_non_bytes_payloads_are_bad_request(payload):
    assert _error(payload).code is ErrorCode.bad_request


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        (_chat(max_tokens="10"), "Expected `int | null`, got `str` - at `$.max_tokens`"),
        (_chat(stream=1), "Expected `bool`, got `int` - at `$.stream`"),
        (_chat(messages=[{"role": "user"}]), "missing required field `content` - at `$.messages[0]`"),
        (_chat(messages="hi"), "at `$.messages`"),
        (_chat(stop=5), "at `$.stop`"),
        ({"id": "x", "kind": "chat"}, "missing required field `messages`"),
        ({"id": "x", "messages": []}, "missing required field `kind`"),
        (_chat(kind=5), "at `$.kind`"),
        (_asr(seq=1.5), "at `$.seq`"),
        (_risk(items=[{"id": "a"}]), "at `$.items[0]`"),
    ],
)
def test_wrong_types_and_missing_fields_are_bad_request_with_a_path(fmt, doc, needle):
    err = _error(_raw(doc, fmt))
    assert err.code is ErrorCode.bad_request
    assert needle in err.message


@pytest.mark.parametrize("fmt", FORMATS)
def test_deep_nesting_is_bad_request_not_a_crash(fmt):
    depth = 200_000
    if fmt == "json":
        payload = b'{"id":"x","kind":"chat","messages":[],"junk":' + b"[" * depth + b"]" * depth + b"}"
    else:
        payload = b"\x84\xa2id\xa1x\xa4kind\xa4chat\xa8messages\x90\xa4junk" + b"\x91" * depth + b"\xc0"
    err = _error(payload)
    assert err.code is ErrorCode.bad_request
    assert "nested too deeply" in err.message


def test_nan_and_infinity_in_msgpack_are_invalid_request():
    for name in ("temperature", "top_p", "min_p"):
        for value in (math.nan, math.inf, -math.inf):
            err = _error(_raw(_chat(**{name: value}), "msgpack"))
            assert err.code is ErrorCode.invalid_request, (name, value)
            assert f"at `$.{name}`" in err.message


# --- unsupported_kind ----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_unknown_kind_is_unsupported_kind_and_keeps_the_id(fmt):
    err = _error(_raw({"id": "r-9", "kind": "translate", "text": "hola"}, fmt))
    assert (err.code, err.request_id, err.kind) == (ErrorCode.unsupported_kind, "r-9", "translate")
    assert "translate" in err.message


def test_huge_unknown_kind_is_not_echoed_in_full():
    err = _error(_raw({"id": "r", "kind": "k" * 10_000}, "json"))
    assert err.code is ErrorCode.unsupported_kind
    assert err.kind is None
    assert len(err.message) < 600


# --- invalid_request -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "path"),
    [
        (_chat(id=""), "id"),
        (_chat(id="x" * 257), "id"),
        (_chat(v=0), "v"),
        (_chat(messages=[]), "messages"),
        (_chat(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
        (_chat(max_tokens=0), "max_tokens"),
        (_chat(max_tokens=-5), "max_tokens"),
        (_chat(max_tokens=2**40), "max_tokens"),
        (_chat(temperature=-0.1), "temperature"),
        (_chat(temperature=2.5), "temperature"),
        (_chat(top_p=0.0), "top_p"),
        (_chat(top_p=1.01), "top_p"),
        (_chat(top_k=-2), "top_k"),
        (_chat(min_p=1.5), "min_p"),
        (_chat(seed=-(2**63) - 1), "seed"),
        (_chat(stop=""), "stop"),
        (_chat(stop=["ok", ""]), "stop[1]"),
        (_chat(stop=["s"] * 17), "stop"),
        (_chat(stop="x" * 257), "stop"),
        (_chat(deadline_ms=-1), "deadline_ms"),
        (_chat(rules=[""]), "rules[0]"),
        (_chat(tenant=""), "tenant"),
        (_chat(mask_policy="m" * 257), "mask_policy"),
        (_chat(mask_policy="prefix_bidirectional"), "mask_policy"),  # an ASR/risk policy: refused, not ignored
        (_chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        (_chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
        (_chat(top_logprobs=2), "top_logprobs"),  # alternatives without the flag that returns them
        (_asr(seq=-1), "seq"),
        (_asr(seq=2**63), "seq"),
        (_asr(stream_id=""), "stream_id"),
        (_risk(items=[]), "items"),
        (_risk(items=[{"id": "", "text": "t"}]), "items[0].id"),
        (_risk(items=[{"id": "a", "text": "t"}, {"id": "a", "text": "u"}]), "items[1].id"),
        (_risk(labels=["x", ""]), "labels[1]"),
        (_risk(labels=["x", "y", "x"]), "labels[2]"),
    ],
)
def test_semantic_violations_are_invalid_request_with_a_path(doc, path):
    # JSON only: msgpack cannot even carry some of these integers.
    err = _error(_raw(doc, "json"))
    assert err.code is ErrorCode.invalid_request
    assert err.message.endswith(f"- at `$.{path}`")
    assert err.kind == doc["kind"]
    if path != "id":
        assert err.request_id == doc["id"]


def test_huge_json_integers_are_invalid_request_with_a_short_message():
    err = _error(_raw(_asr(seq=10**4000), "json"))
    assert err.code is ErrorCode.invalid_request
    assert err.message == "must be in [0, 9223372036854775807], got an integer of 13288 bits - at `$.seq`"


@pytest.mark.parametrize("value", [0, -1, 1, 2**20])
def test_top_k_disabled_values_and_bounds(value):
    assert decode_request(_raw(_chat(top_k=value), "json")).top_k == value


def test_newer_major_version_is_invalid_request_even_if_fields_changed():
    err = _error(_raw(_chat(v=2, messages="new shape"), "json"))
    assert (err.code, err.request_id, err.kind) == (ErrorCode.invalid_request, "req-1", "chat")
    assert "version 2" in err.message


def test_limits_are_configurable():
    tight = RequestLimits(max_text_chars=4, max_messages=1, max_items=1, max_labels=1)
    assert _error(
        _raw(_chat(messages=[{"role": "user", "content": "hello"}]), "json"), limits=tight
    ).code == (ErrorCode.invalid_request)
    assert _error(
        _raw(_chat(messages=[{"role": "user", "content": "a"}] * 2), "json"), limits=tight
    ).code == (ErrorCode.invalid_request)
    assert _error(_raw(_asr(text="hello"), "json"), limits=tight).code == ErrorCode.invalid_request
    assert _error(_raw(_risk(), "json"), limits=tight).code == ErrorCode.invalid_request
    assert decode_request(_raw(_chat(messages=[{"role": "user", "content": "hey"}]), "json"), limits=tight)


# --- id recovery ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_id_and_kind_are_recovered_from_a_payload_that_fails_to_decode(fmt):
    err = _error(_raw(_chat(id="keep-me", max_tokens="lots"), fmt))
    assert (err.code, err.request_id, err.kind) == (ErrorCode.bad_request, "keep-me", "chat")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "doc",
    [
        {"kind": "chat", "messages": 1},
        _chat(id="", messages=1),
        _chat(id="x" * 257, messages=1),
        _chat(id=17, messages=1),
        _chat(id=["a"], messages=1),
    ],
    ids=["missing", "empty", "too-long", "int", "list"],
)
def test_no_usable_id_means_none_so_the_record_goes_to_the_dlq(fmt, doc):
    err = _error(_raw(doc, fmt))
    assert err.code is ErrorCode.bad_request
    assert err.request_id is None
    assert err.kind == "chat"


def test_no_recovery_from_malformed_json_even_when_an_id_is_visible():
    err = _error(b'{"id": "r-1", "kind": "chat", "messages": [')
    assert (err.request_id, err.kind) == (None, None)


def test_nested_ids_are_never_mistaken_for_the_request_id():
    err = _error(_raw({"kind": "risk", "items": [{"id": "inner", "text": "t"}], "labels": 3}, "json"))
    assert err.request_id is None


def test_unknown_kind_value_types_are_bad_request():
    err = _error(_raw({"id": "r", "kind": None}, "json"))
    assert (err.code, err.request_id, err.kind) == (ErrorCode.bad_request, "r", None)


# --- errors and the safety net -------------------------------------------------------------


def test_error_codes_are_the_documented_set():
    assert {code.value for code in ErrorCode} == {
        "bad_request",
        "invalid_request",
        "prompt_too_long",
        "unsupported_kind",
        "deadline_exceeded",
        "overloaded",
        "internal",
        "sequence_gap",
        "result_too_large",
    }
    assert ErrorCode.overloaded == "overloaded"


def test_schema_error_surface():
    err = SchemaError("invalid_request", "bad top_p", request_id="r", kind="chat")
    assert err.code is ErrorCode.invalid_request
    assert str(err) == "invalid_request: bad top_p"
    assert err.to_error_info() == ErrorInfo(code="invalid_request", message="bad top_p")
    assert "request_id='r'" in repr(err)
    with pytest.raises(ValueError):
        SchemaError("nope", "x")


def test_an_unexpected_exception_becomes_an_internal_schema_error(monkeypatch):
    def broken(req, limits):
        raise ZeroDivisionError("bug")

    monkeypatch.setattr(schemas.codec, "validate_request", broken)
    err = _error(_raw(_chat(), "json"))
    assert err.code is ErrorCode.internal
    assert "ZeroDivisionError" in err.message


# --- client decoders -----------------------------------------------------------------------


@pytest.mark.parametrize("decode", [decode_result, decode_delta, decode_dead_letter, decode_kv_event_batch])
def test_client_decoders_raise_only_schema_error(decode):
    for payload in (b"", b"junk", b'{"v": 1}', b"\x81\xa1v\x01", None):
        with pytest.raises(SchemaError) as info:
            decode(payload)
        assert info.value.code is ErrorCode.bad_request
    with pytest.raises(SchemaError) as info:
        decode(b'{"v": 1}', max_bytes=4)
    assert "too large" in info.value.message


def test_client_decoders_refuse_unknown_versions():
    payload = _raw({"v": 2, "id": "r", "index": 0}, "msgpack")
    with pytest.raises(SchemaError) as info:
        decode_delta(payload)
    assert info.value.code is ErrorCode.invalid_request


def test_client_decoders_ignore_unknown_fields():
    payload = _raw({"v": 1, "id": "r", "kind": "chat", "added_in_v1_5": [1]}, "json")
    assert decode_result(payload) == Result(id="r", kind="chat")


def test_schemas_never_import_engine_or_worker():
    code = "import sys, schemas; bad = [m for m in sys.modules if m.split('.')[0] in ('engine', 'worker')]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("raw", "code", "stream"), [
    (b'{"id": "a", "kind": "asr", "stream_id": "s", "seq": -1, "text": "t"}', "invalid_request", ("s", -1)),
    (b'{"id": "a", "kind": "asr", "stream_id": "s", "seq": 2, "text": 5}', "bad_request", ("s", 2)),
    (b'{"id": "a", "kind": "asr", "stream_id": "s", "seq": "2", "text": "t"}', "bad_request", ("s", None)),
    (b'{"id": "a", "kind": "asr", "stream_id": "", "seq": 1, "text": "t"}', "invalid_request", (None, 1)),
    (b'{"id": "a", "kind": "chat", "stream_id": "s", "seq": 1, "messages": 5}', "bad_request", (None, None)),
])
def test_an_asr_chunk_that_fails_keeps_its_stream_and_seq_where_readable(raw, code, stream):
    err = _error(raw)
    assert err.code == code and (err.stream_id, err.seq) == stream
