"""Triton kernels of the quantized linears on the GPU (and on the CPU under TRITON_INTERPRET=1 in tests).

- `quantize_rows_fp8`: one program per row (token): the row's max |x| gives its scale, max / 448,
  and the row is written as E4M3 codes, x / scale rounded to nearest. The scales feed
  torch._scaled_mm's row-wise scaling (engine/quant/fp8.py).
- `w8a16_linear`: x @ W^T for int8 (or E4M3) W with one fp32 scale per output channel. Each program loads
  int8 tiles of W, converts them to x's dtype in registers and accumulates in fp32; the row
  scales multiply the accumulator once at the end (they factor out of the sum over K). No
  full-precision copy of W exists at any time.
- `w4a16_linear`: the same for int4 W in groups (engine/quant/quantizers.py's packed layout): a run of
  32 inputs at a time, its 16 bytes unpacked into two 16-input products, each group's scale and
  offset applied to the codes in registers (the offsets do not factor out of the sum).
- `w8a8_fp8_linear`: E4M3 activations times E4M3 weights on fp8 tensor cores, both scales applied
  to the fp32 accumulator: torch._scaled_mm's product, for decode batches (engine/quant/fp8.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.attention.triton_kernels import multiprocessors, split_evenly
from engine.quant.quantizers import ACT_SCALE_MIN, FP8_MAX


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, s_x, s_q, FMAX: tl.constexpr, SMIN: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * s_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0) / FMAX, SMIN)
    for k0 in range(0, K, BLOCK_K):
        m = k0 + offs < K
        x = tl.load(x_ptr + row * s_x + k0 + offs, mask=m, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -FMAX), FMAX)
        tl.store(q_ptr + row * s_q + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=m)
    tl.store(s_ptr + row, scale)


def quantize_rows_fp8(x: torch.Tensor, out_dtype: torch.dtype = torch.float8_e4m3fn
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [M, K] in `out_dtype`, scales [M, 1] fp32) with x ~= codes * scales, row by row.

    `out_dtype` float32 writes the clamped quotients unrounded (what the CPU interpreter can
    store; rounding them with torch's .to(float8_e4m3fn) gives the codes). The torch twin:
    engine.quant.quantizers.quantize_rows_fp8."""
    assert x.dim() == 2
    x = x if x.stride(1) == 1 else x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=out_dtype, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), FMAX=FP8_MAX, SMIN=ACT_SCALE_MIN,
                                    BLOCK_K=min(4096, triton.next_power_of_2(k)))
    return q, s


@triton.jit
def _store_tile(acc, b_ptr, out_ptr, rm, rn, mmask, nmask, s_om, HAS_BIAS: tl.constexpr):
    """An output tile of the GEMMs below: the bias added in fp32, then one rounding to out's dtype."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * s_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _scaled_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, M, N, K, k_per_split, s_xm, s_wn, s_om,
                        HAS_BIAS: tl.constexpr, FP8_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """x [M, K] @ (w [N, K] codes * ws [N])^T. FP8_ROWS 0: weight-only (W8A16), x in its own dtype and the
    int8 or E4M3 codes converted in registers; 1: W8A8, x E4M3 codes scaled by xs [M], fp8 tensor-core
    products. Either way fp32 accumulation, then the scales. Program (i, j, split) sums inputs
    [split * k_per_split, +k_per_split); with several splits out_ptr is that split's fp32 partial [M, N]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    out_ptr += tl.program_id(2) * M * N  # the split's partial (split 0 alone: out itself)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        kmask = kk < k_hi
        a = tl.load(x_ptr + rm[:, None] * s_xm + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + rn[None, :] * s_wn + kk[:, None], mask=nmask[None, :] & kmask[:, None], other=0.0)
        if FP8_ROWS:
            acc = tl.dot(a, w, acc)
        else:
            # int8 -> fp32 -> x's dtype: exact for |q| <= 127, and the path the interpreter converts right.
            acc = tl.dot(a, w.to(tl.float32).to(a.dtype), acc, input_precision=PRECISION)
    if FP8_ROWS:
        acc = acc * tl.load(xs_ptr + rm, mask=mmask, other=0.0)[:, None]
    acc = acc * tl.load(ws_ptr + rn, mask=nmask, other=0.0)[None, :]
    _store_tile(acc, b_ptr, out_ptr, rm, rn, mmask, nmask, s_om, HAS_BIAS)


def _w8a16_blocks(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): decode rows stream W in narrow column tiles, so that
    many programs share the weight's bandwidth; prefill rows take square tiles that reuse each W tile.
    Each tile is one that sm_90 compiles without spilling (tests/unit/engine/test_triton_compiles.py)."""
    if m <= 16:
        return 16, 64, 128, 4
    if m <= 64:
        return 64, 64, 64, 4
    return 128, 128, 64, 8


@triton.jit
def _split_k_reduce_kernel(part_ptr, b_ptr, out_ptr, M, N, S, s_om, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                           S_PAD: tl.constexpr):
    """out[m] = sum of the S partials [S, M, N] of row m (+ bias), rounded once to out's dtype."""
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, S_PAD)
    nmask = rn < N
    parts = tl.load(part_ptr + (rs[:, None] * M + m) * N + rn[None, :], mask=(rs[:, None] < S) & nmask[None, :],
                    other=0.0)
    acc = tl.sum(parts, axis=0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * s_om + rn, acc.to(out_ptr.dtype.element_ty), mask=nmask)


def k_splits(programs: int, k: int, step: int, device: torch.device, most: int = 16) -> tuple[int, int]:
    """(splits, inputs per split, a multiple of `step`) for a GEMM launch of `programs` output tiles.

    Decode batches give the narrow projections fewer tiles than the GPU has multiprocessors (batch 1 on
    the 8B shape: 64 to 96 against 132), so a third to a half of them would stream no weight. Below one tile
    per multiprocessor K is split among programs (about two per multiprocessor, each summing at least
    4 steps of K, at most `most` splits) and a second kernel adds the fp32 partials. Shapes alone decide,
    so a captured CUDA graph keeps its split."""
    sms = multiprocessors(device)
    steps = triton.cdiv(k, step)
    splits = min(triton.cdiv(2 * sms, programs), steps // 4, most, 16) if programs < sms else 1
    return split_evenly(k, step, splits) if splits > 1 else (1, k)


@dataclass(frozen=True)
class GemmLaunch:
    """One quantized GEMM's rows, output, tiles and split of K (k_splits)."""

    x: torch.Tensor  # [M, K] rows with unit stride
    out: torch.Tensor  # [M, N]
    grid: tuple[int, int, int] | None  # None when there are no rows
    block_m: int
    block_n: int
    block_k: int
    warps: int
    per_split: int
    partials: torch.Tensor  # [splits, M, N] fp32 that the kernel writes; out itself unsplit

    @property
    def split(self) -> bool:
        return self.grid is not None and self.grid[2] > 1

    def finish(self, bias: torch.Tensor | None) -> torch.Tensor:
        """out: the partials summed (+ bias) when K was split; the kernel wrote it directly otherwise."""
        if self.split:
            m, n = self.out.shape
            _split_k_reduce_kernel[(m, triton.cdiv(n, 256))](
                self.partials, bias if bias is not None else self.partials, self.out, m, n, self.grid[2],
                self.out.stride(0), HAS_BIAS=bias is not None, BLOCK_N=256,
                S_PAD=max(2, triton.next_power_of_2(self.grid[2])))
        return self.out


def _gemm_launch(x: torch.Tensor, n: int, step: int | None = None, out_dtype: torch.dtype | None = None,
                 splits: int | None = None, weight_bytes: float = 1.0) -> GemmLaunch:
    """x as rows [M, K] with unit stride, the [M, N] output (in x's dtype unless out_dtype), the tiles for M
    rows (_w8a16_blocks) and the split of K in steps of `step` (BLOCK_K unless given): k_splits', or
    `splits` (tests, benches) when given. `weight_bytes`: the weight's bytes per element."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    (m, k), dtype = x2.shape, out_dtype or x.dtype
    bm, bn, bk, warps = _w8a16_blocks(max(m, 1))
    step = step or bk
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if splits is None:
        # The partials, 4 bytes per output and split, written and read again, may add at most an eighth to
        # the weight's bytes: a batch of 1 splits freely, 16 rows 2 to 4 ways, 64 rows not at all.
        most = int(n * k * weight_bytes) // (64 * m * n) if m else 1
        nsplit, per_split = k_splits(tiles, k, step, x.device, most) if m else (1, k)
    else:
        nsplit, per_split = split_evenly(k, step, splits)
    out = torch.empty(m, n, dtype=dtype, device=x.device)
    partials = torch.empty(nsplit, m, n, dtype=torch.float32, device=x.device) if nsplit > 1 else out
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), nsplit) if m else None
    return GemmLaunch(x2, out, grid, bm, bn, bk, warps, per_split, partials)


def w8a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """x [..., K] @ (qweight [N, K] int8 * scales [N])^T (+ bias), in x's dtype, accumulated in fp32.
    `splits` of K overrides k_splits' (tests, benches)."""
    g = _gemm_launch(x, qweight.shape[0], splits=splits)
    if g.grid is not None:
        _scaled_gemm_kernel[g.grid](g.x, scales, qweight, scales, bias if bias is not None else scales, g.partials,
                                    *g.out.shape, g.x.shape[1], g.per_split, g.x.stride(0), qweight.stride(0),
                                    g.partials.stride(-2), HAS_BIAS=bias is not None and not g.split, FP8_ROWS=False,
                                    BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k,
                                    PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=g.warps)
        g.finish(bias)
    return g.out.view(*x.shape[:-1], g.out.shape[1])


@triton.jit
def _w4a16_kernel(x_ptr, w_ptr, s_ptr, o_ptr, b_ptr, out_ptr, M, N, K, k_per_split, G, s_xm, s_wn, s_sn, s_om,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RUNS: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Runs of 32 inputs: byte j of a run holds input j (low nibble) and j + 16 (high nibble), so each run
    is two products of 16 inputs; each run's group gives its scale and offset (w = q * scale + offset).
    Splits of K as in _scaled_gemm_kernel (k_per_split a multiple of 32 * RUNS)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    k_lo = tl.program_id(2) * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    out_ptr += tl.program_id(2) * M * N
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r16 = tl.arange(0, 16)
    mmask = rm < M
    nmask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, 32 * RUNS):
        for r in tl.static_range(RUNS):
            k = k0 + r * 32
            if k < k_hi:
                g = k // G
                scale = tl.load(s_ptr + rn * s_sn + g, mask=nmask, other=0.0).to(tl.float32)[None, :]
                offset = tl.load(o_ptr + rn * s_sn + g, mask=nmask, other=0.0).to(tl.float32)[None, :]
                packed = tl.load(w_ptr + rn[None, :] * s_wn + k // 2 + r16[:, None], mask=nmask[None, :], other=0)
                packed = packed.to(tl.int32)
                lo = ((packed & 0xF).to(tl.float32) * scale + offset)
                hi = ((packed >> 4).to(tl.float32) * scale + offset)
                a_lo = tl.load(x_ptr + rm[:, None] * s_xm + k + r16[None, :], mask=mmask[:, None], other=0.0)
                a_hi = tl.load(x_ptr + rm[:, None] * s_xm + k + 16 + r16[None, :], mask=mmask[:, None], other=0.0)
                acc = tl.dot(a_lo, lo.to(a_lo.dtype), acc, input_precision=PRECISION)
                acc = tl.dot(a_hi, hi.to(a_hi.dtype), acc, input_precision=PRECISION)
    _store_tile(acc, b_ptr, out_ptr, rm, rn, mmask, nmask, s_om, HAS_BIAS)


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                 bias: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """x [..., K] @ W^T for int4 W in engine.quant.quantizers' packed layout (qweight [N, K/2] uint8, fp16
    scales and offsets [N, K/G]), dequantized in registers a run of 32 inputs at a time."""
    runs = 4
    g = _gemm_launch(x, qweight.shape[0], step=32 * runs, splits=splits, weight_bytes=0.5)
    if g.grid is not None:
        _w4a16_kernel[g.grid](g.x, qweight, scales, offsets, bias if bias is not None else scales, g.partials,
                              *g.out.shape, g.x.shape[1], g.per_split, g.x.shape[1] // scales.shape[1], g.x.stride(0),
                              qweight.stride(0), scales.stride(0), g.partials.stride(-2),
                              HAS_BIAS=bias is not None and not g.split, BLOCK_M=g.block_m, BLOCK_N=g.block_n,
                              RUNS=runs, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=g.warps)
        g.finish(bias)
    return g.out.view(*x.shape[:-1], g.out.shape[1])


def w8a8_fp8_linear(xq: torch.Tensor, x_scales: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                    splits: int | None = None) -> torch.Tensor:
    """(xq [M, K] E4M3 * x_scales [M, 1]) @ (qweight [N, K] E4M3 * scales [N])^T (+ bias): the product
    torch._scaled_mm computes with row-wise scales, as a Triton GEMM (fp8 tensor-core products,
    fp32 accumulation) whose narrow tiles suit decode batches."""
    g = _gemm_launch(xq, qweight.shape[0], out_dtype=out_dtype, splits=splits)
    if g.grid is not None:
        _scaled_gemm_kernel[g.grid](g.x, x_scales, qweight, scales, bias if bias is not None else scales, g.partials,
                                    *g.out.shape, g.x.shape[1], g.per_split, g.x.stride(0), qweight.stride(0),
                                    g.partials.stride(-2), HAS_BIAS=bias is not None and not g.split, FP8_ROWS=True,
                                    BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, PRECISION="tf32",
                                    num_warps=g.warps)
        g.finish(bias)
    return g.out
