"""Triton kernels for paged attention on the GPU (and on the CPU under TRITON_INTERPRET=1 in tests).

- `paged_decode`: one program per (sequence, KV head); the G query heads of the
  group share each K/V block they read; online softmax over the blocks of the
  sequence's block table.
- `paged_prefill`: one program per (span, query tile, head); keys come from the
  paged cache (the span's new K/V is written there first), and the mask policy
  of the span (causal, chunk_bidirectional, prefix_bidirectional,
  packed_segments) is evaluated in the kernel from small per-span parameters,
  matching `engine.attention.masks.build_mask`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

POLICY_IDS = {"causal": 0, "chunk_bidirectional": 1, "prefix_bidirectional": 2, "packed_segments": 3}


@triton.jit
def _decode_kernel(q_ptr, kv_ptr, bt_ptr, lens_ptr, out_ptr, scale,
                   s_qb, s_qh, s_kv, s_blk, s_tok, s_head, s_bt, s_ob, s_oh,
                   G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                   BS: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_t = tl.arange(0, BS)
    gmask = offs_g < G
    dmask = offs_d < D
    heads = kh * G + offs_g
    q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + offs_d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(kv_ptr.dtype.element_ty)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for j in range(0, tl.cdiv(seq_len, BS)):
        block = tl.load(bt_ptr + b * s_bt + j)
        tok = j * BS + offs_t
        tmask = tok < seq_len
        base = kv_ptr + block * s_blk + offs_t[:, None] * s_tok + kh * s_head + offs_d[None, :]
        k = tl.load(base, mask=tmask[:, None] & dmask[None, :], other=0.0)
        v = tl.load(base + s_kv, mask=tmask[:, None] & dmask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / denom[:, None]
    tl.store(out_ptr + b * s_ob + heads[:, None] * s_oh + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=gmask[:, None] & dmask[None, :])


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """q: [B, H, D]; kv_cache: [2, num_blocks, BS, KVH, D]; block_tables: [B, max_blocks]; returns [B, H, D]."""
    b, h, d = q.shape
    _, _, bs, kvh, _ = kv_cache.shape
    g = h // kvh
    out = torch.empty_like(q)
    _decode_kernel[(b, kvh)](
        q, kv_cache, block_tables, seq_lens, out, scale,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d, D_PAD=max(16, triton.next_power_of_2(d)), BS=bs,
        PRECISION=_precision(kv_cache),
    )
    return out


@triton.jit
def _allowed(qr, kr, policy, start, end, seg_ptr, nseg, NSEG_PAD: tl.constexpr):
    """The mask of engine.attention.masks.build_mask, for query rows qr [M] and key rows kr [N]."""
    q = qr[:, None]
    k = kr[None, :]
    causal = k <= q
    in_q = (q >= start) & (q < end)
    in_k = (k >= start) & (k < end)
    chunk = causal | (in_q & in_k)
    prefix = causal | ((q < end) & (k < end))
    offs = tl.arange(0, NSEG_PAD)
    starts = tl.load(seg_ptr + offs, mask=offs < nseg, other=2147483647)
    q_seg = tl.sum((starts[None, :] <= qr[:, None]).to(tl.int32), axis=1) - 1
    k_seg = tl.sum((starts[None, :] <= kr[:, None]).to(tl.int32), axis=1) - 1
    packed = causal & ((k < start) | ((q_seg[:, None] == k_seg[None, :]) & (q >= start)))
    return tl.where(policy == 0, causal, tl.where(policy == 1, chunk, tl.where(policy == 2, prefix, packed)))


@triton.jit
def _prefill_kernel(q_ptr, kv_ptr, out_ptr, meta_ptr, bt_ptr, seg_ptr, scale,
                    s_qt, s_qh, s_kv, s_blk, s_tok, s_head, s_ot, s_oh, s_bt, s_seg,
                    G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
                    BLOCK_M: tl.constexpr, NSEG_PAD: tl.constexpr, PRECISION: tl.constexpr):
    span = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    kh = h // G
    # meta row: token_start, num_tokens, num_cached, policy, start, end, num_segments
    token_start = tl.load(meta_ptr + span * 7 + 0)
    num_tokens = tl.load(meta_ptr + span * 7 + 1)
    num_cached = tl.load(meta_ptr + span * 7 + 2)
    policy = tl.load(meta_ptr + span * 7 + 3)
    start = tl.load(meta_ptr + span * 7 + 4)
    end = tl.load(meta_ptr + span * 7 + 5)
    nseg = tl.load(meta_ptr + span * 7 + 6)
    if tile * BLOCK_M >= num_tokens:
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_t = tl.arange(0, BS)
    mmask = offs_m < num_tokens
    dmask = offs_d < D
    q = tl.load(q_ptr + (token_start + offs_m)[:, None] * s_qt + h * s_qh + offs_d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0).to(kv_ptr.dtype.element_ty)
    rows = num_cached + offs_m  # query rows within the sequence
    kv_len = num_cached + num_tokens
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for j in range(0, tl.cdiv(kv_len, BS)):
        block = tl.load(bt_ptr + span * s_bt + j)
        kr = j * BS + offs_t
        kmask = kr < kv_len
        base = kv_ptr + block * s_blk + offs_t[:, None] * s_tok + kh * s_head + offs_d[None, :]
        k = tl.load(base, mask=kmask[:, None] & dmask[None, :], other=0.0)
        v = tl.load(base + s_kv, mask=kmask[:, None] & dmask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        ok = _allowed(rows, kr, policy, start, end, seg_ptr + span * s_seg, nseg, NSEG_PAD)
        ok = ok & kmask[None, :] & mmask[:, None]
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / tl.where(denom == 0, 1.0, denom)[:, None]
    tl.store(out_ptr + (token_start + offs_m)[:, None] * s_ot + h * s_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, spans, scale: float, block_m: int = 16) -> torch.Tensor:
    """Attention for every prefill span; q: [T, H, D] (rows of the spans), K/V already in the cache.

    Returns [T, H, D]; rows outside the spans are left unset.
    """
    _, h, d = q.shape
    _, _, bs, kvh, _ = kv_cache.shape
    device = q.device
    out = torch.empty_like(q)
    if not spans:
        return out
    max_blocks = max(len(s.block_table) for s in spans)
    max_segs = max(max(len(s.mask.segment_starts), 1) for s in spans)
    meta = torch.zeros(len(spans), 7, dtype=torch.int32)
    tables = torch.zeros(len(spans), max_blocks, dtype=torch.int32)
    segs = torch.zeros(len(spans), max_segs, dtype=torch.int32)
    for i, s in enumerate(spans):
        seg_starts = s.mask.segment_starts or (s.mask.start,)
        meta[i] = torch.tensor([s.token_start, s.num_tokens, s.num_cached, POLICY_IDS[s.mask.policy],
                                s.mask.start, s.mask.end, len(seg_starts)], dtype=torch.int32)
        tables[i, :len(s.block_table)] = s.block_table.to(torch.int32).cpu()
        segs[i, :len(seg_starts)] = torch.tensor(seg_starts, dtype=torch.int32)
    meta, tables, segs = meta.to(device), tables.to(device), segs.to(device)
    tiles = max(triton.cdiv(s.num_tokens, block_m) for s in spans)
    _prefill_kernel[(len(spans), tiles, h)](
        q, kv_cache, out, meta, tables, segs, scale,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        out.stride(0), out.stride(1), tables.stride(0), segs.stride(0),
        G=h // kvh, D=d, D_PAD=max(16, triton.next_power_of_2(d)), BS=bs, BLOCK_M=block_m,
        NSEG_PAD=max(16, triton.next_power_of_2(max_segs)), PRECISION=_precision(kv_cache),
    )
    return out


def _precision(kv_cache: torch.Tensor) -> str:
    # fp32 caches are the reference path: exact products, not TF32.
    return "ieee" if kv_cache.dtype == torch.float32 else "tf32"
