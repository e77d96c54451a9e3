"""Stable error codes and the exception every decoder raises.

`ErrorCode` is the one list of codes that may appear on the wire. The engine
(`engine/errors.py`) and the worker raise the same strings, so renaming a
member is a breaking change; adding one is not, because readers keep
`ErrorInfo.code` as a plain string.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec


class ErrorCode(StrEnum):
    """Why a request failed, as clients see it in `Result.error.code`."""

    # The bytes could not be decoded: too large, not JSON/msgpack, wrong types,
    # missing required fields.
    bad_request = "bad_request"
    # Decoded, but a value is out of range or inconsistent (semantic check).
    invalid_request = "invalid_request"
    # The prompt does not fit the model's context (raised by the engine).
    prompt_too_long = "prompt_too_long"
    # The envelope's `kind` is not one this service handles.
    unsupported_kind = "unsupported_kind"
    # The request's `deadline_ms` passed before it could finish.
    deadline_exceeded = "deadline_exceeded"
    # The worker shed the request under load; safe to retry later.
    overloaded = "overloaded"
    # A bug or an unexpected failure on our side.
    internal = "internal"
    # An ASR chunk arrived with a `seq` that skips ahead of the stream state.
    sequence_gap = "sequence_gap"
    # The answer does not fit one record of the results topic (kafka.max_message_bytes), even with its
    # logprobs or transcript cut (see `Result.truncated`); a smaller request fits.
    result_too_large = "result_too_large"


class ErrorInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The `error` object of an error result, and the `reason` of a dead letter."""

    # A str, not ErrorCode: a client must still decode codes added after it was built.
    code: str
    message: str = ""


class SchemaError(Exception):
    """A payload that cannot become a valid record.

    `request_id` is set only when a usable id (non-empty str, at most
    `MAX_ID_CHARS` chars) was recovered, so the worker can answer with an error
    result; when it is None the record goes to the dead-letter topic. `kind` is
    the recovered `kind` string, if any. An ASR chunk's `stream_id` and `seq`
    are kept when readable, so its error result is keyed and ordered with its
    stream's other results.
    """

    def __init__(
        self,
        code: ErrorCode | str,
        message: str,
        request_id: str | None = None,
        kind: str | None = None,
        *,
        stream_id: str | None = None,
        seq: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message
        self.request_id = request_id
        self.kind = kind
        self.stream_id = stream_id
        self.seq = seq

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"

    def __repr__(self) -> str:
        return (
            f"SchemaError(code={self.code.value!r}, message={self.message!r}, "
            f"request_id={self.request_id!r}, kind={self.kind!r})"
        )

    def to_error_info(self) -> ErrorInfo:
        return ErrorInfo(code=self.code.value, message=self.message)
