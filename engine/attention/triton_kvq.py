"""Triton paged attention over the 8-bit KV caches (engine.attention.kv_int8), read in place.

The kernels load int8 or fp8 codes straight from the paged pool and dequantize them in registers: the
codes convert exactly to the query's dtype for the products, and the scales (int8: the row's fp16 scale,
per token and KV head; fp8: the layer's per-head scale) multiply the score and probability columns, which
costs a vector per tile instead of an fp32 copy of the K and V tiles. No gather and no full-precision copy
of the cache.
The structure follows engine.attention.triton_kernels (one program per sequence, KV head and split
in decode, with the same flash-decoding merge; one per span, query tile and head in prefill, with the
same mask policies).

The full-precision window (kv_fp_window W > 0) is read in the kernels too: key row j counts at full
precision for query row i when j >= i + 1 - W and the sequence computed j itself (j >= its ring
start). Decode takes those rows from the ring; prefill takes the chunk's own rows from the step's
k/v and older ones from the ring, so it must run before the step's ring write (the backend's order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.attention.kv_int8 import Int8KVCache, KVWindowMetadata
from engine.attention.triton_kernels import (
    PrefillLaunch,
    _allowed,
    _decode_program,
    _launch_options,
    _masked_softmax_step,
    _precision,
    _prefill_span,
    _softmax_step,
    _store_decode,
    decode_launch,
    prefill_launch,
)
from engine.transfer import to_device


@triton.jit
def _head_scales(sc_ptr, s_sckv, kh, PER_ROW: tl.constexpr):
    """fp8's static scales of K and V for KV head kh; 1.0 for int8, whose scales come with each row."""
    k_scale = 1.0
    v_scale = 1.0
    if not PER_ROW:
        k_scale = tl.load(sc_ptr + kh)
        v_scale = tl.load(sc_ptr + s_sckv + kh)
    return k_scale, v_scale


@triton.jit
def _load_codes(val_ptr, sc_ptr, block, offs_t, offs_d, tmask, dmask, kh, k_scale, v_scale,
                s_kv, s_blk, s_tok, s_head, s_sckv, s_scblk, s_sctok, cdt: tl.constexpr,
                BS: tl.constexpr, PAGES: tl.constexpr, PER_ROW: tl.constexpr):
    """A tile of K and V codes from the paged pool and their scales, for the tokens in tmask.

    Codes convert exactly to the query's dtype; each key's scale multiplies its score column, each
    value's scale its probability column: q.(c s) = (q.c) s, so no fp32 tile of K or V is formed."""
    row = block * s_blk + (offs_t % BS) * s_tok + kh * s_head
    lmask = tmask[:, None] & dmask[None, :]
    k = tl.load(val_ptr + row[:, None] + offs_d[None, :], mask=lmask, other=0.0).to(cdt)
    v = tl.load(val_ptr + s_kv + row[:, None] + offs_d[None, :], mask=lmask, other=0.0).to(cdt)
    if PER_ROW:
        srow = block * s_scblk + (offs_t % BS) * s_sctok + kh
        ks = tl.load(sc_ptr + srow, mask=tmask, other=1.0).to(tl.float32)
        vs = tl.load(sc_ptr + s_sckv + srow, mask=tmask, other=1.0).to(tl.float32)
    else:
        ks = tl.full([PAGES * BS], 1.0, tl.float32) * k_scale
        vs = tl.full([PAGES * BS], 1.0, tl.float32) * v_scale
    return k, v, ks, vs


@triton.jit
def _qdecode_kernel(q_ptr, val_ptr, sc_ptr, bt_ptr, lens_ptr, out_ptr, part_ptr, ml_ptr, ring_ptr, wslot_ptr,
                    wlo_ptr, scale, blocks_per_split,
                    s_qb, s_qh, s_kv, s_blk, s_tok, s_head, s_sckv, s_scblk, s_sctok, s_bt, s_ob, s_oh,
                    s_rkv, s_rslot, s_rrow, s_rhead,
                    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                    BS: tl.constexpr, PAGES: tl.constexpr, SPLIT: tl.constexpr, PER_ROW: tl.constexpr,
                    W: tl.constexpr, PRECISION: tl.constexpr):
    """One (sequence, KV head, split), as triton_kernels._decode_kernel, over 8-bit codes (+ the ring)."""
    b, kh, split, nsplit, seq_len, first, last, offs_d, offs_t, gmask, dmask, heads, m, denom, acc = \
        _decode_program(lens_ptr, blocks_per_split, G, G_PAD, D, D_PAD, BS, PAGES)
    cdt = q_ptr.dtype.element_ty
    q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + offs_d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    k_scale, v_scale = _head_scales(sc_ptr, s_sckv, kh, PER_ROW)
    slot = 0
    lo = seq_len
    if W > 0:
        slot = tl.load(wslot_ptr + b)
        lo = tl.load(wlo_ptr + b)
    for j in range(first, last, PAGES):
        page = j + offs_t // BS
        tok = j * BS + offs_t
        tmask = tok < seq_len
        ring = tmask & (tok >= lo)  # rows read at full precision instead
        pool = tmask & (tok < lo)
        block = tl.load(bt_ptr + b * s_bt + page, mask=page < last, other=0)
        k, v, ks, vs = _load_codes(val_ptr, sc_ptr, block, offs_t, offs_d, pool, dmask, kh, k_scale, v_scale,
                                   s_kv, s_blk, s_tok, s_head, s_sckv, s_scblk, s_sctok, cdt, BS, PAGES, PER_ROW)
        if W > 0:
            rrow = slot * s_rslot + (tok % W) * s_rrow + kh * s_rhead
            rmask = ring[:, None] & dmask[None, :]
            k = tl.where(ring[:, None], tl.load(ring_ptr + rrow[:, None] + offs_d[None, :], mask=rmask, other=0.0)
                         .to(cdt), k)
            v = tl.where(ring[:, None], tl.load(ring_ptr + s_rkv + rrow[:, None] + offs_d[None, :], mask=rmask,
                                                other=0.0).to(cdt), v)
            ks = tl.where(ring, 1.0, ks)
            vs = tl.where(ring, 1.0, vs)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * (ks * scale)[None, :]
        p, alpha, m, denom = _softmax_step(tl.where(tmask[None, :], s, float("-inf")), m, denom)
        acc = acc * alpha[:, None] + tl.dot((p * vs[None, :]).to(cdt), v, input_precision=PRECISION)
    _store_decode(acc, m, denom, part_ptr, ml_ptr, out_ptr, b, heads, split, nsplit, offs_d, gmask, dmask,
                  s_ob, s_oh, G, D_PAD, SPLIT)


def _ring_args(cache: Int8KVCache, win: KVWindowMetadata | None, like: torch.Tensor):
    if win is None:
        return like, (0, 0, 0, 0), 0
    r = cache.window
    return r, (r.stride(0), r.stride(1), r.stride(2), r.stride(3)), win.size


def _scale_strides(cache: Int8KVCache) -> tuple[int, int, int]:
    sc = cache.scales
    return (sc.stride(0), 0, 0) if cache.is_fp8 else (sc.stride(0), sc.stride(1), sc.stride(2))


def paged_decode_quant(q: torch.Tensor, cache: Int8KVCache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       scale: float, win: KVWindowMetadata | None = None, splits: int | None = None,
                       pages: int | None = None, out: torch.Tensor | None = None, num_warps: int | None = None,
                       num_stages: int | None = None, group_rows: int | None = None) -> torch.Tensor:
    """triton_kernels.paged_decode over an 8-bit cache (and its ring, given the step's window metadata)."""
    values = cache.values
    b = q.shape[0]
    _, _, bs, kvh, _ = values.shape
    launch = decode_launch(q, kvh, bs, block_tables, pages or max(1, 64 // bs), splits, out,  # 64 keys an iteration
                           group_rows)
    ring, rs, w = _ring_args(cache, win, q)
    wslot = win.decode_slots if win is not None else seq_lens
    wlo = win.decode_lo if win is not None else seq_lens
    s_sckv, s_scblk, s_sctok = _scale_strides(cache)
    _qdecode_kernel[(b, kvh, launch.splits)](
        q, values, cache.scales, block_tables, seq_lens, launch.out, launch.partials, launch.ml, ring, wslot, wlo,
        scale, launch.per_split, q.stride(0), q.stride(1), values.stride(0), values.stride(1), values.stride(2),
        values.stride(3), s_sckv, s_scblk, s_sctok, block_tables.stride(0), launch.out.stride(0),
        launch.out.stride(1), *rs, PER_ROW=not cache.is_fp8, W=w, PRECISION=_precision(q), **launch.constants,
        **_launch_options(num_warps, num_stages),
    )
    return launch.finish()


@triton.jit
def _qprefill_kernel(q_ptr, val_ptr, sc_ptr, out_ptr, meta_ptr, bt_ptr, seg_ptr, kn_ptr, vn_ptr, ring_ptr, win_ptr,
                     scale, s_qt, s_qh, s_kv, s_blk, s_tok, s_head, s_sckv, s_scblk, s_sctok, s_ot, s_oh, s_bt, s_seg,
                     s_nt, s_nh, s_vt, s_vh, s_rkv, s_rslot, s_rrow, s_rhead,
                     G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
                     BLOCK_M: tl.constexpr, PAGES: tl.constexpr, NSEG_PAD: tl.constexpr, PER_ROW: tl.constexpr,
                     W: tl.constexpr, PRECISION: tl.constexpr):
    """One (span, query tile, head), as triton_kernels._prefill_kernel, over 8-bit codes. With W > 0 each
    (query, key) pair inside the band takes the full-precision key and value instead."""
    span = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    kh = h // G
    token_start, num_tokens, num_cached, policy, start, end, nseg, hi = _prefill_span(meta_ptr, span, tile, BLOCK_M)
    if tile * BLOCK_M >= num_tokens:
        return
    cdt = q_ptr.dtype.element_ty
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_t = tl.arange(0, PAGES * BS)
    mmask = offs_m < num_tokens
    dmask = offs_d < D
    q = tl.load(q_ptr + (token_start + offs_m)[:, None] * s_qt + h * s_qh + offs_d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0)
    rows = num_cached + offs_m
    num_blocks = tl.cdiv(hi, BS)
    k_scale, v_scale = _head_scales(sc_ptr, s_sckv, kh, PER_ROW)
    slot = 0
    ring_start = num_cached + num_tokens
    if W > 0:
        slot = tl.load(win_ptr + span * 2)
        ring_start = tl.load(win_ptr + span * 2 + 1)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for j in range(0, num_blocks, PAGES):
        page = j + offs_t // BS
        block = tl.load(bt_ptr + span * s_bt + page, mask=page < num_blocks, other=0)
        kr = j * BS + offs_t
        kmask = kr < hi
        k, v, ks, vs = _load_codes(val_ptr, sc_ptr, block, offs_t, offs_d, kmask, dmask, kh, k_scale, v_scale,
                                   s_kv, s_blk, s_tok, s_head, s_sckv, s_scblk, s_sctok, cdt, BS, PAGES, PER_ROW)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * (ks * scale)[None, :]
        # Without a window ring_start is the sequence's length, past every key: the band is empty.
        band = (kr[None, :] >= rows[:, None] + 1 - W) & (kr >= ring_start)[None, :]
        if W > 0:
            new = kmask & (kr >= num_cached)  # the chunk's own rows: the step's k/v
            old = kmask & (kr < num_cached) & (kr >= ring_start)  # earlier rows the ring still holds
            nrow = token_start + tl.maximum(kr - num_cached, 0)
            nmask = new[:, None] & dmask[None, :]
            omask = old[:, None] & dmask[None, :]
            rrow = slot * s_rslot + (kr % W) * s_rrow + kh * s_rhead
            kf = (tl.load(kn_ptr + nrow[:, None] * s_nt + kh * s_nh + offs_d[None, :], mask=nmask, other=0.0)
                  + tl.load(ring_ptr + rrow[:, None] + offs_d[None, :], mask=omask, other=0.0)).to(cdt)
            s = tl.where(band, tl.dot(q, tl.trans(kf), input_precision=PRECISION) * scale, s)
        ok = _allowed(rows, kr, policy, start, end, seg_ptr + span * s_seg, nseg, NSEG_PAD)
        ok = ok & kmask[None, :] & mmask[:, None]
        p, alpha, m, denom = _masked_softmax_step(tl.where(ok, s, float("-inf")), m, denom)
        pv = tl.dot((tl.where(band, 0.0, p) * vs[None, :]).to(cdt), v, input_precision=PRECISION)
        if W > 0:
            vf = (tl.load(vn_ptr + nrow[:, None] * s_vt + kh * s_vh + offs_d[None, :], mask=nmask, other=0.0)
                  + tl.load(ring_ptr + s_rkv + rrow[:, None] + offs_d[None, :], mask=omask, other=0.0)).to(cdt)
            pv += tl.dot(tl.where(band, p, 0.0).to(cdt), vf, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
    out = acc / tl.where(denom == 0, 1.0, denom)[:, None]
    tl.store(out_ptr + (token_start + offs_m)[:, None] * s_ot + h * s_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


# 8-bit prefill tiles of 64 query rows x 32 keys over 8 warps: with the full-precision window (a second
# score tile) 64 keys spill on sm_90 (tests/unit/engine/test_triton_kvq_compiles.py).
PREFILL_KEYS = 32
PREFILL_WARPS = 8


@dataclass
class QuantPrefillLaunch:
    """prefill_launch's tables plus each span's ring slot and ring start ([spans, 2] int32; zeros without a
    window); built once per step, reused by every layer."""

    base: PrefillLaunch
    window: torch.Tensor


def quant_prefill_launch(spans, device: torch.device, win: KVWindowMetadata | None = None,
                         block_m: int | None = None) -> QuantPrefillLaunch:
    rows = ([[s, r] for s, r in zip(win.span_slots, win.span_ring_start, strict=True)] if win is not None
            else [[0, 0]] * len(spans))
    return QuantPrefillLaunch(prefill_launch(spans, device, block_m),
                              to_device(torch.tensor(rows, dtype=torch.int32), device))


def paged_prefill_quant(q: torch.Tensor, cache: Int8KVCache, spans, scale: float, k: torch.Tensor | None = None,
                        v: torch.Tensor | None = None, win: KVWindowMetadata | None = None,
                        launch: QuantPrefillLaunch | None = None, out: torch.Tensor | None = None,
                        block_m: int | None = None, num_warps: int = PREFILL_WARPS,
                        keys: int = PREFILL_KEYS) -> torch.Tensor:
    """triton_kernels.paged_prefill over an 8-bit cache whose pool already holds the spans' rows. With a
    window, `k`/`v` are the step's full-precision rows [T, KVH, D] and the ring must not hold this step's
    rows yet. `num_warps` and `keys` (read per iteration) are for bench.gpu_check's sweep."""
    _, h, d = q.shape
    values = cache.values
    _, _, bs, kvh, _ = values.shape
    out = torch.empty_like(q) if out is None else out
    if not spans:
        return out
    launch = launch if launch is not None else quant_prefill_launch(spans, q.device, win, block_m)
    base = launch.base
    ring, rs, w = _ring_args(cache, win, q)
    kn, vn = (k, v) if win is not None else (q, q)
    s_sckv, s_scblk, s_sctok = _scale_strides(cache)
    _qprefill_kernel[(len(spans), base.tiles, h)](
        q, values, cache.scales, out, base.meta, base.tables, base.segs, kn, vn, ring, launch.window, scale,
        q.stride(0), q.stride(1), values.stride(0), values.stride(1), values.stride(2), values.stride(3),
        s_sckv, s_scblk, s_sctok, out.stride(0), out.stride(1), base.tables.stride(0), base.segs.stride(0),
        kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1), *rs,
        G=h // kvh, D=d, D_PAD=max(16, triton.next_power_of_2(d)), BS=bs, BLOCK_M=base.block_m,
        PAGES=max(1, keys // bs), NSEG_PAD=base.nseg_pad, PER_ROW=not cache.is_fp8, W=w,
        PRECISION=_precision(q), num_warps=num_warps,
    )
    return out
