"""What workers publish: one `Result` per request, and `Delta`s while streaming.

`Result` is one struct for every kind, not a tagged union: an error result
must be able to echo a `kind` this service does not know (unsupported_kind),
and clients read one shape from `infinilm.results`.

The wire contract (what a plain `json.loads` / `msgpack.unpackb` client sees):
- every result has `v`, `id`, `kind`, `status`, `text`, `finish_reason`,
  `usage`, `timing`, `worker` and `model`; `finish_reason` is null on errors;
- `error` ({code, message}) is present exactly when `status` is "error";
- asr results add `stream_id`, `seq` and `committed_text` (an asr error
  result has `stream_id` and `seq` when the request was readable);
- risk results add `items`, each with every field of `RiskItemResult`;
- chat results add `compliance` when the request had `rules`, and `logprobs`
  (each entry with every field of `TokenLogprob`) when it asked for them;
- any result adds `ignored_fields` when the request had keys no field reads, and `truncated` when
  fields were cut to fit one Kafka record: then chat's `logprobs` holds fewer entries than tokens, or an
  asr result leaves `committed_text` out;
- every delta and dead letter has all its fields (null where unset).
tests/unit/schemas/test_wire_contract.py pins these key sets.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from schemas.errors import ErrorCode, ErrorInfo
from schemas.version import always_written, version_field

# finish_reason values workers write today ("error" only on the last delta of a request that failed).
# Readers must accept others, so the field is a plain str: a new reason must not break an old client.
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error")

Status = Literal["ok", "error"]


class _Record(msgspec.Struct, frozen=True, kw_only=True):
    """Nested records write every field: a client indexing `violations` or `label` finds the key."""


# Usage and Timing always write every field: a JSON client reading
# `usage.prompt_tokens` should find 0, not a missing key.
class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """Token counts. `cached_tokens` is the part of the prompt served from the prefix cache."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


def add_usage(a: Usage, b: Usage) -> Usage:
    """The tokens of two pieces of work on one request (a chat's rule repair runs a second generation)."""
    return Usage(prompt_tokens=a.prompt_tokens + b.prompt_tokens,
                 completion_tokens=a.completion_tokens + b.completion_tokens,
                 cached_tokens=a.cached_tokens + b.cached_tokens)


class Timing(msgspec.Struct, frozen=True, kw_only=True):
    """Milliseconds: waiting before the first step, to the first token, and end to end."""

    queue_ms: float = 0.0
    ttft_ms: float = 0.0
    total_ms: float = 0.0


class Violation(_Record, kw_only=True):
    """One compliance rule the chat output broke."""

    rule: str
    detail: str = ""


class Compliance(_Record, kw_only=True):
    """The outcome of checking a chat output against the request's `rules`."""

    passed: bool
    violations: list[Violation] = msgspec.field(default_factory=list)


class RiskItemResult(_Record, kw_only=True):
    """Scores for one risk item: label -> probability, and the most likely label."""

    id: str
    scores: dict[str, float] = msgspec.field(default_factory=dict)
    label: str | None = None


class TopLogprob(_Record, kw_only=True):
    """One of the most likely tokens at a position: its id, its text alone, and its log-probability."""

    token_id: int
    token: str
    logprob: float


class TokenLogprob(_Record, kw_only=True):
    """A generated token, its log-probability under the model (before temperature and the top-p/k/min-p
    cuts), and the `top_logprobs` most likely tokens at its position, most likely first. `token` is the
    token's text decoded alone: a token that holds part of a UTF-8 character shows U+FFFD there."""

    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob] = msgspec.field(default_factory=list)


class Result(msgspec.Struct, frozen=True, omit_defaults=True, kw_only=True):
    """The one final answer to a request (topic `infinilm.results`; key = request id, or the stream id for asr).

    `status` is "ok" or "error"; when "error", `error` says why and the other
    fields hold whatever was known. Kind-specific fields, None unless set:
    asr: `stream_id`, `seq`, `committed_text`; risk: `items`; chat: `compliance`
    (None when the request had no rules).
    """

    v: int = version_field()
    id: str
    # A str, not a Literal: error results echo kinds we do not serve, or "" when none was readable.
    kind: str
    # always_written: omit_defaults would drop these at their defaults, and the contract says every result has them.
    status: Status = always_written("ok")
    error: ErrorInfo | None = None
    text: str = always_written("")
    finish_reason: str | None = always_written(None)
    # default_factory of our own types: never omitted, so every result shows usage and timing.
    usage: Usage = msgspec.field(default_factory=Usage)
    timing: Timing = msgspec.field(default_factory=Timing)
    worker: str = always_written("")
    model: str = always_written("")
    stream_id: str | None = None
    seq: int | None = None
    committed_text: str | None = None
    items: list[RiskItemResult] | None = None
    compliance: Compliance | None = None
    # chat with `logprobs`: one entry per generated token, in order (usage.completion_tokens of them; the
    # end-of-sequence token that ended an answer is one, though `text` leaves it out).
    logprobs: list[TokenLogprob] | None = None
    # The request's keys that no field reads (a typo, a parameter this service lacks), as paths such as
    # "max_token" or "messages[0].nmae"; None when there were none (see schemas.unknown_fields).
    ignored_fields: list[str] | None = None
    # Fields cut so that the result fits one Kafka record (kafka.max_message_bytes), None when nothing was:
    # "logprobs" keeps its first entries; "committed_text" (asr) is left out, the chunks' texts make it up.
    truncated: list[str] | None = None


class Delta(msgspec.Struct, frozen=True, kw_only=True):
    """A piece of streamed output (topic `infinilm.deltas`, best effort, key = request id).

    `index` counts the deltas of one request from 0, so a client can spot a
    gap or a duplicate. The last delta has `finished` set and a `finish_reason`
    (the result's, or "error" when the request failed; its result says why).
    `restart` set: the text streamed so far is void (a chat answer that broke
    a rule is being generated again); the new answer's text follows.
    """

    v: int = version_field()
    id: str
    index: int
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    restart: bool = False


def error_result(
    request_id: str,
    kind: str | None,
    code: ErrorCode | str,
    message: str,
    *,
    worker: str = "",
    model: str = "",
    timing: Timing | None = None,
    stream_id: str | None = None,
    seq: int | None = None,
    usage: Usage | None = None,
) -> Result:
    """An error `Result`; `kind` None (unreadable) is written as "". An asr chunk's error names its stream;
    `usage`: the tokens the request consumed before it failed."""
    return Result(
        id=request_id,
        kind=kind or "",
        status="error",
        error=ErrorInfo(code=ErrorCode(code).value, message=message),
        worker=worker,
        model=model,
        timing=timing if timing is not None else Timing(),
        usage=usage if usage is not None else Usage(),
        stream_id=stream_id,
        seq=seq,
    )


def result_key(result: Result) -> bytes:
    """The Kafka key of a result: the stream id for asr, so one stream's results share a partition, in seq
    order; the request id otherwise."""
    return (result.stream_id if result.stream_id is not None else result.id).encode()
