"""GPU attention with our Triton kernels: paged decode and mask-aware paged prefill.

A prefill chunk that starts a causal sequence (nothing cached before it) needs
no paging: its keys are its own rows, so it runs through torch's fused SDPA
(FlashAttention on recent GPUs), faster than a general paged kernel. Every
other chunk (a cached prefix, a later chunk, a custom mask policy) runs the
paged prefill kernel, which reads its keys from the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import write_kv
from engine.attention.triton_kernels import paged_decode, paged_prefill


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = q.shape[0]
        write_kv(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        paged = [s for s in meta.prefills if not (s.mask.is_causal and s.num_cached == 0)]
        if paged:
            o = paged_prefill(q, kv_cache, paged, self.scale)
            for s in paged:
                sl = slice(s.token_start, s.token_start + s.num_tokens)
                out[sl] = o[sl]
        for s in meta.prefills:
            if s.mask.is_causal and s.num_cached == 0:
                sl = slice(s.token_start, s.token_start + s.num_tokens)
                # [1, heads, rows, dim]: torch's fused kernels take 4-D inputs only.
                q4, k4, v4 = (x[sl].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
                out[sl] = F.scaled_dot_product_attention(
                    q4, k4, v4, is_causal=True, scale=self.scale,
                    enable_gqa=self.num_heads != self.num_kv_heads)[0].transpose(0, 1)
        nd = meta.num_decodes
        if nd:
            out[:nd] = paged_decode(q[:nd], kv_cache, meta.decode_block_tables, meta.decode_seq_lens, self.scale)
        return out.view(num_tokens, self.num_heads * self.head_dim)
