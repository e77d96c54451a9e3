"""Every record a worker produces fits one Kafka record of `kafka.max_message_bytes`.

The producers refuse a record over that size before sending it, and a refused release is retried
on every flush, so one oversized record would wedge its partition for good. The outputs that grow
with a request are therefore cut to fit here: dead letters (they echo the input's bytes) and
results (logprobs, an asr transcript, many risk items or labels). A delta holds one step's text.
"""

from __future__ import annotations

import msgspec

from schemas import ErrorCode, ErrorInfo, Result, encode, error_result

DEFAULT_MAX_RECORD_BYTES = 1_048_576  # aiokafka's max_request_size and about a broker's message.max.bytes
# Room a result record leaves for its key (an id of at most 256 characters), headers and framing.
RESULT_ROOM = 4096
# What each kind could ask for less of, for result_too_large's message.
_ASK_FOR_LESS = {"chat": "fewer max_tokens or top_logprobs", "risk": "fewer items or labels",
                 "asr": "shorter chunks"}


def dead_letter_room(limit: int) -> int:
    """Room a dead letter leaves for its envelope: topic, reason, worker id, framing."""
    return max(4096, min(64 * 1024, limit // 8))


def fit_dead_letter(payload: bytes, key: bytes | None, headers: list[tuple[str, bytes]], reason: ErrorInfo,
                    limit: int = DEFAULT_MAX_RECORD_BYTES,
                    ) -> tuple[bytes, bytes | None, list[tuple[str, bytes]], ErrorInfo]:
    """The payload, key and headers a dead letter can keep, and its reason saying what was cut."""
    budget = limit - dead_letter_room(limit)
    extras = len(key or b"") + sum(len(k) + len(v) for k, v in headers)
    if len(payload) + extras <= budget:
        return payload, key, headers, reason
    note = ""
    if extras > budget // 2:
        key, headers, extras, note = None, [], 0, "; key and headers dropped"
    room = budget - extras
    note = f" [dead letter keeps the first {min(room, len(payload))} of {len(payload)} payload bytes{note}]"
    return payload[:room], key, headers, ErrorInfo(code=reason.code, message=reason.message + note)


def fit_result(result: Result, fmt: str, limit: int = DEFAULT_MAX_RECORD_BYTES) -> tuple[Result, bytes]:
    """`result` and its encoding, cut to fit a record of `limit` bytes.

    In order, while it does not fit: an asr result leaves its `committed_text` out (the chunks' texts
    make it up); a chat result keeps the longest run of its first `logprobs` entries that fits. Each cut
    is named in `truncated`. A result that still does not fit becomes a `result_too_large` error that
    keeps its usage and timing: the request is answered either way, never left to wedge its partition.
    """
    budget = limit - RESULT_ROOM
    value = encode(result, fmt)
    if len(value) <= budget:
        return result, value
    size = len(value)
    cut = list(result.truncated or [])
    if result.committed_text is not None:
        cut.append("committed_text")
        result = msgspec.structs.replace(result, committed_text=None, truncated=cut)
        value = encode(result, fmt)
        if len(value) <= budget:
            return result, value
    if result.logprobs:
        entries = result.logprobs
        cut = [*cut, "logprobs"]

        def keeping(n: int) -> tuple[Result, bytes]:
            kept = msgspec.structs.replace(result, logprobs=entries[:n], truncated=cut)
            return kept, encode(kept, fmt)

        best = keeping(0)
        if len(best[1]) <= budget:
            lo, hi = 0, len(entries) - 1  # the most entries that fit lie in [lo, hi]; lo is known to fit
            while lo < hi:
                mid = (lo + hi + 1) // 2
                trial = keeping(mid)
                if len(trial[1]) <= budget:
                    lo, best = mid, trial
                else:
                    hi = mid - 1
            return best
    less = _ASK_FOR_LESS.get(result.kind, "a smaller request")
    error = error_result(
        result.id, result.kind, ErrorCode.result_too_large,
        f"the answer takes {size} bytes as {fmt}, over the {budget} a result record holds "
        f"(kafka.max_message_bytes {limit}, less {RESULT_ROOM} for its key and headers); ask for {less}",
        worker=result.worker, model=result.model, timing=result.timing, stream_id=result.stream_id,
        seq=result.seq, usage=result.usage)
    error = msgspec.structs.replace(error, ignored_fields=result.ignored_fields)
    return error, encode(error, fmt)
