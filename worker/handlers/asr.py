"""Streaming ASR post-correction: correct each chunk in the light of the stream so far.

Stream state (committed corrected text, last seq, owner) lives in Redis, so
any worker can continue any stream. Chunks of a stream share a key, so they
arrive in order on one partition; still:
- a chunk whose seq was already committed gets the stored result again, and is
  never corrected twice;
- a chunk that skips ahead waits (without blocking other requests) until its
  predecessor is committed, here or on another worker, or until
  `asr.gap_timeout_s`, then gets `sequence_gap`.
The prompt puts the committed transcript before the new chunk, so the KV of
the transcript's full blocks comes from the prefix cache on the worker that
holds the stream; per chunk only the transcript's last partial block, the
previous correction, the instruction and the new chunk are prefilled.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time

from engine import MaskSpec, RequestError, RequestOutput, SamplingParams
from schemas import AsrRequest, Result, SchemaError, decode_result, encode
from worker.handlers import HandlerContext, Prepared, Work, usage_of
from worker.state import StateUnavailable

INSTRUCTION = "Rewrite this speech transcript with correct capitalization and punctuation. Keep every word."
CHUNK_MARK = "\x00CHUNK\x00"


class AsrHandler:
    kind = "asr"
    defer_prepare = True  # prepare() may wait for a predecessor chunk

    def __init__(self) -> None:
        self._committed: dict[str, asyncio.Event] = {}

    async def prepare(self, req: AsrRequest, ctx: HandlerContext) -> Prepared:
        redis = ctx.redis
        stored = await self._stored(ctx, req)
        if stored is not None:
            return Prepared(result=stored)
        deadline = time.monotonic() + ctx.config.asr.gap_timeout_s
        while True:
            if not redis.healthy:
                self._committed.pop(req.stream_id, None)
                raise RequestError("stream state is unavailable (Redis is down); retry the chunk later",
                                   code="overloaded")
            state = await redis.get_stream(req.stream_id)
            last = state.last_seq if state else -1
            if state is not None and state.final and req.seq > last:
                self._committed.pop(req.stream_id, None)
                raise RequestError(f"stream {req.stream_id!r} ended with chunk {last} (final); chunk {req.seq} "
                                   "belongs to no stream: send it under a new stream_id", code="invalid_request")
            if req.seq == last + 1:
                break
            if req.seq <= last:
                stored = await self._stored(ctx, req)
                if stored is not None:
                    return Prepared(result=stored)
                raise RequestError(f"chunk {req.seq} of stream {req.stream_id!r} was committed already and its "
                                   "result has expired", code="invalid_request")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                # Drop the stream's wake-up event so a stream that never continues leaves nothing
                # behind; another waiter on it still wakes by polling.
                self._committed.pop(req.stream_id, None)
                raise RequestError(f"chunk {req.seq} of stream {req.stream_id!r} waited "
                                   f"{ctx.config.asr.gap_timeout_s:g}s for chunk {last + 1}", code="sequence_gap")
            # Woken at once by a commit on this worker; a commit elsewhere is seen on the next poll.
            event = self._committed.setdefault(req.stream_id, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout=min(0.2, remaining))
        committed = state.text if state else ""
        tokens, mask = self._prompt(ctx, committed, req.text)
        chunk_tokens = len(ctx.tokenizer.encode(req.text, add_special_tokens=False))
        needed = len(tokens) + 2 * chunk_tokens + 16
        if needed >= ctx.max_model_len:
            what = (f"stream {req.stream_id!r} outgrew" if committed else
                    f"chunk {req.seq} of stream {req.stream_id!r} is too long alone: with its prompt and answer it "
                    f"needs {needed} tokens of")
            raise RequestError(f"{what} max_seq_len ({ctx.max_model_len} tokens)", code="prompt_too_long")
        # The correction mostly copies the chunk, where prompt-lookup drafts pay most: on whenever the
        # deployment enables speculative decoding.
        params = SamplingParams(max_tokens=2 * chunk_tokens + 16, temperature=0.0, stop=("\n",), speculative=True)
        return Prepared(work=[Work(tokens, params, mask)], state=committed)

    def _prompt(self, ctx: HandlerContext, committed: str, chunk: str) -> tuple[list[int], MaskSpec]:
        tok = ctx.tokenizer
        head, _, tail = tok.apply_chat_template(prompt_messages(committed, CHUNK_MARK)).partition(CHUNK_MARK)
        head_ids = tok.encode(head, add_special_tokens=False)
        chunk_ids = tok.encode(chunk, add_special_tokens=False)
        tail_ids = tok.encode(tail, add_special_tokens=False)
        policy = ctx.config.asr.mask_policy
        mask = MaskSpec("chunk_bidirectional", start=len(head_ids), end=len(head_ids) + len(chunk_ids)) \
            if policy == "chunk_bidirectional" else MaskSpec()
        return head_ids + chunk_ids + tail_ids, mask

    async def _stored(self, ctx: HandlerContext, req: AsrRequest) -> Result | None:
        raw = await ctx.redis.get_chunk_result(req.stream_id, req.seq)
        if raw is None:
            return None
        try:
            stored = decode_result(raw)
        except SchemaError:
            return None
        return stored if stored.id == req.id else _with_id(stored, req.id)

    async def finish(self, req: AsrRequest, prepared: Prepared, outputs: list[RequestOutput],
                     ctx: HandlerContext) -> Result:
        (out,) = outputs
        corrected = drop_repeated_context(prepared.state, out.text.strip(), req.text)
        if not keeps_the_chunk(corrected, req.text):
            corrected = req.text.strip()
        corrected = capitalize_after_sentence(prepared.state, corrected)
        committed = f"{prepared.state} {corrected}".strip()
        result = Result(id=req.id, kind="asr", text=corrected, finish_reason=out.finish_reason,
                        stream_id=req.stream_id, seq=req.seq, committed_text=committed,
                        usage=usage_of([out]))
        try:
            applied = await ctx.redis.commit_chunk(req.stream_id, req.seq, committed, encode(result, "msgpack"),
                                                   final=req.final)
        except StateUnavailable as exc:
            raise RequestError(f"stream state could not be saved ({exc}); retry the chunk", code="overloaded") from exc
        if applied.status == "duplicate" and applied.result:
            # Another copy of this chunk was committed first: answer with what it stored.
            return _with_id(decode_result(applied.result), req.id)
        if applied.status == "out_of_order" and applied.state is not None and applied.state.final:
            raise RequestError(f"stream {req.stream_id!r} ended with chunk {applied.state.last_seq} (final) while "
                               f"chunk {req.seq} was corrected", code="invalid_request")
        if applied.status == "out_of_order":
            raise RequestError(f"stream {req.stream_id!r} moved on while chunk {req.seq} was corrected",
                               code="sequence_gap")
        event = self._committed.pop(req.stream_id, None)
        if event is not None:
            event.set()
        return result


def prompt_messages(committed: str, chunk: str) -> list[dict]:
    """The chat that asks for a chunk's correction. The committed transcript comes first, so its KV is a
    prefix shared with the stream's next chunk; the instruction and the chunk come last, which small models
    answer by copying the chunk with fixes (a transcript-then-"new chunk" layout made them describe it)."""
    return [{"role": "system", "content": f"The transcript so far: {committed}".rstrip()},
            {"role": "user", "content": f"{INSTRUCTION}\n\n{chunk}"}]


_WORD = re.compile(r"[\w']+")


def _words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def drop_repeated_context(committed: str, corrected: str, chunk: str) -> str:
    """`corrected` without a leading restatement of the end of `committed`.

    Small models often answer a chunk with the transcript's last sentence again
    before the correction ("The meeting is moved to Tuesday at ten ..." for the
    chunk "at ten ..."); appended as it is, the running transcript would say it
    twice. Words are compared without case or punctuation. Only the longest
    run of the corrected chunk's first words that equals the committed text's
    last words is dropped, and only when the raw chunk does not itself start
    with those words (a speaker who repeats themselves keeps the repetition).
    """
    head = list(_WORD.finditer(corrected))
    said = _words(committed)
    heard = _words(chunk)
    lowered = [m.group().lower() for m in head]
    for k in range(min(len(lowered), len(said)), 0, -1):
        if lowered[:k] == said[-k:]:
            if heard[:k] == lowered[:k]:
                return corrected
            rest = corrected[head[k - 1].end():]
            return rest.lstrip(" \t,;:.!?-").strip()
    return corrected


def keeps_the_chunk(corrected: str, chunk: str) -> bool:
    """Whether `corrected` is a correction of `chunk` at all. A small model answers some short chunks
    ("um", "first", silence) with the instruction itself or a remark about the transcript; such an answer
    shares no word with the chunk, and the chunk as heard is the better text. A silent chunk stays silent."""
    heard = set(_words(chunk))
    said = set(_words(corrected))
    if not heard:
        return not said
    return bool(heard & said) and _words(INSTRUCTION)[:4] != _words(corrected)[:4]


def capitalize_after_sentence(committed: str, corrected: str) -> str:
    """`corrected` with its first letter upper-cased when `committed` ends a sentence.

    The model corrects each chunk alone and often ends it with a full stop, so a
    chunk that continues the sentence ("at ten thirty ...") would otherwise follow
    "Tuesday." in lower case.
    """
    if committed.rstrip().endswith((".", "!", "?")) and corrected[:1].islower():
        return corrected[0].upper() + corrected[1:]
    return corrected


def _with_id(result: Result, request_id: str) -> Result:
    import msgspec

    return msgspec.structs.replace(result, id=request_id)
