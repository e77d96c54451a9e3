"""Property tests: decode_request returns a Request or raises SchemaError, whatever the bytes.

And every valid request survives encode -> decode unchanged in both formats.
"""

from __future__ import annotations

import json

import msgpack
import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import (
    KINDS,
    MAX_ID_CHARS,
    ROLES,
    AsrRequest,
    ChatRequest,
    ErrorCode,
    Message,
    RiskItem,
    RiskRequest,
    SchemaError,
    decode_request,
    encode,
)

# database=None: no .hypothesis/ folder in the repo; failures print their example anyway.
FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
CONTENT_TYPES = st.sampled_from(
    [None, "application/json", "application/msgpack", "application/x-msgpack", "text/plain"]
)

names = st.text(min_size=1, max_size=24)
texts = st.text(max_size=64)
ids = st.text(min_size=1, max_size=MAX_ID_CHARS)


def _decode_or_schema_error(payload: object, content_type: str | None = None):
    """The contract: a Request, or a SchemaError that our own code did not cause."""
    try:
        request = decode_request(payload, content_type)
    except SchemaError as err:
        assert err.code is not ErrorCode.internal, err
        assert isinstance(err.code, ErrorCode)
        if err.request_id is not None:
            assert isinstance(err.request_id, str) and 0 < len(err.request_id) <= MAX_ID_CHARS
        return err
    assert isinstance(request, ChatRequest | AsrRequest | RiskRequest)
    # Whatever we accept must re-encode and come back equal in both formats.
    for fmt in ("json", "msgpack"):
        assert decode_request(encode(request, fmt)) == request
    return request


# --- valid requests ------------------------------------------------------------------------

unit_float = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
chat_requests = st.builds(
    ChatRequest,
    id=ids,
    messages=st.lists(st.builds(Message, role=st.sampled_from(ROLES), content=texts), min_size=1, max_size=4),
    max_tokens=st.integers(1, 1 << 20),
    temperature=st.floats(min_value=0.0, max_value=2.0),
    top_p=st.floats(min_value=0.0, max_value=1.0, exclude_min=True),
    top_k=st.integers(-1, 2**63 - 1),
    min_p=unit_float,
    seed=st.none() | st.integers(-(2**63), 2**64 - 1),
    stop=st.none() | st.text(min_size=1, max_size=8) | st.lists(st.text(min_size=1, max_size=8), max_size=4),
    stream=st.booleans(),
    deadline_ms=st.none() | st.integers(0, 2**63 - 1),
    rules=st.lists(st.text(min_size=1, max_size=16), max_size=3),
    deterministic=st.none() | st.booleans(),
    tenant=st.none() | names,
    mask_policy=st.sampled_from([None, "causal"]),
)
asr_requests = st.builds(
    AsrRequest, id=ids, stream_id=names, seq=st.integers(0, 2**63 - 1), text=texts, final=st.booleans()
)
risk_requests = st.builds(
    RiskRequest,
    id=ids,
    items=st.lists(names, min_size=1, max_size=5, unique=True).flatmap(
        lambda item_ids: st.tuples(*[st.builds(RiskItem, id=st.just(i), text=texts) for i in item_ids]).map(
            list
        )
    ),
    labels=st.lists(names, min_size=1, max_size=5, unique=True),
    instruction=st.none() | texts,
)
valid_requests = chat_requests | asr_requests | risk_requests


@FUZZ
@given(request=valid_requests, fmt=st.sampled_from(["json", "msgpack"]), with_header=st.booleans())
def test_valid_requests_round_trip(request, fmt, with_header):
    payload = encode(request, fmt)
    content_type = (
        {"json": "application/json", "msgpack": "application/msgpack"}[fmt] if with_header else None
    )
    assert decode_request(payload, content_type) == request


# --- arbitrary input -----------------------------------------------------------------------


@FUZZ
@given(payload=st.binary(max_size=256), content_type=CONTENT_TYPES)
def test_random_bytes(payload, content_type):
    _decode_or_schema_error(payload, content_type)


@FUZZ
@given(
    body=st.binary(max_size=128),
    first=st.sampled_from([b"{", b" \n{", b"\x81", b"\x85", b"\xde\x00\x02", b"\xdf"]),
)
def test_random_bytes_that_sniff_as_a_map(first, body):
    _decode_or_schema_error(first + body)


scalars = (
    st.none()
    | st.booleans()
    # Bounded so msgpack can carry them too; JSON's bigger integers have unit tests.
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=16)
    | st.sampled_from(["chat", "asr", "risk", "user", "id", "kind", ""])
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=6,
)
# msgpack carries more than JSON: bytes, and keys that are not strings.
msgpack_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=16)
    | st.binary(max_size=16)
)
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.integers(-5, 5), children, max_size=4)
    ),
    max_leaves=6,
)
field_names = st.sampled_from(
    [
        "id",
        "kind",
        "v",
        "messages",
        "max_tokens",
        "temperature",
        "stop",
        "seq",
        "stream_id",
        "items",
        "labels",
    ]
) | st.text(max_size=8)


def _json_bytes(value) -> bytes:
    # allow_nan: emit the NaN/Infinity literals that strict JSON parsers must refuse.
    return json.dumps(value, allow_nan=True).encode()


@FUZZ
@given(doc=st.dictionaries(field_names, json_values, max_size=6), fmt=st.sampled_from(["json", "msgpack"]))
def test_random_maps(doc, fmt):
    if fmt == "json":
        payload = _json_bytes(doc)
    else:
        payload = msgpack.packb(doc)
    _decode_or_schema_error(payload)


@FUZZ
@given(doc=st.dictionaries(field_names, msgpack_values, max_size=6))
def test_random_msgpack_maps_with_bin_and_odd_keys(doc):
    _decode_or_schema_error(msgpack.packb(doc))


# --- near misses ---------------------------------------------------------------------------


def _paths(value, prefix=()):
    """Every (path, value) inside a builtins tree, so a mutation can reach nested fields."""
    yield prefix, value
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _paths(child, (*prefix, index))


def _set(tree, path, new):
    if not path:
        return new
    node = tree
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = new
    return tree


def _delete(tree, path):
    node = tree
    for step in path[:-1]:
        node = node[step]
    del node[path[-1]]
    return tree


@st.composite
def near_misses(draw):
    """A valid request with one or two fields broken: deleted, retyped, out of range or renamed."""
    doc = msgspec.to_builtins(draw(valid_requests))
    for _ in range(draw(st.integers(1, 2))):
        paths = [path for path, _ in _paths(doc) if path]
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["delete", "replace", "kind", "add"]))
        if action == "delete":
            doc = _delete(doc, path)
        elif action == "replace":
            doc = _set(doc, path, draw(json_values))
        elif action == "kind":
            doc["kind"] = draw(st.sampled_from([*KINDS, "", "Chat", "translate"]))
        else:
            doc[draw(st.text(max_size=8))] = draw(json_values)
    return doc


@FUZZ
@given(doc=near_misses(), fmt=st.sampled_from(["json", "msgpack"]))
def test_near_miss_requests(doc, fmt):
    payload = _json_bytes(doc) if fmt == "json" else msgpack.packb(doc)
    result = _decode_or_schema_error(payload)
    request_id = doc.get("id")
    if isinstance(result, SchemaError) and _parses(payload, fmt) and isinstance(request_id, str):
        # A payload that parses as a map gives its id back, so the client gets an answer.
        assert result.request_id == (request_id if 0 < len(request_id) <= MAX_ID_CHARS else None)


def _parses(payload: bytes, fmt: str) -> bool:
    try:
        (msgspec.json if fmt == "json" else msgspec.msgpack).decode(payload)
    except msgspec.DecodeError:
        return False  # e.g. the NaN literal, which is not JSON
    return True


@FUZZ
@given(
    request=valid_requests,
    fmt=st.sampled_from(["json", "msgpack"]),
    cut=st.integers(0, 1 << 16),
    flips=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=3),
)
def test_corrupted_encodings(request, fmt, cut, flips):
    payload = bytearray(encode(request, fmt))
    for position, byte in flips:
        payload[position % len(payload)] = byte
    _decode_or_schema_error(bytes(payload[: max(1, cut % (len(payload) + 1))]))
