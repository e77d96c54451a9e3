"""flash-attn on CUDA: varlen prefill for causal spans, paged decode through its KV-cache entry point.

Used when the `flash_attn` package is importable and a CUDA device is present.
Spans with a custom mask policy go to the Triton prefill kernel, since
flash-attn only knows causal and full masks. flash-attn's paged KV needs a
page size that is a multiple of 256, so the engine picks this backend only
when `block_size` is one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata, PrefillSpan
from engine.attention.torch_backend import write_kv
from engine.attention.triton_kernels import PrefillLaunch, paged_prefill, prefill_launch
from engine.transfer import to_device

FLASH_PAGE_MULTIPLE = 256


def flash_available(device: torch.device, block_size: int) -> bool:
    if device.type != "cuda" or block_size % FLASH_PAGE_MULTIPLE:
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


class FlashAttentionBackend(AttentionBackend):
    name = "flash_attn"
    accepts_prewritten_kv = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = q.shape[0]
        if not self.kv_prewritten:
            write_kv(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            o = self._with_kvcache(
                q[:nd].unsqueeze(1), kv_cache[0], kv_cache[1],
                cache_seqlens=meta.decode_seq_lens.to(torch.int32),
                block_table=meta.decode_block_tables.to(torch.int32),
                softmax_scale=self.scale, causal=True,
            )
            out[:nd] = o.squeeze(1)
        if meta.prefills:
            # Worked out once per step, on the host, and kept for the other layers.
            plan = meta.backend_cache.get(self.name)
            if plan is None:
                plan = meta.backend_cache[self.name] = _plan(meta.prefills, q.device)
            if plan.rows is not None:
                o = self._varlen(q[plan.rows], k[plan.rows], v[plan.rows], plan.cu, plan.cu, plan.longest,
                                 plan.longest, softmax_scale=self.scale, causal=True)
                out[plan.rows] = o
            if plan.paged:
                paged_prefill(q, kv_cache, plan.paged, self.scale, launch=plan.launch, out=out)
        return out.view(num_tokens, self.num_heads * self.head_dim)


@dataclass
class _PrefillPlan:
    rows: torch.Tensor | None  # flat rows of the fresh causal spans, in span order
    cu: torch.Tensor | None  # their cumulative lengths (int32), as flash-attn's varlen entry takes them
    longest: int
    paged: list[PrefillSpan]
    launch: PrefillLaunch | None


def _plan(spans: list[PrefillSpan], device: torch.device) -> _PrefillPlan:
    plain = [s for s in spans if s.mask.is_causal and s.num_cached == 0]
    paged = [s for s in spans if not (s.mask.is_causal and s.num_cached == 0)]
    rows = cu = None
    if plain:
        rows = to_device([r for s in plain for r in range(s.token_start, s.token_start + s.num_tokens)], device)
        cu = to_device(list(itertools.accumulate((s.num_tokens for s in plain), initial=0)), device, torch.int32)
    return _PrefillPlan(rows, cu, max((s.num_tokens for s in plain), default=0), paged,
                        prefill_launch(paged, device) if paged else None)
