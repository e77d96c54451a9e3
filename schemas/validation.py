"""Semantic checks on decoded requests: one function per kind.

msgspec has already checked types and required fields by the time these run;
what is left is ranges, limits and consistency, all reported as
`invalid_request`. Messages end with msgspec's `- at `$.path`` suffix so both
kinds of failure read the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from schemas.errors import ErrorCode, SchemaError
from schemas.requests import (
    MAX_ID_CHARS,
    ROLES,
    AsrRequest,
    ChatRequest,
    ImageURLPart,
    Request,
    RiskRequest,
    TextPart,
)
from schemas.version import SCHEMA_VERSION

INT64_MAX = (1 << 63) - 1
INT64_MIN = -(1 << 63)
UINT64_MAX = (1 << 64) - 1

# OpenAI's upper bound; past it sampling is noise.
MAX_TEMPERATURE = 2.0
MAX_TOP_LOGPROBS = 20  # OpenAI's bound, and the engine's


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Bounds on request contents, so one hostile message cannot cost us much.

    Lengths count characters (code points). The byte limit on the whole payload
    is `decode_request(max_bytes=...)`, checked before these.
    """

    max_text_chars: int = 256 * 1024  # a message's content, an ASR chunk, a risk item, an instruction
    max_name_chars: int = 256  # stream_id, tenant, mask_policy, risk item ids, labels
    max_tokens: int = 1 << 20  # same bound as the engine's SamplingParams
    max_messages: int = 1024
    max_parts: int = 1024  # of one message's content list
    max_stop: int = 16
    max_stop_chars: int = 256
    max_rules: int = 64
    max_rule_chars: int = 4096
    max_items: int = 1024
    max_labels: int = 256


DEFAULT_LIMITS = RequestLimits()


def usable_id(value: object) -> str | None:
    """`value` if it can key a result (a non-empty str of at most MAX_ID_CHARS), else None."""
    if isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS:
        return value
    return None


class _Check:
    """Raises invalid_request for one request, tagged with its id and kind."""

    def __init__(self, req: Request) -> None:
        self.request_id = usable_id(req.id)
        self.kind = req.kind

    def fail(self, problem: str, path: str) -> SchemaError:
        return SchemaError(
            ErrorCode.invalid_request, f"{problem} - at `$.{path}`", self.request_id, self.kind
        )

    def text(self, value: str, path: str, max_chars: int, *, non_empty: bool = False) -> None:
        if non_empty and not value:
            raise self.fail("must not be empty", path)
        if len(value) > max_chars:
            raise self.fail(f"too long: {len(value)} chars > {max_chars}", path)

    def int_range(self, value: int, path: str, low: int, high: int) -> None:
        if not low <= value <= high:
            # JSON integers can have thousands of digits; don't echo them whole.
            shown = str(value) if value.bit_length() <= 128 else f"an integer of {value.bit_length()} bits"
            raise self.fail(f"must be in [{low}, {high}], got {shown}", path)

    def finite(self, value: float, path: str) -> None:
        if not math.isfinite(value):
            raise self.fail(f"must be a finite number, got {value}", path)

    def count(self, values: list, path: str, max_count: int, *, non_empty: bool = True) -> None:
        if non_empty and not values:
            raise self.fail("must not be empty", path)
        if len(values) > max_count:
            raise self.fail(f"too many entries: {len(values)} > {max_count}", path)

    def unique(self, values: list[str], path: str) -> None:
        seen: set[str] = set()
        for i, value in enumerate(values):
            if value in seen:
                raise self.fail(f"duplicate value {_short(value)}", f"{path}[{i}]")
            seen.add(value)


def _short(value: str, limit: int = 64) -> str:
    return repr(value) if len(value) <= limit else repr(value[:limit]) + "..."


def _check_envelope(req: Request, check: _Check) -> None:
    if req.v != SCHEMA_VERSION:
        raise check.fail(f"unsupported schema version {req.v} (this reader knows {SCHEMA_VERSION})", "v")
    if check.request_id is None:
        raise check.fail(f"must be a non-empty string of at most {MAX_ID_CHARS} chars", "id")


def validate_chat(req: ChatRequest, limits: RequestLimits = DEFAULT_LIMITS) -> None:
    """Raise SchemaError(invalid_request) unless `req` is a chat request we can run."""
    check = _Check(req)
    _check_envelope(req, check)
    check.count(req.messages, "messages", limits.max_messages)
    for i, message in enumerate(req.messages):
        if message.role not in ROLES:
            raise check.fail(
                f"unknown role {_short(message.role)} (expected one of {', '.join(ROLES)})",
                f"messages[{i}].role",
            )
        if isinstance(message.content, str):
            check.text(message.content, f"messages[{i}].content", limits.max_text_chars)
            continue
        check.count(message.content, f"messages[{i}].content", limits.max_parts)
        for j, part in enumerate(message.content):
            if isinstance(part, TextPart):
                check.text(part.text, f"messages[{i}].content[{j}].text", limits.max_text_chars)
            elif isinstance(part, ImageURLPart) and not part.image_url.url:
                raise check.fail("must not be empty", f"messages[{i}].content[{j}].image_url.url")
    if req.max_tokens is not None:
        check.int_range(req.max_tokens, "max_tokens", 1, limits.max_tokens)
    check.finite(req.temperature, "temperature")
    if not 0.0 <= req.temperature <= MAX_TEMPERATURE:
        raise check.fail(f"must be in [0, {MAX_TEMPERATURE}], got {req.temperature}", "temperature")
    check.finite(req.top_p, "top_p")
    if not 0.0 < req.top_p <= 1.0:
        raise check.fail(f"must be in (0, 1], got {req.top_p}", "top_p")
    check.int_range(req.top_k, "top_k", -1, INT64_MAX)
    check.finite(req.min_p, "min_p")
    if not 0.0 <= req.min_p <= 1.0:
        raise check.fail(f"must be in [0, 1], got {req.min_p}", "min_p")
    if req.seed is not None:
        check.int_range(req.seed, "seed", INT64_MIN, UINT64_MAX)
    if isinstance(req.stop, list):
        check.count(req.stop, "stop", limits.max_stop, non_empty=False)
        for i, stop in enumerate(req.stop):
            check.text(stop, f"stop[{i}]", limits.max_stop_chars, non_empty=True)
    elif req.stop is not None:
        check.text(req.stop, "stop", limits.max_stop_chars, non_empty=True)
    if req.deadline_ms is not None:
        check.int_range(req.deadline_ms, "deadline_ms", 0, INT64_MAX)
    check.count(req.rules, "rules", limits.max_rules, non_empty=False)
    for i, rule in enumerate(req.rules):
        check.text(rule, f"rules[{i}]", limits.max_rule_chars, non_empty=True)
    if req.tenant is not None:
        check.text(req.tenant, "tenant", limits.max_name_chars, non_empty=True)
    check.int_range(req.top_logprobs, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if req.top_logprobs and not req.logprobs:
        raise check.fail("needs `logprobs: true` (the alternatives come with each token's own log-probability)",
                         "top_logprobs")
    if req.mask_policy is not None and req.mask_policy != "causal":
        # The other policies are the ASR and risk handlers' (asr.mask_policy, packed risk segments); a chat
        # model answers causally. Accepting a name and ignoring it would look like it had been applied.
        raise check.fail(f"unknown or unsupported policy {_short(req.mask_policy)}; chat requests take "
                         "'causal' (or none)", "mask_policy")


def validate_asr(req: AsrRequest, limits: RequestLimits = DEFAULT_LIMITS) -> None:
    """Raise SchemaError(invalid_request) unless `req` is a well-formed ASR chunk."""
    check = _Check(req)
    _check_envelope(req, check)
    check.text(req.stream_id, "stream_id", limits.max_name_chars, non_empty=True)
    check.int_range(req.seq, "seq", 0, INT64_MAX)
    check.text(req.text, "text", limits.max_text_chars)


def validate_risk(req: RiskRequest, limits: RequestLimits = DEFAULT_LIMITS) -> None:
    """Raise SchemaError(invalid_request) unless `req` is a risk batch we can score."""
    check = _Check(req)
    _check_envelope(req, check)
    check.count(req.items, "items", limits.max_items)
    # Results are keyed by item id, so two items with one id would be ambiguous.
    item_ids: set[str] = set()
    for i, item in enumerate(req.items):
        check.text(item.id, f"items[{i}].id", limits.max_name_chars, non_empty=True)
        if item.id in item_ids:
            raise check.fail(f"duplicate item id {_short(item.id)}", f"items[{i}].id")
        item_ids.add(item.id)
        check.text(item.text, f"items[{i}].text", limits.max_text_chars)
    check.count(req.labels, "labels", limits.max_labels, non_empty=False)  # none: the worker's defaults
    for i, label in enumerate(req.labels):
        check.text(label, f"labels[{i}]", limits.max_name_chars, non_empty=True)
    check.unique(req.labels, "labels")
    if req.instruction is not None:
        check.text(req.instruction, "instruction", limits.max_text_chars)


_VALIDATORS: dict[type, Callable[[Request, RequestLimits], None]] = {
    ChatRequest: validate_chat,
    AsrRequest: validate_asr,
    RiskRequest: validate_risk,
}


def validate_request(req: Request, limits: RequestLimits = DEFAULT_LIMITS) -> None:
    """Run the semantic checks for `req`'s kind; raise SchemaError(invalid_request) on failure."""
    _VALIDATORS[type(req)](req, limits)
