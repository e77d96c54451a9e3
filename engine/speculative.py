"""Speculative decoding: draft proposers and the acceptance rule that verifies their drafts.

A running decode request may be scheduled with `[last token] + draft`; one
forward pass gives logits for every row, and `verify` turns them into the
tokens the request keeps: the accepted prefix of the draft plus one token
sampled from the row after it. The proposers here draft without a model
(point-mass drafts), so the acceptance rule needs only the target's
probabilities.

NOTE: a request's token list never holds an unverified token. Drafts travel
only in the step's ScheduledRequest; the scheduler appends the verified run
and advances num_computed_tokens by its length, so block tables and
prefix-cache hashes only ever see verified tokens, and the KV rows written for
rejected drafts are overwritten when those positions are computed again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from engine.sampler import filtered_probs, greedy_choice
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.request import Request


class Drafted(Protocol):
    """What `verify` reads of a drafted request's share of a step (the scheduler's ScheduledRequest)."""

    token_ids: list[int]
    num_draft: int
    params: SamplingParams
    generator: torch.Generator | None


class Proposer(Protocol):
    """Drafts the next tokens of a request; a draft-model proposer implements the same call."""

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """At most `max_tokens` tokens that likely follow request.token_ids (all known); [] for none."""
        ...


class PromptLookupProposer:
    """N-gram lookup in the request's own tokens (prompt and output so far).

    The last n tokens (n from max_n down to min_n) are looked up in the earlier
    tokens; the tokens that followed their most recent earlier occurrence are
    the draft. Copy-heavy outputs (ASR post-correction, quoting a document)
    find long drafts; free text finds few, and then the step is a plain decode.
    """

    def __init__(self, max_n: int, min_n: int) -> None:
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        tokens = np.asarray(request.token_ids, dtype=np.int64)
        total = len(tokens)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            # Windows over tokens[:-1] start at most at total - n - 1: a token follows each, and the
            # suffix itself (starting at total - n) is never its own match.
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[total - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start:start + max_tokens].tolist()
        return []


def propose_all(proposer: Proposer, asks: list[tuple[Request, int]]) -> list[list[int]]:
    """Drafts for several requests at once, each within its own token limit: in one batch where the
    proposer can (`propose_many`, a draft model's engine), else one request at a time."""
    many = getattr(proposer, "propose_many", None)
    if many is not None:
        return many(asks)
    return [proposer.propose(req, limit) for req, limit in asks]


def make_proposer(config: EngineConfig) -> Proposer | None:
    if config.speculative_method == "prompt_lookup":
        return PromptLookupProposer(config.prompt_lookup_max, config.prompt_lookup_min)
    return None


def may_speculate(params: SamplingParams) -> bool:
    """Requests whose per-token extras assume one token a step do not speculate: logprobs, banned
    phrases (checked against the token before) and batch-invariant (deterministic) requests."""
    return (params.speculative and params.logprobs is None and not params.banned_phrases
            and not params.deterministic)


def verify(logits: torch.Tensor, drafted: list[Drafted]) -> list[list[int]]:
    """The tokens each drafted request keeps: its accepted draft prefix, then one more.

    logits: [sum(num_draft + 1), vocab] fp32, each request's rows in order; row i of a
    request predicts the token after its i-th scheduled token.
    Greedy: the draft is accepted while it equals the argmax, then the argmax follows.
    Sampling: the rejection rule for a point-mass draft x: accept x with probability
    p(x) (p after the request's temperature and top-k/top-p/min-p filters); on
    rejection draw from p without x, renormalised; after a fully accepted draft draw
    the bonus token from the last row. Each kept token is then distributed as
    non-speculative sampling would draw it.
    """
    argmax = greedy_choice(logits).tolist() if any(s.params.greedy for s in drafted) else []
    kept: list[list[int]] = []
    row = 0
    for s in drafted:
        draft = s.token_ids[len(s.token_ids) - s.num_draft:]
        rows = s.num_draft + 1
        if s.params.greedy:
            target = argmax[row:row + rows]
            n = 0
            while n < len(draft) and draft[n] == target[n]:
                n += 1
            kept.append([*draft[:n], target[n]])
        else:
            kept.append(_rejection_sample(logits[row:row + rows], draft, s.params, s.generator))
        row += rows
    return kept


def _rejection_sample(logits: torch.Tensor, draft: list[int], params: SamplingParams,
                      generator: torch.Generator | None) -> list[int]:
    # The request's generator lives on the host (engine/request.py), so its draws are made there.
    probs = filtered_probs(logits, [params] * logits.shape[0]).cpu()
    kept: list[int] = []
    for i, x in enumerate(draft):
        if torch.rand((), generator=generator).item() < probs[i, x].item():
            kept.append(x)
            continue
        residual = probs[i].clone()
        residual[x] = 0.0
        if residual.sum() <= 0:  # p was a point mass at x (up to rounding): x is the only draw
            return [*kept, x]
        return [*kept, _draw(residual, generator)]
    return [*kept, _draw(probs[len(draft)], generator)]


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from unnormalised weights: the exponential race the sampler uses."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / noise).argmax())
