"""Fused elementwise kernels for the GPU (Triton): residual add + RMSNorm, and SiLU(gate) * up.

Each saves a round trip of the hidden state through memory per layer, which is
what these memory-bound steps cost. The torch versions in engine.models.llama
stay the reference; tests run these under TRITON_INTERPRET=1 on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_out_ptr + row * n_cols + cols, x.to(res_out_ptr.dtype.element_ty), mask=mask)
    var = tl.sum(x * x, axis=0) / n_cols
    y = x * tl.rsqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual); with no residual, the sum is x itself."""
    x = x.contiguous()
    rows, cols = x.shape
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else x
    _add_rms_norm_kernel[(rows,)](x, residual.contiguous() if residual is not None else x, weight, out, summed,
                                  cols, eps, HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(cols))
    return out, summed


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gu_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for the fused [gate | up] projection output."""
    gate_up = gate_up.contiguous()
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, n, BLOCK=block)
    return out


@triton.jit
def _rope_kv_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, kv_ptr, slot_ptr, s_row, s_cos, s_kv, s_slot,
                    NQ: tl.constexpr, NKV: tl.constexpr, NH_PAD: tl.constexpr, NKV_PAD: tl.constexpr,
                    D: tl.constexpr, D_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                    WRITE: tl.constexpr):
    """One token: rotate its q and k heads in place (rotate-half layout), then store k and v at its slot."""
    row = tl.program_id(0)
    pos = tl.load(pos_ptr + row)
    offs_h = tl.arange(0, NH_PAD)  # the q heads, then the k heads: contiguous in the qkv row
    offs_d = tl.arange(0, HALF_PAD)
    dmask = offs_d < HALF
    m = (offs_h < NQ + NKV)[:, None] & dmask[None, :]
    cos = tl.load(cos_ptr + pos * s_cos + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * s_cos + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    lo = qkv_ptr + row * s_row + offs_h[:, None] * D + offs_d[None, :]
    x1 = tl.load(lo, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(lo + HALF, mask=m, other=0.0).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(qkv_ptr.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(qkv_ptr.dtype.element_ty)
    tl.store(lo, y1, mask=m)
    tl.store(lo + HALF, y2, mask=m)
    if WRITE:
        slot = tl.load(slot_ptr + row)
        km = m & (offs_h >= NQ)[:, None]
        k_dst = kv_ptr + slot * s_slot + (offs_h[:, None] - NQ) * D + offs_d[None, :]
        tl.store(k_dst, y1.to(kv_ptr.dtype.element_ty), mask=km)
        tl.store(k_dst + HALF, y2.to(kv_ptr.dtype.element_ty), mask=km)
        offs_v = tl.arange(0, NKV_PAD)
        offs_dv = tl.arange(0, D_PAD)
        vm = (offs_v < NKV)[:, None] & (offs_dv < D)[None, :]
        inner = offs_v[:, None] * D + offs_dv[None, :]
        v = tl.load(qkv_ptr + row * s_row + (NQ + NKV) * D + inner, mask=vm, other=0.0)
        tl.store(kv_ptr + s_kv + slot * s_slot + inner, v.to(kv_ptr.dtype.element_ty), mask=vm)


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  num_heads: int, num_kv_heads: int, head_dim: int, kv_cache: torch.Tensor | None = None,
                  slot_mapping: torch.Tensor | None = None) -> None:
    """RoPE on the q and k parts of a fused qkv projection output [T, (H + 2 KVH) * D], in place, and,
    given a paged cache [2, num_blocks, block_size, KVH, D], the rotated k and the v of each token stored
    at its slot: one launch where torch takes about sixteen (RotaryEmbedding.apply_torch_, write_kv).

    cos/sin are the [max_positions, D] tables with both halves equal; the rotation runs in fp32 and
    rounds once (the torch path rounds after each product in half precision).
    """
    rows = qkv.shape[0]
    if qkv.stride(-1) != 1 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"rope_write_kv needs a row-major fused qkv output, got {tuple(qkv.shape)}")
    if rows == 0:
        return
    write = kv_cache is not None
    if write:
        _, _, block_size, kvh, hd = kv_cache.shape
        flat = (kv_cache.stride(-1), kv_cache.stride(-2), kv_cache.stride(-3), kv_cache.stride(-4))
        if (kvh, hd) != (num_kv_heads, head_dim) or flat != (1, hd, kvh * hd, block_size * kvh * hd):
            raise ValueError(f"rope_write_kv needs a contiguous paged cache, got {tuple(kv_cache.shape)}")
    half = head_dim // 2
    _rope_kv_kernel[(rows,)](
        qkv, positions, cos, sin, kv_cache if write else qkv, slot_mapping if write else positions,
        qkv.stride(0), cos.stride(0), kv_cache.stride(0) if write else 0, num_kv_heads * head_dim if write else 0,
        NQ=num_heads, NKV=num_kv_heads, NH_PAD=triton.next_power_of_2(num_heads + num_kv_heads),
        NKV_PAD=triton.next_power_of_2(num_kv_heads), D=head_dim, D_PAD=triton.next_power_of_2(head_dim),
        HALF=half, HALF_PAD=triton.next_power_of_2(half), WRITE=write,
    )
