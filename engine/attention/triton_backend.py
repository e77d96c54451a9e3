"""GPU attention with our Triton kernels: paged decode and mask-aware paged prefill.

A long prefill chunk that starts a causal sequence (nothing cached before it)
needs no paging: its keys are its own rows, so it runs through torch's fused
SDPA (FlashAttention on recent GPUs). Every other chunk (a cached prefix, a
later chunk, a custom mask policy, or a short fresh prompt) goes to the paged
prefill kernel, all of them in one launch; many short prompts would otherwise
cost one SDPA launch each, in every layer. What the split needs is worked out
once per step and kept in the metadata for the other layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata, PrefillSpan
from engine.attention.torch_backend import write_kv
from engine.attention.triton_kernels import PrefillLaunch, paged_decode, paged_prefill, prefill_launch

# Fresh causal chunks of at least this many rows take torch's SDPA; shorter ones join the paged launch.
SDPA_MIN_ROWS = 256


@dataclass
class _PrefillPlan:
    sdpa: list[PrefillSpan]
    paged: list[PrefillSpan]
    launch: PrefillLaunch | None


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    accepts_prewritten_kv = True

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = q.shape[0]
        if not self.kv_prewritten:
            write_kv(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.prefills:
            plan = meta.backend_cache.get(self.name)
            if plan is None:
                plan = meta.backend_cache[self.name] = _plan(meta.prefills, q.device)
            if plan.paged:
                paged_prefill(q, kv_cache, plan.paged, self.scale, launch=plan.launch, out=out)
            for s in plan.sdpa:
                sl = slice(s.token_start, s.token_start + s.num_tokens)
                # [1, heads, rows, dim]: torch's fused kernels take 4-D inputs only.
                q4, k4, v4 = (x[sl].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
                out[sl] = F.scaled_dot_product_attention(
                    q4, k4, v4, is_causal=True, scale=self.scale,
                    enable_gqa=self.num_heads != self.num_kv_heads)[0].transpose(0, 1)
        nd = meta.num_decodes
        if nd:
            paged_decode(q[:nd], kv_cache, meta.decode_block_tables, meta.decode_seq_lens, self.scale, out=out[:nd])
        return out.view(num_tokens, self.num_heads * self.head_dim)


def _plan(spans: list[PrefillSpan], device: torch.device) -> _PrefillPlan:
    sdpa = [s for s in spans if s.mask.is_causal and s.num_cached == 0 and s.num_tokens >= SDPA_MIN_ROWS]
    paged = [s for s in spans if s not in sdpa]
    return _PrefillPlan(sdpa, paged, prefill_launch(paged, device) if paged else None)
