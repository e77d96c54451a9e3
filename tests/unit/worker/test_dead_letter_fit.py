"""Dead letters are cut to fit one produced record, or their publish would fail forever and wedge a partition."""

from __future__ import annotations

from aiokafka.record.default_records import DefaultRecordBatchBuilder

from schemas import DeadLetter, ErrorInfo, decode_dead_letter, encode
from worker.publisher import DEAD_LETTER_MAX_BYTES, MAX_RECORD_BYTES, fit_dead_letter

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
