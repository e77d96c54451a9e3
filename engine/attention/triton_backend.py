"""GPU attention with our Triton kernels: paged decode and mask-aware paged prefill."""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import write_kv
from engine.attention.triton_kernels import paged_decode, paged_prefill


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = q.shape[0]
        write_kv(kv_cache, k, v, meta.slot_mapping)
        if meta.prefills:
            out = paged_prefill(q, kv_cache, meta.prefills, self.scale)
        else:
            out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = paged_decode(q[:nd], kv_cache, meta.decode_block_tables, meta.decode_seq_lens, self.scale)
        return out.view(num_tokens, self.num_heads * self.head_dim)
