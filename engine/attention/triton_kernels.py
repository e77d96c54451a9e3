"""Triton kernels for paged attention on the GPU (and on the CPU under TRITON_INTERPRET=1 in tests).

- `paged_decode`: one program per (sequence, KV head, split); the G query heads
  of the group share each K/V block they read; online softmax over the blocks
  of the sequence's block table, 64 tokens per iteration. When batch x KV heads
  is too small to fill the GPU, a sequence's blocks are split among programs
  and a second kernel merges the partial softmaxes (flash-decoding).
- `paged_prefill`: one program per (span, query tile, head); keys come from the
  paged cache (the span's new K/V is written there first), and the mask policy
  of the span (causal, chunk_bidirectional, prefix_bidirectional,
  packed_segments) is evaluated in the kernel from small per-span parameters,
  matching `engine.attention.masks.build_mask`.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.transfer import to_device

POLICY_IDS = {"causal": 0, "chunk_bidirectional": 1, "prefix_bidirectional": 2, "packed_segments": 3}


@triton.jit
def _decode_kernel(q_ptr, kv_ptr, bt_ptr, lens_ptr, out_ptr, part_ptr, ml_ptr, scale, blocks_per_split,
                   s_qb, s_qh, s_kv, s_blk, s_tok, s_head, s_bt, s_ob, s_oh,
                   G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                   BS: tl.constexpr, PAGES: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    """One (sequence, KV head, split): the split's blocks of the sequence, PAGES blocks per iteration.

    Without SPLIT the one split is the whole sequence and the output is written normalised; with it
    the unnormalised accumulator and its (max, sum) go to the partials for _decode_reduce_kernel.
    """
    b, kh, split, nsplit, seq_len, first, last, offs_d, offs_t, gmask, dmask, heads, m, denom, acc = \
        _decode_program(lens_ptr, blocks_per_split, G, G_PAD, D, D_PAD, BS, PAGES)
    q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + offs_d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(kv_ptr.dtype.element_ty)
    for j in range(first, last, PAGES):
        page = j + offs_t // BS
        tok = j * BS + offs_t
        tmask = tok < seq_len
        block = tl.load(bt_ptr + b * s_bt + page, mask=page < last, other=0)
        base = kv_ptr + block[:, None] * s_blk + (offs_t % BS)[:, None] * s_tok + kh * s_head + offs_d[None, :]
        kvmask = tmask[:, None] & dmask[None, :]
        k = tl.load(base, mask=kvmask, other=0.0)
        v = tl.load(base + s_kv, mask=kvmask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        p, alpha, m, denom = _softmax_step(tl.where(tmask[None, :], s, float("-inf")), m, denom)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    _store_decode(acc, m, denom, part_ptr, ml_ptr, out_ptr, b, heads, split, nsplit, offs_d, gmask, dmask,
                  s_ob, s_oh, G, D_PAD, SPLIT)


@triton.jit
def _decode_program(lens_ptr, blocks_per_split, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                    D_PAD: tl.constexpr, BS: tl.constexpr, PAGES: tl.constexpr):
    """A decode program's place (sequence b, KV head kh, split of nsplit), its block range [first, last),
    the feature and key offsets, the group's query heads, their masks, and the empty online-softmax state."""
    b = tl.program_id(0)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    nsplit = tl.num_programs(2)
    seq_len = tl.load(lens_ptr + b)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(seq_len, BS))
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_t = tl.arange(0, PAGES * BS)
    gmask = offs_g < G
    dmask = offs_d < D
    heads = kh * G + offs_g
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    return b, kh, split, nsplit, seq_len, first, last, offs_d, offs_t, gmask, dmask, heads, m, denom, acc


@triton.jit
def _softmax_step(s, m, denom):
    """One tile of the online softmax over masked scores s [rows, keys]: the tile's unnormalised
    probabilities, the factor that rescales what came before, the new running max and sum."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m - m_new)
    return p, alpha, m_new, denom * alpha + tl.sum(p, axis=1)


@triton.jit
def _store_decode(acc, m, denom, part_ptr, ml_ptr, out_ptr, b, heads, split, nsplit, offs_d, gmask, dmask,
                  s_ob, s_oh, G: tl.constexpr, D_PAD: tl.constexpr, SPLIT: tl.constexpr):
    """A decode program's result: normalised into the output, or with SPLIT its unnormalised accumulator
    and (max, sum) into the partials that _decode_reduce_kernel merges."""
    omask = gmask[:, None] & dmask[None, :]
    if SPLIT:
        row = (b * tl.num_programs(1) * G + heads) * nsplit + split  # [G_PAD]: partial rows of these heads
        tl.store(part_ptr + row[:, None] * D_PAD + offs_d[None, :], acc, mask=omask)
        tl.store(ml_ptr + row * 2, m, mask=gmask)
        tl.store(ml_ptr + row * 2 + 1, denom, mask=gmask)
    else:
        out = acc / denom[:, None]
        tl.store(out_ptr + b * s_ob + heads[:, None] * s_oh + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=omask)


@triton.jit
def _decode_reduce_kernel(part_ptr, ml_ptr, out_ptr, nsplit, s_ob, s_oh,
                          D: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr):
    """Merge the splits of one (sequence, head): rescale each to the common max, then normalise."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    smask = offs_s < nsplit
    row = (b * tl.num_programs(1) + h) * nsplit + offs_s
    m = tl.load(ml_ptr + row * 2, mask=smask, other=float("-inf"))
    denom = tl.load(ml_ptr + row * 2 + 1, mask=smask, other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))  # empty splits weigh nothing
    acc = tl.load(part_ptr + row[:, None] * D_PAD + offs_d[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(denom * w, axis=0)
    tl.store(out_ptr + b * s_ob + h * s_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < D)


def decode_splits(batch: int, kv_heads: int, max_blocks: int, pages: int, device: torch.device) -> tuple[int, int]:
    """(splits, blocks per split) for a decode launch.

    Below about two programs per multiprocessor (small batches, few KV heads) each sequence's blocks
    are split among programs, flash-decoding style, so that enough KV reads are in flight to keep
    memory busy; the split depends only on shapes, so it stays fixed inside a captured CUDA graph.
    """
    sms = multiprocessors(device)
    programs = batch * kv_heads
    chunks = triton.cdiv(max_blocks, pages)  # iterations a single program would run
    if programs >= 2 * sms or chunks < 2:
        return 1, max_blocks
    return split_evenly(max_blocks, pages, min(triton.cdiv(2 * sms, programs), chunks, 64))


def split_evenly(total: int, step: int, parts: int) -> tuple[int, int]:
    """(parts, size of each): `total` items in at most `parts` runs of equal length, a multiple of `step`,
    the last run shorter; fewer parts when rounding up to whole steps covers `total` sooner."""
    size = triton.cdiv(triton.cdiv(total, step), parts) * step
    return triton.cdiv(total, size), size


def multiprocessors(device: torch.device) -> int:
    """The device's streaming multiprocessors, which launch shapes are sized against; 4 off CUDA (the
    interpreter the CPU tests run), so that those tests take the same paths."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# Two pipeline stages, not Triton's three: on sm_90 the decode kernel then holds fewer registers, so a
# multiprocessor keeps four programs instead of three (registers and timings: docs/perf/gpu.md). The 8-bit
# kernels' counts do not change with it, so they keep the default.
DECODE_STAGES = 2


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, splits: int | None = None, pages: int | None = None,
                 out: torch.Tensor | None = None, num_warps: int | None = None,
                 num_stages: int | None = None, group_rows: int | None = None) -> torch.Tensor:
    """q: [B, H, D]; kv_cache: [2, num_blocks, BS, KVH, D]; block_tables: [B, max_blocks]; returns [B, H, D]
    (written into `out` when given: a [B, H, D] view with unit stride in D). `num_warps`, `num_stages`
    and `group_rows` override the launch defaults (Triton's warps, DECODE_STAGES, group_rows(G)) for
    bench.gpu_check's sweep.

    `splits` (programs per sequence and KV head, at most) and `pages` (blocks per iteration) are for
    tests; None picks them from the shapes.
    """
    b = q.shape[0]
    _, _, bs, kvh, _ = kv_cache.shape
    launch = decode_launch(q, kvh, bs, block_tables, pages or max(1, 64 // bs), splits, out,  # 64 keys an iteration
                           group_rows)
    _decode_kernel[(b, kvh, launch.splits)](
        q, kv_cache, block_tables, seq_lens, launch.out, launch.partials, launch.ml, scale, launch.per_split,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), launch.out.stride(0), launch.out.stride(1),
        PRECISION=_precision(kv_cache), **launch.constants,
        **_launch_options(num_warps, DECODE_STAGES if num_stages is None else num_stages),
    )
    return launch.finish()


@dataclass(frozen=True)
class DecodeLaunch:
    """The shapes and buffers shared by the decode kernels' launches (bf16 and 8-bit caches)."""

    splits: int  # programs per (sequence, KV head)
    per_split: int  # blocks each of them reads, a multiple of pages
    pages: int  # blocks per iteration
    block_size: int
    group: int  # query heads per KV head
    group_rows: int  # the rows they fill in the kernels' dot products (G_PAD)
    head_dim: int
    d_pad: int
    out: torch.Tensor
    partials: torch.Tensor  # [B * H * splits, D_PAD] unnormalised accumulators (out itself when unsplit)
    ml: torch.Tensor  # [B * H * splits, 2] their (max, sum)

    @property
    def constants(self) -> dict[str, int | bool]:
        """The decode kernels' shared constexprs."""
        return dict(G=self.group, G_PAD=self.group_rows, D=self.head_dim,
                    D_PAD=self.d_pad, BS=self.block_size, PAGES=self.pages, SPLIT=self.splits > 1)

    def finish(self) -> torch.Tensor:
        """Merges the splits' partial softmaxes into out (nothing to do unsplit)."""
        if self.splits > 1:
            b, h, _ = self.out.shape
            _decode_reduce_kernel[(b, h)](self.partials, self.ml, self.out, self.splits, self.out.stride(0),
                                          self.out.stride(1), D=self.head_dim, D_PAD=self.d_pad,
                                          S_PAD=max(2, triton.next_power_of_2(self.splits)))
        return self.out


def group_rows(group: int) -> int:
    """The rows a KV head's query group fills in the decode kernels' dot products: the next power of two.
    From Triton 3.5 tl.dot pads fewer than 16 rows to the tensor cores' shape itself, so the kernel need
    not: compiled for sm_90 the same MMA instructions then take less shared memory and, under the
    device's Triton, fewer registers (docs/perf/gpu.md; bench.gpu_check's sweep times 16 rows beside it).
    Earlier versions refuse a dot of fewer than 16 rows."""
    return max(triton.next_power_of_2(group), 1 if _dot_takes_small_rows() else 16)


@functools.cache
def _dot_takes_small_rows() -> bool:
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", triton.__version__).groups())
    return (major, minor) >= (3, 5)


def decode_launch(q: torch.Tensor, kv_heads: int, block_size: int, block_tables: torch.Tensor, pages: int,
                  splits: int | None, out: torch.Tensor | None, rows: int | None = None) -> DecodeLaunch:
    """The split (decode_splits' unless a test names one), the checked output, the partials' buffers and
    the group's rows (group_rows' unless the sweep names them)."""
    b, h, d = q.shape
    max_blocks = block_tables.shape[1]
    if splits is None:
        splits, per_split = decode_splits(b, kv_heads, max_blocks, pages, q.device)
    else:
        splits, per_split = split_evenly(max_blocks, pages, splits)
    d_pad = max(16, triton.next_power_of_2(d))
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"paged decode: out must be {tuple(q.shape)} with unit stride in D, got {tuple(out.shape)}")
    if splits > 1:
        partials = torch.empty(b * h * splits, d_pad, dtype=torch.float32, device=q.device)
        ml = torch.empty(b * h * splits, 2, dtype=torch.float32, device=q.device)
    else:
        partials = ml = out  # unused
    group = h // kv_heads
    if rows is not None and (rows < group or rows & (rows - 1)):
        raise ValueError(f"paged decode: a group of {group} query heads takes a power of two rows, at least "
                         f"{group}; got {rows}")
    return DecodeLaunch(splits, per_split, pages, block_size, group, rows or group_rows(group), d, d_pad, out,
                        partials, ml)


def _launch_options(num_warps: int | None, num_stages: int | None) -> dict[str, int]:
    """Triton's launch defaults unless bench.gpu_check's sweep names them."""
    return {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}


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
def _prefill_span(meta_ptr, span, tile, BLOCK_M: tl.constexpr):
    """A span's meta row (token_start, num_tokens, num_cached, policy, start, end, num_segments) and hi, the
    end of the keys a tile's rows may see: past its last row, or a bidirectional region's end (policies 1, 2)."""
    token_start = tl.load(meta_ptr + span * 7 + 0)
    num_tokens = tl.load(meta_ptr + span * 7 + 1)
    num_cached = tl.load(meta_ptr + span * 7 + 2)
    policy = tl.load(meta_ptr + span * 7 + 3)
    start = tl.load(meta_ptr + span * 7 + 4)
    end = tl.load(meta_ptr + span * 7 + 5)
    nseg = tl.load(meta_ptr + span * 7 + 6)
    hi = num_cached + tl.minimum((tile + 1) * BLOCK_M, num_tokens)
    hi = tl.where((policy == 1) | (policy == 2), tl.maximum(hi, end), hi)
    return token_start, num_tokens, num_cached, policy, start, end, nseg, tl.minimum(hi, num_cached + num_tokens)


@triton.jit
def _masked_softmax_step(s, m, denom):
    """_softmax_step for prefill tiles, where a row may have no allowed key yet (all -inf): such a row keeps
    a zero sum and contributes nothing, instead of NaN."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    return p, alpha, m_new, denom * alpha + tl.sum(p, axis=1)


@triton.jit
def _prefill_kernel(q_ptr, kv_ptr, out_ptr, meta_ptr, bt_ptr, seg_ptr, scale,
                    s_qt, s_qh, s_kv, s_blk, s_tok, s_head, s_ot, s_oh, s_bt, s_seg,
                    G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
                    BLOCK_M: tl.constexpr, PAGES: tl.constexpr, NSEG_PAD: tl.constexpr, PRECISION: tl.constexpr):
    """One (span, tile of BLOCK_M query rows, head), PAGES key blocks per iteration. Keys past what any
    row of the tile may see (the causal limit, or a bidirectional region's end) are not read."""
    span = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    kh = h // G
    token_start, num_tokens, num_cached, policy, start, end, nseg, hi = _prefill_span(meta_ptr, span, tile, BLOCK_M)
    if tile * BLOCK_M >= num_tokens:
        return
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_t = tl.arange(0, PAGES * BS)
    mmask = offs_m < num_tokens
    dmask = offs_d < D
    q = tl.load(q_ptr + (token_start + offs_m)[:, None] * s_qt + h * s_qh + offs_d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0).to(kv_ptr.dtype.element_ty)
    rows = num_cached + offs_m  # query rows within the sequence
    num_blocks = tl.cdiv(hi, BS)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for j in range(0, num_blocks, PAGES):
        page = j + offs_t // BS
        block = tl.load(bt_ptr + span * s_bt + page, mask=page < num_blocks, other=0)
        kr = j * BS + offs_t
        kmask = kr < hi
        base = kv_ptr + block[:, None] * s_blk + (offs_t % BS)[:, None] * s_tok + kh * s_head + offs_d[None, :]
        k = tl.load(base, mask=kmask[:, None] & dmask[None, :], other=0.0)
        v = tl.load(base + s_kv, mask=kmask[:, None] & dmask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        ok = _allowed(rows, kr, policy, start, end, seg_ptr + span * s_seg, nseg, NSEG_PAD)
        ok = ok & kmask[None, :] & mmask[:, None]
        p, alpha, m, denom = _masked_softmax_step(tl.where(ok, s, float("-inf")), m, denom)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    out = acc / tl.where(denom == 0, 1.0, denom)[:, None]
    tl.store(out_ptr + (token_start + offs_m)[:, None] * s_ot + h * s_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


@dataclass
class PrefillLaunch:
    """The device tables of one paged_prefill launch; built once per step, reused by every layer."""

    meta: torch.Tensor  # [spans, 7] int32: token_start, num_tokens, num_cached, policy, start, end, segments
    tables: torch.Tensor  # [spans, max blocks] int32
    segs: torch.Tensor  # [spans, max segments] int32
    tiles: int  # query tiles of the longest span
    block_m: int
    nseg_pad: int


def prefill_launch(spans, device: torch.device, block_m: int | None = None) -> PrefillLaunch:
    """Pack the spans' parameters on the host (from their host block ids where set) and copy them over once.

    `block_m` query rows per program: 64 on a GPU (tensor-core sized tiles), 16 elsewhere (the
    interpreter the CPU tests run, where small tiles are faster)."""
    block_m = block_m or (64 if device.type == "cuda" else 16)
    tables_host = [s.block_ids if s.block_ids is not None else s.block_table.tolist() for s in spans]
    seg_host = [s.mask.segment_starts or (s.mask.start,) for s in spans]
    max_blocks = max(len(t) for t in tables_host)
    max_segs = max(len(g) for g in seg_host)
    meta = torch.tensor([[s.token_start, s.num_tokens, s.num_cached, POLICY_IDS[s.mask.policy], s.mask.start,
                          s.mask.end, len(g)] for s, g in zip(spans, seg_host, strict=True)], dtype=torch.int32)
    tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables_host], dtype=torch.int32)
    segs = torch.tensor([list(g) + [0] * (max_segs - len(g)) for g in seg_host], dtype=torch.int32)
    return PrefillLaunch(to_device(meta, device), to_device(tables, device), to_device(segs, device),
                         max(triton.cdiv(s.num_tokens, block_m) for s in spans), block_m,
                         max(16, triton.next_power_of_2(max_segs)))


# Prefill tiles of 64 query rows x 64 keys over 4 warps: the launch the device runs in docs/perf/gpu.md
# timed; sm_90 holds it in registers (tests/unit/engine/test_triton_compiles.py).
PREFILL_KEYS = 64
PREFILL_WARPS = 4


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, spans, scale: float, block_m: int | None = None,
                  launch: PrefillLaunch | None = None, out: torch.Tensor | None = None,
                  num_warps: int = PREFILL_WARPS, keys: int = PREFILL_KEYS) -> torch.Tensor:
    """Attention for every prefill span; q: [T, H, D] (rows of the spans), K/V already in the cache.

    Returns `out` (a new [T, H, D] tensor when None) with the spans' rows written; other rows are left
    as they were. `launch` is prefill_launch(spans) when the caller keeps it across layers. `num_warps`
    and `keys` (read per iteration) are for bench.gpu_check's sweep.
    """
    _, h, d = q.shape
    _, _, bs, kvh, _ = kv_cache.shape
    out = torch.empty_like(q) if out is None else out
    if not spans:
        return out
    launch = launch if launch is not None else prefill_launch(spans, q.device, block_m)
    _prefill_kernel[(len(spans), launch.tiles, h)](
        q, kv_cache, out, launch.meta, launch.tables, launch.segs, scale,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        out.stride(0), out.stride(1), launch.tables.stride(0), launch.segs.stride(0),
        G=h // kvh, D=d, D_PAD=max(16, triton.next_power_of_2(d)), BS=bs, BLOCK_M=launch.block_m,
        PAGES=max(1, keys // bs), NSEG_PAD=launch.nseg_pad, PRECISION=_precision(kv_cache), num_warps=num_warps,
    )
    return out


def _precision(kv_cache: torch.Tensor) -> str:
    # fp32 caches are the reference path: exact products, not TF32.
    return "ieee" if kv_cache.dtype == torch.float32 else "tf32"
