"""Dead-letter records (topic `infinilm.dlq`) for messages too broken to answer."""

from __future__ import annotations

import msgspec

from schemas.errors import ErrorInfo
from schemas.version import version_field


class DeadLetter(msgspec.Struct, frozen=True, kw_only=True):
    """A consumed record we could not reply to, kept byte for byte.

    `payload`, `key` and header values are bytes: msgpack writes them as bin,
    JSON as base64 strings, so either format carries them losslessly and the
    record can be replayed. `topic`/`partition`/`offset` locate the original;
    `ts_ms` is when it was dead-lettered (Unix epoch milliseconds). Every field is
    written, `key` as null when the record had none.
    """

    v: int = version_field()
    topic: str
    partition: int
    offset: int
    payload: bytes
    reason: ErrorInfo
    ts_ms: int
    key: bytes | None = None
    # Kafka headers in order (they may repeat); content-type is needed to re-decode.
    headers: list[tuple[str, bytes]] = msgspec.field(default_factory=list)
    worker: str = ""
