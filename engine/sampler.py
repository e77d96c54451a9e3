"""Token selection for one step: greedy, temperature, top-k, top-p, min-p, seeds.

Greedy rows are one batched argmax. Random rows are filtered as a batch; the
draw itself uses each request's own generator when it has a seed, so a seeded
request gives the same tokens whatever shares its batch.

Everything runs on the device that holds the logits. On a GPU only the chosen
token ids (and the asked-for logprobs) come back to the host, not the
[rows, vocab] logits, and `sample_on_device` leaves even that copy to the
caller, so the next step can be queued before this one's tokens are read.
A seeded request's noise is drawn on the host from its own CPU generator and
sent along, so its draws do not depend on the device's random state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels.cpu_build import cpu_kernels, fused_cpu_ok
from engine.sampling_params import SamplingParams
from engine.transfer import to_device


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: (logprob of the chosen token, [(token, logprob), ...] top entries) when asked for.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


@dataclass
class DeviceSample:
    """A step's choices, still on the logits' device."""

    token_ids: torch.Tensor  # [rows] int64
    top_k: list[int]  # per row: how many top logprobs were asked for; -1 where none were
    chosen_logprobs: torch.Tensor | None = None  # [rows] float32, when any row asked
    top_ids: torch.Tensor | None = None  # [rows, max k] int64
    top_values: torch.Tensor | None = None  # [rows, max k] float32

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.token_ids, self.chosen_logprobs, self.top_ids, self.top_values) if t is not None]

    def to_host(self, host: list[torch.Tensor] | None = None) -> SampleResult:
        """The result as Python lists; `host` are copies of tensors() already on the CPU."""
        host = host if host is not None else [t.cpu() for t in self.tensors()]
        token_ids = host[0].tolist()
        logprobs: list = [None] * len(token_ids)
        if self.chosen_logprobs is not None:
            chosen, top_ids, top_values = host[1].tolist(), host[2].tolist(), host[3].tolist()
            for i, k in enumerate(self.top_k):
                if k >= 0:
                    logprobs[i] = (chosen[i], list(zip(top_ids[i][:k], top_values[i][:k], strict=True)))
        return SampleResult(token_ids, logprobs)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> SampleResult:
    """logits: [rows, vocab] float32 (modified in place)."""
    return sample_on_device(logits, params, generators).to_host()


def sample_on_device(logits: torch.Tensor, params: list[SamplingParams],
                     generators: list[torch.Generator | None]) -> DeviceSample:
    """Choose one token per row without reading anything back from the device."""
    rows = logits.shape[0]
    device = logits.device
    top_k = [(p.logprobs or 0) if p.logprobs is not None else -1 for p in params]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(k >= 0 for k in top_k) else None

    greedy = [i for i, p in enumerate(params) if p.greedy]
    rand = [i for i, p in enumerate(params) if not p.greedy]
    if len(greedy) == rows:
        chosen = greedy_choice(logits)
    else:
        chosen = torch.empty(rows, dtype=torch.long, device=device)
        if greedy:
            idx = to_device(greedy, device)
            chosen[idx] = greedy_choice(logits[idx])
        idx = to_device(rand, device)
        probs = filtered_probs(logits[idx], [params[i] for i in rand])
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, one draw per row.
        chosen[idx] = (probs / _exponential_noise(probs, [generators[i] for i in rand])).argmax(dim=-1)

    result = DeviceSample(chosen, top_k)
    if raw_logprobs is not None:
        result.chosen_logprobs = raw_logprobs.gather(1, chosen.view(-1, 1)).view(-1)
        top = torch.topk(raw_logprobs, max(max(top_k), 1), dim=-1)
        result.top_ids, result.top_values = top.indices, top.values
    return result


def greedy_choice(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's maximum: the compiled kernel for fp32 CPU logits (a quarter of torch's
    time for one row of a 49k vocabulary), else max(dim).indices, which gives the same index as argmax at a
    third of argmax's CPU time."""
    if logits.dim() == 2 and logits.stride(-1) == 1 and logits.shape[-1] > 0 and fused_cpu_ok(logits):
        return cpu_kernels().argmax_rows(logits)
    return logits.max(dim=-1).indices


def _exponential_noise(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Exp(1) noise shaped like probs: seeded rows from their own (CPU) generators, the rest on the device."""
    noise = torch.empty_like(probs)
    seeded = [row for row, g in enumerate(generators) if g is not None]
    if len(seeded) < len(generators):
        noise.exponential_()
    if seeded:
        host = noise if noise.device.type == "cpu" else torch.empty(len(seeded), probs.shape[1], dtype=probs.dtype)
        for j, row in enumerate(seeded):
            (host[row] if host is noise else host[j]).exponential_(generator=generators[row])
        if host is not noise:
            noise[to_device(seeded, noise.device)] = to_device(host, noise.device)
    return noise


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    device = logits.device
    temps = to_device([p.temperature for p in params], device, logits.dtype).unsqueeze(1)
    logits = logits / temps
    top_ks = [p.top_k if p.top_k > 0 else 0 for p in params]
    top_ps = [p.top_p for p in params]
    if any(top_ks) or any(tp < 1.0 for tp in top_ps):
        logits = _top_k_top_p(logits, top_ks, top_ps)
    probs = torch.softmax(logits, dim=-1)
    min_p = [p.min_p for p in params]
    if any(m > 0 for m in min_p):
        min_ps = to_device(min_p, device, probs.dtype).unsqueeze(1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_ps
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    k = to_device([kk if kk > 0 else vocab for kk in top_ks], device).unsqueeze(1)
    drop = ranks >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the token that crosses it stays). The most likely
    # token always stays: a top_p that rounds to 0 in float32 would otherwise drop every token.
    mass_before = probs.cumsum(dim=-1) - probs
    drop[:, 1:] |= mass_before[:, 1:] >= to_device(top_ps, device, probs.dtype).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
