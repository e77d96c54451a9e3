"""Attention over the int8 KV cache (engine.attention.kv_int8): a torch reference that runs on any
device, and the CPU variant whose decode, and causal prefill without a window, run C++ kernels.

Writes quantize each new row (and copy the last W rows of each sequence into its ring). Reads
dequantize what the pool stores. Without a window, prefill is SDPA over the dequantized rows;
with one, a query's last W rows come from full precision, which SDPA cannot mix per query, so
prefill computes scores explicitly: scores on the int8 rows plus, inside the band of recent
rows, the difference that full precision makes, in chunks of queries to bound memory.
"""

from __future__ import annotations

import torch

from engine.attention.kv_int8 import (
    Int8KVCache,
    KVWindowMetadata,
    gather_dequantized,
    read_ring,
    write_int8,
    write_ring,
)
from engine.attention.masks import build_mask
from engine.attention.metadata import AttentionMetadata, PrefillSpan
from engine.attention.torch_backend import TorchAttentionBackend, place_prefill

_QUERY_CHUNK = 256


class TorchInt8AttentionBackend(TorchAttentionBackend):
    name = "torch_int8"
    accepts_prewritten_kv = False

    def forward(self, q, k, v, kv_cache: Int8KVCache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = q.shape[0]
        win: KVWindowMetadata | None = meta.kv_window
        write_int8(kv_cache, k, v, meta.slot_mapping)
        recent: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(meta.prefills)
        if win is not None:
            # A chunk's own ring writes may overwrite rows its first queries still read: take them first.
            for i, span in enumerate(meta.prefills):
                recent[i] = read_ring(kv_cache, win.span_slots[i], range(win.fp_start(i, span.num_cached),
                                                                         span.num_cached))
            write_ring(kv_cache, k, v, win)
        out = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, meta)
        for i, span in enumerate(meta.prefills):
            sl = slice(span.token_start, span.token_start + span.num_tokens)
            place_prefill(out[sl], self._prefill_int8(q[sl], k[sl], v[sl], kv_cache, span, win, i, recent[i],
                                                      out=out[sl]))
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def _decode(self, q: torch.Tensor, kv_cache: Int8KVCache, meta: AttentionMetadata) -> torch.Tensor:
        k, v = gather_dequantized(kv_cache, meta.decode_block_tables, q.dtype)
        if meta.kv_window is not None:
            _overlay_ring(k, v, kv_cache, meta.kv_window, meta.decode_seq_lens)
        return self._decode_sdpa(q, k, v, meta.decode_seq_lens)

    def _prefill_int8(self, q, k, v, kv_cache: Int8KVCache, span: PrefillSpan, win: KVWindowMetadata | None,
                      index: int, recent, out: torch.Tensor | None = None) -> torch.Tensor:
        kv_len = span.kv_len
        kq, vq = gather_dequantized(kv_cache, span.block_table.view(1, -1), q.dtype)
        kq, vq = kq[0, :kv_len], vq[0, :kv_len]
        if win is None:
            return self._prefill_sdpa(q, kq, vq, span)
        lo = win.fp_start(index, span.num_cached)
        dk = torch.cat((recent[0], k)) - kq[lo:]
        dv = torch.cat((recent[1], v)) - vq[lo:]
        return self._band_attention(q, kq, vq, dk, dv, lo, span, win.size)

    def _band_attention(self, q, kq, vq, dk, dv, lo: int, span: PrefillSpan, window: int) -> torch.Tensor:
        """Attention where key row j counts at full precision for query row i when j >= i + 1 - window.

        kq, vq: all rows, int8 values; dk, dv: full precision minus int8 for rows [lo, kv_len).
        """
        g = self.num_heads // self.num_kv_heads
        kv_len = span.kv_len
        kq, vq, dk, dv = (t.repeat_interleave(g, dim=1).transpose(0, 1) for t in (kq, vq, dk, dv))  # [H, rows, D]
        rows = torch.arange(span.num_cached, kv_len, device=q.device)
        fp_rows = torch.arange(lo, kv_len, device=q.device)
        qh = q.transpose(0, 1)
        out = []
        for c in range(0, qh.shape[1], _QUERY_CHUNK):
            qc, rc = qh[:, c:c + _QUERY_CHUNK], rows[c:c + _QUERY_CHUNK]
            band = (fp_rows.view(1, -1) >= rc.view(-1, 1) + 1 - window).to(q.dtype)  # [chunk, rows >= lo]
            scores = (qc @ kq.transpose(1, 2)) * self.scale
            scores[:, :, lo:] += band * (qc @ dk.transpose(1, 2)) * self.scale
            scores.masked_fill_(~build_mask(span.mask, rc, kv_len), float("-inf"))
            p = torch.softmax(scores, dim=-1)
            out.append(p @ vq + (p[:, :, lo:] * band) @ dv)
        return torch.cat(out, dim=1).transpose(0, 1)


def _overlay_ring(k: torch.Tensor, v: torch.Tensor, cache: Int8KVCache, win: KVWindowMetadata,
                  seq_lens: torch.Tensor) -> None:
    """Replace each decode sequence's rows [lo, len) of the gathered K/V [B, L, kvh, hd] with its ring's."""
    w = win.size
    rows = seq_lens.view(-1, 1) - 1 - torch.arange(w, device=k.device).view(1, -1)  # [B, W], last rows first
    valid = (rows >= win.decode_lo.view(-1, 1)) & (rows >= 0)
    b, j = valid.nonzero(as_tuple=True)
    r = rows[b, j]
    ring = cache.window.view(2, -1, *cache.window.shape[3:])
    idx = win.decode_slots[b] * w + r % w
    k[b, r] = ring[0, idx].to(k.dtype)
    v[b, r] = ring[1, idx].to(v.dtype)


class CpuPagedInt8AttentionBackend(TorchInt8AttentionBackend):
    name = "cpu_paged_int8"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        from engine.kernels.cpu_build import load_kernels

        self._ops = load_kernels()

    def _prefill_int8(self, q, k, v, kv_cache: Int8KVCache, span: PrefillSpan, win: KVWindowMetadata | None,
                      index: int, recent, out: torch.Tensor | None = None) -> torch.Tensor:
        """Causal chunks without a full-precision window run the C++ kernel on the int8 rows in place."""
        from engine.attention.cpu_paged import kernel_output, prefill_kernel_applies

        if win is None and prefill_kernel_applies(q, span, self.head_dim):
            out = kernel_output(q, out)
            self._ops.paged_prefill_attention_int8(out, q, kv_cache.values, kv_cache.scales, span.block_table,
                                                   span.num_cached, self.scale)
            return out
        return super()._prefill_int8(q, k, v, kv_cache, span, win, index, recent)

    def _decode(self, q: torch.Tensor, kv_cache: Int8KVCache, meta: AttentionMetadata) -> torch.Tensor:
        win = meta.kv_window
        if q.dtype != torch.float32 or (win is not None and kv_cache.window.dtype != torch.float32):
            return super()._decode(q, kv_cache, meta)
        return self._ops.paged_decode_attention_int8(
            q, kv_cache.values, kv_cache.scales, meta.decode_block_tables, meta.decode_seq_lens, self.scale,
            kv_cache.window if win is not None else None,
            win.decode_slots if win is not None else None,
            win.decode_lo if win is not None else None)
