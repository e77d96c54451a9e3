"""Token selection for one step: greedy, temperature, top-k, top-p, min-p, seeds.

Greedy rows are one batched argmax. Random rows are filtered as a batch; the
draw itself uses each request's own generator when it has a seed, so a seeded
request gives the same tokens whatever shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: (logprob of the chosen token, [(token, logprob), ...] top entries) when asked for.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> SampleResult:
    """logits: [rows, vocab] float32 (modified in place)."""
    rows = logits.shape[0]
    want_logprobs = [p.logprobs is not None for p in params]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

    chosen = torch.empty(rows, dtype=torch.long)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    rand = [i for i, p in enumerate(params) if not p.greedy]
    # max(dim).indices: the first maximal index, as argmax gives, at a third of argmax's CPU time.
    if len(greedy) == rows:
        chosen = logits.max(dim=-1).indices
    elif greedy:
        idx = torch.tensor(greedy)
        chosen[idx] = logits[idx].max(dim=-1).indices
    if rand:
        idx = torch.tensor(rand)
        probs = _filtered_probs(logits[idx], [params[i] for i in rand])
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, one draw per row.
        noise = torch.empty_like(probs)
        for row, i in enumerate(rand):
            noise[row].exponential_(generator=generators[i])
        chosen[idx] = (probs / noise).argmax(dim=-1)

    token_ids = chosen.tolist()
    logprobs: list = [None] * rows
    if raw_logprobs is not None:
        for i, want in enumerate(want_logprobs):
            if not want:
                continue
            k = params[i].logprobs or 0
            top = torch.topk(raw_logprobs[i], k) if k else None
            entries = list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top is not None else []
            logprobs[i] = (raw_logprobs[i, token_ids[i]].item(), entries)
    return SampleResult(token_ids, logprobs)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
    logits = logits / temps
    top_ks = [p.top_k if p.top_k > 0 else 0 for p in params]
    top_ps = [p.top_p for p in params]
    if any(top_ks) or any(tp < 1.0 for tp in top_ps):
        logits = _top_k_top_p(logits, top_ks, top_ps)
    probs = torch.softmax(logits, dim=-1)
    min_ps = torch.tensor([p.min_p for p in params], dtype=probs.dtype).unsqueeze(1)
    if bool((min_ps > 0).any()):
        threshold = probs.max(dim=-1, keepdim=True).values * min_ps
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_ks]).unsqueeze(1)
    drop = ranks >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the token that crosses it stays).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= torch.tensor(top_ps, dtype=probs.dtype).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
