"""GPU attention over the 8-bit KV caches (cache_bits: 8, int8 or fp8) with the Triton kernels of
engine.attention.triton_kvq, which read the codes in place.

Order within a step: the pool write (unless the fused RoPE + K/V kernel already wrote the codes), then
the prefill spans, which read the ring as it was before this step, then the ring write, then the
decodes, which read their own new row from the ring. Every prefill span goes to the paged kernel,
fresh causal ones too: with W = 0 a chunk attends to its own stored codes (engine.attention.kv_int8's
semantics), which SDPA over the step's full-precision K/V would not do.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.kv_int8 import Int8KVCache, write_int8, write_ring
from engine.attention.metadata import AttentionMetadata
from engine.attention.triton_kvq import paged_decode_quant, paged_prefill_quant, quant_prefill_launch


class TritonQuantAttentionBackend(AttentionBackend):
    name = "triton_kvq"
    # engine.models.fused_ops.rope_write_kv quantizes into an Int8KVCache; the ring stays ours.
    accepts_prewritten_kv = True

    def forward(self, q, k, v, kv_cache: Int8KVCache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = q.shape[0]
        win = meta.kv_window
        if not self.kv_prewritten:
            write_int8(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.prefills:
            launch = meta.backend_cache.get(self.name)
            if launch is None:
                launch = meta.backend_cache[self.name] = quant_prefill_launch(meta.prefills, q.device, win)
            paged_prefill_quant(q, kv_cache, meta.prefills, self.scale, k, v, win, launch=launch, out=out)
        if win is not None:
            write_ring(kv_cache, k, v, win)
        nd = meta.num_decodes
        if nd:
            paged_decode_quant(q[:nd], kv_cache, meta.decode_block_tables, meta.decode_seq_lens, self.scale, win,
                               out=out[:nd])
        return out.view(num_tokens, self.num_heads * self.head_dim)
