"""Continuous batching under a token budget.

Each step the scheduler first gives running requests their next tokens (one
for a decode, a chunk for an unfinished prefill), then admits waiting
requests while the budget, `max_num_seqs` and the KV pool allow. Prefill and
decode share the step. When the pool runs dry, the most recently admitted
running request is preempted: its blocks are freed and it goes back to the
front of the queue, to be recomputed later (its cached blocks usually survive
in the prefix cache, so the recompute is cheap).

Pipelined scheduling: `advance` accounts for a launched step at once, giving
each request that samples in it a PLACEHOLDER token, so the next step can be
scheduled (and its inputs built) while the device still runs this one;
`resolve` later puts the sampled tokens in and applies the stop rules. A
request that turns out to have stopped has run one step too many, whose token
is dropped. `update` is the two back to back, for a step that has finished.

Speculative decoding (synchronous scheduling only): a decode request with a
proposer's draft is scheduled as `[last token] + draft` (`num_draft` > 0);
`resolve` appends the verified run the runner returns and counts only its rows
as computed (engine/speculative.py).
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field

import torch

from engine.attention.metadata import MaskSpec
from engine.block_manager import BlockManager
from engine.request import PLACEHOLDER, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.speculative import Proposer, may_speculate, propose_all


@dataclass
class ScheduledRequest:
    """One request's share of a step, as the model runner needs it."""

    request_id: str
    token_ids: list[int]  # tokens to compute this step
    start: int  # row of token_ids[0] in the sequence (tokens already computed)
    block_table: list[int]
    sample: bool  # the chunk ends at the last known token, so its logits pick the next one
    mask: MaskSpec
    params: SamplingParams
    generator: torch.Generator | None
    history: list[int]  # the request's tokens so far (shared, not copied)
    banned: tuple[tuple[int, ...], ...] = ()  # token sequences that must not be completed
    pending_index: int = -1  # where advance() put this step's sampled token in the request's tokens
    num_draft: int = 0  # the last num_draft token_ids are a speculative draft, not yet the request's tokens
    images: tuple = ()  # the request's engine.vision.llava.ImageSpans (the runner encodes those in this chunk)

    @property
    def is_decode(self) -> bool:
        """One row per known token, each attending to the rows before it: a plain decode, or the last token
        and its draft (several decode rows of one sequence)."""
        return len(self.token_ids) == 1 + self.num_draft and self.start > 0 and self.mask.is_causal


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted_ids: list[str] = field(default_factory=list)
    # Requests that finished (or were aborted) since the previous schedule, so per-sequence state
    # outside the block manager (the model runner's KV window slots) can be released.
    finished_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class FinishedStep:
    """What update() did to one request."""

    request: Request
    new_token_id: int | None
    finished: bool
    # A verified speculative run: every token the step added, in order (new_token_id is the last).
    new_token_ids: list[int] | None = None


def chunk_size(req: Request, start: int, budget: int, grid: int) -> int:
    """Tokens to compute from row `start` within `budget`; 0 if the request must wait.

    A custom mask couples the rows of its region (a row may see later rows), so
    a prefill may be split before the region starts but never inside it: from
    the region on, everything left is computed in one step. A deterministic
    request prefills in chunks that end on a fixed grid, so how its rows are
    grouped never depends on the rest of the batch.
    """
    remaining = req.num_tokens - start
    if req.params.deterministic and remaining > 1:
        to_grid = (start // grid + 1) * grid - start
        size = min(remaining, to_grid)
        return size if size <= budget else 0
    if remaining <= budget or req.mask.is_causal:
        return min(remaining, budget)
    if start < req.mask.start:
        return min(req.mask.start - start, budget)
    return 0


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, deterministic_chunk: int = 256, proposer: Proposer | None = None,
                 num_speculative_tokens: int = 0) -> None:
        self.kv = block_manager
        self.grid = deterministic_chunk
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_ids: list[str] = []
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.num_draft_tokens = 0  # proposed, since start
        self.num_accepted_tokens = 0  # of those, verified

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.token_budget
        preempted_now = False
        drafts = self._drafts(budget)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending and self._surely_done(req):
                i += 1  # its pending token is its last: resolve() finishes it
                continue
            # A shorter draft is a prefix of the longer one (both proposers draft left to right).
            draft = drafts.get(req.request_id, [])[:budget - 1]
            if draft and self.kv.allocate(req, 1 + len(draft)):
                self._emit(out, req, 1, draft)
                budget -= 1 + len(draft)
                i += 1
                continue
            num_new = chunk_size(req, req.num_computed_tokens, budget, self.grid)
            if num_new <= 0:
                i += 1
                continue
            while not self.kv.allocate(req, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                preempted_now = True
                if victim is req:
                    break
            else:
                self._emit(out, req, num_new)
                budget -= num_new
                i += 1

        # Blocks this step's prefills will fill: a waiting request whose next block is
        # among them waits one step and then reads them from the prefix cache instead
        # of computing the same prefix twice (a burst of requests sharing a prompt).
        filling = self._blocks_being_filled(out)
        deferred: list[Request] = []
        # Admitting new work right after a preemption would only thrash the pool.
        while self.waiting and budget > 0 and not preempted_now and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            computed = self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else []
            if filling and len(computed) < len(req.block_hashes) and req.block_hashes[len(computed)] in filling:
                deferred.append(self.waiting.popleft())
                continue
            num_cached = len(computed) * self.kv.block_size
            num_new = chunk_size(req, req.num_computed_tokens + num_cached, budget, self.grid)
            if num_new <= 0:
                break  # its mask region needs a whole step's budget; wait for one
            if not self.kv.allocate(req, num_new, computed):
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
                self.kv.record_lookup(req.num_tokens, num_cached)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._emit(out, req, num_new)
            filling |= self._blocks_being_filled(out, out.scheduled[-1:])
            budget -= num_new
        self.waiting.extendleft(reversed(deferred))
        return out

    def _blocks_being_filled(self, out: SchedulerOutput, scheduled=None) -> set[int]:
        if not self.kv.enable_prefix_caching:
            return set()
        bs = self.kv.block_size
        hashes: set[int] = set()
        for s in out.scheduled if scheduled is None else scheduled:
            if len(s.token_ids) > 1 and not s.num_draft:
                req = self.requests[s.request_id]
                hashes.update(req.block_hashes[s.start // bs:(s.start + len(s.token_ids)) // bs])
        return hashes

    def _drafts(self, budget: int) -> dict[str, list[int]]:
        """Drafts for the running decode requests whose tokens are all known, each within its length limits
        and the step's budget, proposed together (a draft model runs them as one batch)."""
        if self.proposer is None:
            return {}
        asks = []
        for req in self.running:
            if req.num_pending or req.num_computed_tokens != req.num_tokens - 1 or not may_speculate(req.params):
                continue
            # The step may add num_draft + 1 tokens: all of them must fit max_tokens and max_model_len.
            limit = min(req.draft_limit or self.num_speculative_tokens, budget - 1,
                        req.params.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens - 1)
            if limit > 0:
                asks.append((req, limit))
        if not asks:
            return {}
        return {req.request_id: draft for (req, _), draft in zip(asks, propose_all(self.proposer, asks), strict=True)}

    def _emit(self, out: SchedulerOutput, req: Request, num_new: int, draft: list[int] = ()) -> None:
        start = req.num_computed_tokens
        out.scheduled.append(ScheduledRequest(
            request_id=req.request_id,
            token_ids=req.token_ids[start:start + num_new] + list(draft),
            start=start,
            block_table=list(req.block_ids),
            sample=start + num_new == req.num_tokens,
            mask=req.mask,
            params=req.params,
            generator=req.generator,
            history=req.token_ids,
            banned=req.banned_sequences,
            num_draft=len(draft),
            images=req.images,
        ))
        out.num_scheduled_tokens += num_new + len(draft)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput, sampled: dict[str, int],
               verified: dict[str, list[int]] | None = None) -> list[FinishedStep]:
        """Advance computed tokens, append sampled tokens, and finish requests that hit a limit."""
        self.advance(out)
        return self.resolve(out, sampled, verified)

    def advance(self, out: SchedulerOutput) -> None:
        """A step was launched: count its rows as computed and hold a PLACEHOLDER for each token it samples."""
        for s in out.scheduled:
            req = self.requests.get(s.request_id)
            if req is None or req.is_finished or s.num_draft:
                continue  # aborted since it was scheduled; a drafted chunk is accounted for in resolve()
            req.num_computed_tokens += len(s.token_ids)
            self.kv.register_full_blocks(req)
            if s.sample:
                req.token_ids.append(PLACEHOLDER)
                req.num_pending += 1
                s.pending_index = len(req.token_ids) - 1

    def resolve(self, out: SchedulerOutput, sampled: dict[str, int],
                verified: dict[str, list[int]] | None = None) -> list[FinishedStep]:
        """Put an advanced step's sampled tokens in place and finish requests that hit a limit.

        `verified` holds each drafted request's verified run (engine/speculative.py)."""
        steps: list[FinishedStep] = []
        for s in out.scheduled:
            req = self.requests.get(s.request_id)
            if s.num_draft and req is not None and not req.is_finished:
                run = (verified or {}).get(s.request_id)
                if run is None:
                    raise RuntimeError(f"no verified tokens for {s.request_id!r}, which was drafted in this step")
                steps.append(self._accept(req, s, run))
                continue
            if req is None or req.is_finished or s.pending_index < 0:
                continue  # finished while the step ran (abort, stop string, a stop token one step earlier)
            token = sampled.get(s.request_id)
            if token is None:  # the runner samples every row it was asked to: a bug, not an input
                raise RuntimeError(f"no sampled token for {s.request_id!r}, which sampled in this step")
            req.token_ids[s.pending_index] = token
            req.num_pending -= 1
            reason = self._stop_reason(req, token, s.pending_index + 1)
            if reason is not None:
                self.finish(req, reason)
            steps.append(FinishedStep(req, token, reason is not None))
        return steps

    def _accept(self, req: Request, s: ScheduledRequest, run: list[int]) -> FinishedStep:
        """Append a drafted step's verified run, cut at the first token that stops the request."""
        self.num_draft_tokens += s.num_draft
        self.num_accepted_tokens += len(run) - 1
        # Each drafted row costs compute (docs/perf/speculative.md has a step's time by its rows), so the
        # draft grows by 2 after a fully accepted one and shrinks by 1 after a rejection, to 1 where drafts
        # keep failing.
        limit = req.draft_limit or self.num_speculative_tokens
        req.draft_limit = (min(limit + 2, self.num_speculative_tokens) if len(run) - 1 == s.num_draft
                           else max(limit - 1, 1))
        first = req.num_tokens
        reason = None
        for token in run:
            req.token_ids.append(token)
            reason = self._stop_reason(req, token, req.num_tokens)
            if reason is not None:
                break
        # The rows computed and kept: the last known token's and the accepted drafts' before the new token.
        req.num_computed_tokens += req.num_tokens - first
        self.kv.register_full_blocks(req)
        if reason is not None:
            self.finish(req, reason)
        added = req.token_ids[first:]
        return FinishedStep(req, added[-1], reason is not None, added)

    def _surely_done(self, req: Request) -> bool:
        """Whether the request's pending tokens already reach its length limits."""
        return req.num_output_tokens >= req.params.max_tokens or req.num_tokens >= self.max_model_len

    def _stop_reason(self, req: Request, token: int, num_tokens: int) -> str | None:
        """Why the request stops at `token`, its token number `num_tokens` (None: it goes on)."""
        if token in req.stop_token_ids:
            return "stop"
        if num_tokens - req.num_prompt_tokens >= req.params.max_tokens:
            return "length"
        if num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, req: Request, reason: str, drop_last: int = 0) -> None:
        """End the request; `drop_last` removes its last tokens (a stop string ended a verified run early)."""
        if drop_last:
            del req.token_ids[len(req.token_ids) - drop_last:]
        if req.is_finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
        self.kv.free(req)
        if req.num_pending:  # tokens of steps still running, which the request will not get
            del req.token_ids[len(req.token_ids) - req.num_pending:]
            req.num_pending = 0
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self._finished_ids.append(req.request_id)
        self.requests.pop(req.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, "abort")
        return req
