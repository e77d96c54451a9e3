"""Bytes in, records out, and back: the one place that encodes and decodes.

Every decoder is built once, at import. Input format comes from the Kafka
`content-type` header when it names JSON or msgpack, and is sniffed from the
first byte otherwise. Every decode function raises only `SchemaError`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Literal

import msgspec

from schemas.dead_letter import DeadLetter
from schemas.errors import ErrorCode, SchemaError
from schemas.kv_events import KVEventBatch
from schemas.requests import KINDS, AsrRequest, Request
from schemas.results import Delta, Result
from schemas.unknown_fields import UnknownField, unknown_fields
from schemas.validation import DEFAULT_LIMITS, RequestLimits, usable_id, validate_request
from schemas.version import SCHEMA_VERSION

Format = Literal["json", "msgpack"]

CONTENT_TYPES: dict[str, str] = {"json": "application/json", "msgpack": "application/msgpack"}

DEFAULT_MAX_BYTES = 1 << 20

# Error messages end up in results and logs; msgspec quotes offending values
# (e.g. an unknown tag), which a hostile payload can make arbitrarily long.
_MAX_MESSAGE_CHARS = 512

_JSON_MEDIA_TYPES = frozenset({"application/json", "text/json"})
_MSGPACK_MEDIA_TYPES = frozenset({"application/msgpack", "application/x-msgpack", "application/vnd.msgpack"})
_JSON_OBJECT_START = re.compile(rb"[ \t\r\n]*\{")
# fixmap, map16, map32: a request is always a map at the top level.
_MSGPACK_MAP_FIRST_BYTES = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])


def _decoders(type_: Any) -> dict[str, Any]:
    return {"json": msgspec.json.Decoder(type_), "msgpack": msgspec.msgpack.Decoder(type_)}


class _Envelope(msgspec.Struct):
    """The fields we try to salvage from a request that failed to decode.

    Raw keeps each value undecoded, so a wrong type in one field (or in a field
    we skip) cannot stop us reading the others.
    """

    v: msgspec.Raw = msgspec.Raw()
    id: msgspec.Raw = msgspec.Raw()
    kind: msgspec.Raw = msgspec.Raw()
    stream_id: msgspec.Raw = msgspec.Raw()
    seq: msgspec.Raw = msgspec.Raw()


_REQUEST_DECODERS = _decoders(Request)
_RESULT_DECODERS = _decoders(Result)
_DELTA_DECODERS = _decoders(Delta)
_DEAD_LETTER_DECODERS = _decoders(DeadLetter)
_KV_EVENT_BATCH_DECODERS = _decoders(KVEventBatch)
_ENVELOPE_DECODERS = _decoders(_Envelope)
_STR_DECODERS = _decoders(str)
_INT_DECODERS = _decoders(int)

_ENCODERS: dict[str, Any] = {"json": msgspec.json.Encoder(), "msgpack": msgspec.msgpack.Encoder()}


def encode(obj: Any, fmt: Format = "msgpack") -> bytes:
    """Encode any record from this package as msgpack (the default) or JSON.

    Set the Kafka `content-type` header to `CONTENT_TYPES[fmt]` next to it.
    """
    encoder = _ENCODERS.get(fmt)
    if encoder is None:
        raise ValueError(f"unknown format {fmt!r}; expected 'msgpack' or 'json'")
    return encoder.encode(obj)


def format_for_content_type(content_type: str | bytes | None) -> Format | None:
    """The format a content-type names ("json" or "msgpack", parameters ignored), else None."""
    if isinstance(content_type, bytes | bytearray):
        content_type = content_type.decode("latin-1")
    if not isinstance(content_type, str):
        return None
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type in _JSON_MEDIA_TYPES or media_type.endswith("+json"):
        return "json"
    if media_type in _MSGPACK_MEDIA_TYPES or media_type.endswith("+msgpack"):
        return "msgpack"
    return None


def sniff_format(payload: bytes) -> Format | None:
    """Guess from the first bytes: a JSON object or a msgpack map, else None."""
    if not payload:
        return None
    if payload[0] in _MSGPACK_MAP_FIRST_BYTES:
        return "msgpack"
    if _JSON_OBJECT_START.match(payload):
        return "json"
    return None


def content_type_of(headers: Iterable[tuple[str, bytes | str | None]] | None) -> str | None:
    """The first `content-type` value among Kafka record headers (name matched case-insensitively)."""
    for name, value in headers or ():
        if isinstance(name, str) and name.lower() == "content-type":
            if isinstance(value, bytes | bytearray):
                return value.decode("latin-1")
            return value if isinstance(value, str) else None
    return None


def _clip(message: str) -> str:
    if len(message) <= _MAX_MESSAGE_CHARS:
        return message
    return message[: _MAX_MESSAGE_CHARS - 3] + "..."


def _prepare(payload: object, content_type: str | bytes | None, max_bytes: int | None) -> tuple[bytes, str]:
    """Check size before any parsing, then pick the format."""
    if payload is None:
        raise SchemaError(ErrorCode.bad_request, "empty payload (a tombstone record has no value)")
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise SchemaError(ErrorCode.bad_request, f"payload must be bytes, got {type(payload).__name__}")
    size = payload.nbytes if isinstance(payload, memoryview) else len(payload)
    if size == 0:
        raise SchemaError(ErrorCode.bad_request, "empty payload")
    if max_bytes is not None and size > max_bytes:
        raise SchemaError(
            ErrorCode.bad_request, f"payload too large: {size} bytes exceeds the limit of {max_bytes} bytes"
        )
    data = payload if isinstance(payload, bytes) else bytes(payload)
    fmt = format_for_content_type(content_type) or sniff_format(data)
    if fmt is None:
        raise SchemaError(
            ErrorCode.bad_request,
            "unrecognized payload format: expected a JSON object or a msgpack map "
            "(or a content-type header naming one)",
        )
    return data, fmt


def _decode_failure_message(exc: Exception, fmt: str) -> str:
    if isinstance(exc, RecursionError):
        return f"{fmt} payload is nested too deeply"
    return _clip(f"invalid {fmt} payload: {exc}")


def _salvage(raw: msgspec.Raw, decoders: dict[str, Any], fmt: str) -> Any:
    if not raw:
        return None
    try:
        return decoders[fmt].decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None


def _request_decode_error(data: bytes, fmt: str, exc: Exception) -> SchemaError:
    """Classify a failed request decode, recovering `id` and `kind` where the payload allows."""
    try:
        envelope = _ENVELOPE_DECODERS[fmt].decode(data)
    except (msgspec.DecodeError, RecursionError):
        envelope = _Envelope()
    request_id = usable_id(_salvage(envelope.id, _STR_DECODERS, fmt))
    kind = _salvage(envelope.kind, _STR_DECODERS, fmt)
    version = _salvage(envelope.v, _INT_DECODERS, fmt)
    if isinstance(kind, str) and kind not in KINDS:
        return SchemaError(
            ErrorCode.unsupported_kind,
            _clip(f"unsupported kind {kind[:64]!r} (expected one of {', '.join(KINDS)})"),
            request_id,
            usable_id(kind),
        )
    known_kind = kind if kind in KINDS else None
    stream = {}
    if known_kind == "asr":
        stream = _stream_of(_salvage(envelope.stream_id, _STR_DECODERS, fmt), _salvage(envelope.seq, _INT_DECODERS, fmt))
    # A newer major version may fail to decode for reasons this reader cannot
    # name; say what is actually wrong.
    if isinstance(version, int) and version != SCHEMA_VERSION:
        return SchemaError(
            ErrorCode.invalid_request,
            f"unsupported schema version {version} (this reader knows {SCHEMA_VERSION}) - at `$.v`",
            request_id,
            known_kind,
            **stream,
        )
    return SchemaError(ErrorCode.bad_request, _decode_failure_message(exc, fmt), request_id, known_kind, **stream)


def _stream_of(stream_id: object, seq: object) -> dict:
    """An ASR chunk's stream and seq for its error result, where each is usable as one."""
    usable_stream = isinstance(stream_id, str) and 0 < len(stream_id) <= DEFAULT_LIMITS.max_name_chars
    usable_seq = isinstance(seq, int) and not isinstance(seq, bool) and -(1 << 63) <= seq < 1 << 63
    return {"stream_id": stream_id if usable_stream else None, "seq": seq if usable_seq else None}


def decode_request(
    payload: bytes,
    content_type: str | bytes | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    limits: RequestLimits = DEFAULT_LIMITS,
) -> Request:
    """Decode and validate one request record from a `infinilm.requests.*` topic.

    `content_type` is the record's `content-type` header (str or the raw header
    bytes); when absent or not JSON/msgpack, the format is sniffed. Payloads
    over `max_bytes` are refused before any parsing.

    Raises SchemaError, and nothing else, with code
    - bad_request: too large, empty, not JSON/msgpack, wrong types, missing fields;
    - unsupported_kind: `kind` is a string but not one of KINDS;
    - invalid_request: decoded but out of range (see `schemas.validation`),
      or a schema version this reader does not know.
    `request_id` on the error is set when a usable id could be recovered.
    """
    try:
        data, fmt = _prepare(payload, content_type, max_bytes)
        try:
            request = _REQUEST_DECODERS[fmt].decode(data)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise _request_decode_error(data, fmt, exc) from None
        try:
            validate_request(request, limits)
        except SchemaError as exc:
            if isinstance(request, AsrRequest):
                stream = _stream_of(request.stream_id, request.seq)
                exc.stream_id, exc.seq = stream["stream_id"], stream["seq"]
            raise
        return request
    except SchemaError:
        raise
    # The contract is "only SchemaError": a bug in our checks must not kill a worker.
    except Exception as exc:
        raise SchemaError(
            ErrorCode.internal, _clip(f"unexpected {type(exc).__name__} while decoding: {exc}")
        ) from exc


def unknown_request_fields(payload: bytes, content_type: str | bytes | None, request: Request) -> list[UnknownField]:
    """The keys of a request that `decode_request` accepted but no field reads (see schemas.unknown_fields)."""
    try:
        data, fmt = _prepare(payload, content_type, None)
        value = msgspec.json.decode(data) if fmt == "json" else msgspec.msgpack.decode(data)
        return unknown_fields(value, type(request))
    # It decoded once already; a failure here must not cost the request its answer.
    except Exception:
        return []


def _decode_record(
    decoders: dict[str, Any], payload: bytes, content_type: str | bytes | None, max_bytes: int | None
) -> Any:
    try:
        data, fmt = _prepare(payload, content_type, max_bytes)
        try:
            record = decoders[fmt].decode(data)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise SchemaError(ErrorCode.bad_request, _decode_failure_message(exc, fmt)) from None
        if record.v != SCHEMA_VERSION:
            raise SchemaError(
                ErrorCode.invalid_request,
                f"unsupported schema version {record.v} (this reader knows {SCHEMA_VERSION}) - at `$.v`",
            )
        return record
    except SchemaError:
        raise
    except Exception as exc:  # same contract as decode_request
        raise SchemaError(
            ErrorCode.internal, _clip(f"unexpected {type(exc).__name__} while decoding: {exc}")
        ) from exc


def decode_result(
    payload: bytes, content_type: str | bytes | None = None, *, max_bytes: int | None = None
) -> Result:
    """Decode a record from `infinilm.results`. Raises SchemaError only."""
    return _decode_record(_RESULT_DECODERS, payload, content_type, max_bytes)


def decode_delta(
    payload: bytes, content_type: str | bytes | None = None, *, max_bytes: int | None = None
) -> Delta:
    """Decode a record from `infinilm.deltas`. Raises SchemaError only."""
    return _decode_record(_DELTA_DECODERS, payload, content_type, max_bytes)


def decode_dead_letter(
    payload: bytes, content_type: str | bytes | None = None, *, max_bytes: int | None = None
) -> DeadLetter:
    """Decode a record from `infinilm.dlq`. Raises SchemaError only."""
    return _decode_record(_DEAD_LETTER_DECODERS, payload, content_type, max_bytes)


def decode_kv_event_batch(
    payload: bytes, content_type: str | bytes | None = None, *, max_bytes: int | None = None
) -> KVEventBatch:
    """Decode a `KVEventBatch` as published by a worker. Raises SchemaError only."""
    return _decode_record(_KV_EVENT_BATCH_DECODERS, payload, content_type, max_bytes)
