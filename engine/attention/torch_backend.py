"""Reference attention in plain torch: works on every device.

Decode attention runs as one batched SDPA over all decoding sequences, with
their K/V gathered block-wise from the paged cache and padding masked out.
Prefill runs one SDPA per chunk: straight on the chunk's own K/V when nothing
is cached before it and the mask is causal, otherwise on K/V gathered from the
cache with an explicit mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend
from engine.attention.masks import build_mask
from engine.attention.metadata import AttentionMetadata, PrefillSpan


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    accepts_prewritten_kv = True

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = q.shape[0]
        if not self.kv_prewritten:
            write_kv(kv_cache, k, v, meta.slot_mapping)
        out = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, meta)
        for span in meta.prefills:
            sl = slice(span.token_start, span.token_start + span.num_tokens)
            place_prefill(out[sl], self._prefill(q[sl], k[sl], v[sl], kv_cache, span, out=out[sl]))
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
        k, v = gather_kv(kv_cache, meta.decode_block_tables)  # [B, L, kvh, hd]
        return self._decode_sdpa(q, k, v, meta.decode_seq_lens)

    def _decode_sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """One query per sequence over its gathered K/V [B, L, kvh, hd], rows past its length masked."""
        nd, max_len = q.shape[0], k.shape[1]
        positions = torch.arange(max_len, device=q.device)
        mask = (positions.view(1, -1) < seq_lens.view(-1, 1)).view(nd, 1, 1, max_len)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return o.squeeze(2)

    def _prefill(self, q, k, v, kv_cache, span: PrefillSpan, out: torch.Tensor | None = None) -> torch.Tensor:
        """The chunk's attention [T, heads, head_dim]; a backend may write it into `out` (a view of the step's
        output) and return that, saving a copy (place_prefill)."""
        if span.num_cached == 0 and span.mask.is_causal:
            return self._prefill_sdpa(q, k, v, span)
        kc, vc = gather_kv(kv_cache, span.block_table.view(1, -1))
        return self._prefill_sdpa(q, kc[0, :span.kv_len], vc[0, :span.kv_len], span)

    def _prefill_sdpa(self, q, k, v, span: PrefillSpan) -> torch.Tensor:
        """Attention of a chunk's queries over its sequence's rows [0, kv_len) (k, v as [rows, kvh, hd])."""
        gqa = self.num_heads != self.num_kv_heads
        if span.num_cached == 0 and span.mask.is_causal:
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                is_causal=True, scale=self.scale, enable_gqa=gqa,
            )
            return o.transpose(0, 1)
        rows = torch.arange(span.num_cached, span.kv_len, device=q.device)
        mask = build_mask(span.mask, rows, span.kv_len)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=self.scale, enable_gqa=gqa,
        )
        return o.transpose(0, 1)


def place_prefill(dst: torch.Tensor, result: torch.Tensor) -> None:
    """Put a chunk's attention into its rows of the step's output, unless the backend already wrote it there."""
    if result.data_ptr() != dst.data_ptr():
        dst.copy_(result)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V rows into their slots."""
    _, num_blocks, block_size, kvh, hd = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, kvh, hd)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def gather_kv(kv_cache: torch.Tensor, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the given block tables, as [B, num_blocks * block_size, kvh, hd]."""
    _, _, block_size, kvh, hd = kv_cache.shape
    b, nb = block_tables.shape
    idx = block_tables.reshape(-1)
    k = kv_cache[0].index_select(0, idx).view(b, nb * block_size, kvh, hd)
    v = kv_cache[1].index_select(0, idx).view(b, nb * block_size, kvh, hd)
    return k, v
