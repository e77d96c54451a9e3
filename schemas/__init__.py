"""Wire types for every infinilm-stream topic, and their one codec.

Topics and their records:
    infinilm.requests.{chat,asr,risk}  ChatRequest | AsrRequest | RiskRequest (tagged by "kind")
    infinilm.results                   Result (one per request, transactional)
    infinilm.deltas                    Delta (streamed output, best effort)
    infinilm.dlq                       DeadLetter (records too broken to answer)
    KV events (Kafka or Redis)         KVEventBatch of BlockStored | BlockRemoved | AllBlocksCleared

Formats: msgpack (the default for what we write) and JSON, chosen by the
record's `content-type` header or sniffed. Use `decode_request` on the worker,
`decode_result` / `decode_delta` / `decode_dead_letter` / `decode_kv_event_batch`
on clients, and `encode` for everything. Decoders raise only `SchemaError`,
whose `code` is an `ErrorCode`.

Versioning and evolution (the rule for every type in this package):
    - Every record carries `v`, the schema version, currently 1, and it is
      always written. Requests may omit it; it defaults to 1.
    - Within a version, a change may only append a new field, with a default,
      at the end of a struct. Nothing is renamed, removed, retyped or reordered,
      and no default changes meaning.
    - Readers ignore fields they do not know, so an old reader accepts records
      from a newer writer and a new reader fills defaults into older records.
    - Anything else is a breaking change: it bumps `v`, and readers refuse
      versions they do not know (invalid_request).
    - Fields that name open sets (error codes, finish reasons, result kinds)
      are plain strings on the wire, so new values do not break old readers.

This package imports neither engine/ nor worker/.
"""

from schemas.codec import (
    CONTENT_TYPES,
    DEFAULT_MAX_BYTES,
    Format,
    content_type_of,
    decode_dead_letter,
    decode_delta,
    decode_kv_event_batch,
    decode_request,
    decode_result,
    encode,
    format_for_content_type,
    sniff_format,
    unknown_request_fields,
)
from schemas.dead_letter import DeadLetter
from schemas.errors import ErrorCode, ErrorInfo, SchemaError
from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from schemas.requests import (
    DEFAULT_MAX_TOKENS,
    KINDS,
    MAX_ID_CHARS,
    ROLES,
    AsrRequest,
    ChatRequest,
    ContentPart,
    ImagePart,
    ImageURL,
    ImageURLPart,
    Message,
    Request,
    RiskItem,
    RiskRequest,
    TextPart,
    image_data,
)
from schemas.results import (
    FINISH_REASONS,
    Compliance,
    Delta,
    Result,
    RiskItemResult,
    Status,
    Timing,
    TokenLogprob,
    TopLogprob,
    Usage,
    Violation,
    add_usage,
    error_result,
    result_key,
)
from schemas.validation import (
    DEFAULT_LIMITS,
    RequestLimits,
    usable_id,
    validate_asr,
    validate_chat,
    validate_request,
    validate_risk,
)
from schemas.version import SCHEMA_VERSION

__all__ = [
    "CONTENT_TYPES",
    "DEFAULT_LIMITS",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_TOKENS",
    "FINISH_REASONS",
    "KINDS",
    "MAX_ID_CHARS",
    "ROLES",
    "SCHEMA_VERSION",
    "AllBlocksCleared",
    "AsrRequest",
    "BlockRemoved",
    "BlockStored",
    "ChatRequest",
    "Compliance",
    "ContentPart",
    "DeadLetter",
    "Delta",
    "ErrorCode",
    "ErrorInfo",
    "Format",
    "ImagePart",
    "ImageURL",
    "ImageURLPart",
    "KVEvent",
    "KVEventBatch",
    "Message",
    "Request",
    "RequestLimits",
    "Result",
    "RiskItem",
    "RiskItemResult",
    "RiskRequest",
    "SchemaError",
    "Status",
    "TextPart",
    "Timing",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "Violation",
    "add_usage",
    "content_type_of",
    "decode_dead_letter",
    "decode_delta",
    "decode_kv_event_batch",
    "decode_request",
    "decode_result",
    "encode",
    "error_result",
    "format_for_content_type",
    "image_data",
    "result_key",
    "sniff_format",
    "unknown_request_fields",
    "usable_id",
    "validate_asr",
    "validate_chat",
    "validate_request",
    "validate_risk",
]
