"""flash-attn on CUDA: varlen prefill for causal spans, paged decode through its KV-cache entry point.

Used when the `flash_attn` package is importable and a CUDA device is present.
Spans with a custom mask policy go to the Triton prefill kernel, since
flash-attn only knows causal and full masks. flash-attn's paged KV needs a
page size that is a multiple of 256, so the engine picks this backend only
when `block_size` is one.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import write_kv
from engine.attention.triton_kernels import paged_prefill

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

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = q.shape[0]
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
        plain = [s for s in meta.prefills if s.mask.is_causal and s.num_cached == 0]
        other = [s for s in meta.prefills if not (s.mask.is_causal and s.num_cached == 0)]
        if plain:
            starts = [0]
            for s in plain:
                starts.append(starts[-1] + s.num_tokens)
            idx = torch.cat([torch.arange(s.token_start, s.token_start + s.num_tokens, device=q.device) for s in plain])
            cu = torch.tensor(starts, dtype=torch.int32, device=q.device)
            longest = max(s.num_tokens for s in plain)
            o = self._varlen(q[idx], k[idx], v[idx], cu, cu, longest, longest, softmax_scale=self.scale, causal=True)
            out[idx] = o
        if other:
            o = paged_prefill(q, kv_cache, other, self.scale)
            for s in other:
                sl = slice(s.token_start, s.token_start + s.num_tokens)
                out[sl] = o[sl]
        return out.view(num_tokens, self.num_heads * self.head_dim)
