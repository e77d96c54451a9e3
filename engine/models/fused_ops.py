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
def _int8_codes(x, absmax):
    """Row codes as engine.attention.kv_int8.quantize_rows makes them: the fp16 scale absmax / 127 first,
    then x / scale rounded half to even (adding and taking away 1.5 * 2**23 rounds an fp32 of magnitude
    below 2**22 to an integer, in the hardware's round-to-nearest-even)."""
    scale = tl.minimum(tl.maximum(absmax / 127.0, 6.103515625e-05), 65504.0).to(tl.float16).to(tl.float32)
    r = x / scale[:, None]
    r = (r + 12582912.0) - 12582912.0
    return tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8), scale


@triton.jit
def _e4m3_codes(x, scale, out_dtype: tl.constexpr):
    """E4M3 codes of x / scale, saturated at +-448 and rounded half to even onto the E4M3 grid in fp32 first,
    so the cast itself is exact (Triton's interpreter mis-rounds casts whose rounding carries into the
    exponent). Normal values: round the fp32 bits to 3 mantissa bits; below 2**-6 (E4M3's subnormals):
    to a multiple of 2**-9, by adding and taking away 1.5 * 2**14."""
    y = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -448.0), 448.0)
    bits = y.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    sub = (y + 24576.0) - 24576.0
    return tl.where(tl.abs(y) < 0.015625, sub, normal).to(out_dtype)


@triton.jit
def _rotate_heads(row_ptr, rot_ptr, offs_h, hmask, out_dtype: tl.constexpr, NH_PAD: tl.constexpr, D: tl.constexpr,
                  HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """x @ R as two halves [NH_PAD, HALF_PAD] of each head row x [D] at row_ptr (heads offs_h where hmask),
    for the [D, D] fp32 R at rot_ptr: summed in fp32 ("ieee", no tf32) and rounded once to out_dtype.
    x is read back from memory 16 channels at a time, since whole-row register tiles times R's blocks
    spill for the 8B shape (40 heads of 128) on sm_90. The caller has stored x and stores the result
    over it: the barriers order both against these loads across the CTA's threads."""
    tl.debug_barrier()
    offs_k = tl.arange(0, 16)
    offs_n = tl.arange(0, HALF_PAD)
    nmask = offs_n < HALF
    z1 = tl.zeros((NH_PAD, HALF_PAD), dtype=tl.float32)
    z2 = tl.zeros((NH_PAD, HALF_PAD), dtype=tl.float32)
    for k0 in range(0, D, 16):
        kmask = k0 + offs_k < D
        a = tl.load(row_ptr + offs_h[:, None] * D + k0 + offs_k[None, :], mask=hmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        r = rot_ptr + (k0 + offs_k[:, None]) * D + offs_n[None, :]
        rm = kmask[:, None] & nmask[None, :]
        z1 = tl.dot(a, tl.load(r, mask=rm, other=0.0), z1, input_precision="ieee")
        z2 = tl.dot(a, tl.load(r + HALF, mask=rm, other=0.0), z2, input_precision="ieee")
    tl.debug_barrier()
    return z1.to(out_dtype), z2.to(out_dtype)


@triton.jit
def _rope_kv_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, kv_ptr, slot_ptr, sc_ptr, rot_ptr, s_row, s_cos, s_kv,
                    s_slot, s_sckv, s_scslot,
                    NQ: tl.constexpr, NKV: tl.constexpr, NH_PAD: tl.constexpr, NKV_PAD: tl.constexpr,
                    D: tl.constexpr, D_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                    WRITE: tl.constexpr, QUANT: tl.constexpr, ROTATE: tl.constexpr):
    """One token: rotate its q and k heads in place (rotate-half layout), with ROTATE each head row then
    multiplied by the [D, D] fp32 matrix at rot_ptr, then store k and v at its slot: as they are (QUANT 0),
    as int8 codes with a new fp16 scale per (token, head) (1), or as fp8 codes of x / the layer's per-head
    scale (2)."""
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
    if ROTATE:  # the rows just stored, times R, replace them: the cache gets rotated k
        y1, y2 = _rotate_heads(qkv_ptr + row * s_row, rot_ptr, offs_h, offs_h < NQ + NKV, qkv_ptr.dtype.element_ty,
                               NH_PAD, D, HALF, HALF_PAD)
        tl.store(lo, y1, mask=m)
        tl.store(lo + HALF, y2, mask=m)
    if WRITE:
        slot = tl.load(slot_ptr + row)
        is_k = (offs_h >= NQ) & (offs_h < NQ + NKV)
        km = m & is_k[:, None]
        k_dst = kv_ptr + slot * s_slot + (offs_h[:, None] - NQ) * D + offs_d[None, :]
        offs_v = tl.arange(0, NKV_PAD)
        offs_dv = tl.arange(0, D_PAD)
        vm = (offs_v < NKV)[:, None] & (offs_dv < D)[None, :]
        inner = offs_v[:, None] * D + offs_dv[None, :]
        v = tl.load(qkv_ptr + row * s_row + (NQ + NKV) * D + inner, mask=vm, other=0.0)
        k_sc = sc_ptr + slot * s_scslot + offs_h - NQ
        v_sc = sc_ptr + s_sckv + slot * s_scslot + offs_v
        if QUANT == 0:
            k1 = y1.to(kv_ptr.dtype.element_ty)
            k2 = y2.to(kv_ptr.dtype.element_ty)
            vq = v.to(kv_ptr.dtype.element_ty)
        elif QUANT == 1:
            f1 = tl.where(km, y1.to(tl.float32), 0.0)
            f2 = tl.where(km, y2.to(tl.float32), 0.0)
            absmax = tl.maximum(tl.max(tl.abs(f1), axis=1), tl.max(tl.abs(f2), axis=1))
            k1, ks = _int8_codes(f1, absmax)
            k2 = tl.minimum(tl.maximum((f2 / ks[:, None] + 12582912.0) - 12582912.0, -127.0), 127.0).to(tl.int8)
            fv = tl.where(vm, v.to(tl.float32), 0.0)
            vq, vs = _int8_codes(fv, tl.max(tl.abs(fv), axis=1))
            tl.store(k_sc, ks.to(sc_ptr.dtype.element_ty), mask=is_k)
            tl.store(v_sc, vs.to(sc_ptr.dtype.element_ty), mask=offs_v < NKV)
        else:
            ks = tl.load(k_sc, mask=is_k, other=1.0)[:, None]
            vs = tl.load(v_sc, mask=offs_v < NKV, other=1.0)[:, None]
            k1 = _e4m3_codes(y1, ks, kv_ptr.dtype.element_ty)
            k2 = _e4m3_codes(y2, ks, kv_ptr.dtype.element_ty)
            vq = _e4m3_codes(v, vs, kv_ptr.dtype.element_ty)
        tl.store(k_dst, k1, mask=km)
        tl.store(k_dst + HALF, k2, mask=km)
        tl.store(kv_ptr + s_kv + slot * s_slot + inner, vq, mask=vm)


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  num_heads: int, num_kv_heads: int, head_dim: int, kv_cache=None,
                  slot_mapping: torch.Tensor | None = None, rotation: torch.Tensor | None = None) -> None:
    """RoPE on the q and k parts of a fused qkv projection output [T, (H + 2 KVH) * D], in place, and,
    given a paged cache [2, num_blocks, block_size, KVH, D], the rotated k and the v of each token stored
    at its slot: one launch where torch takes about sixteen (RotaryEmbedding.apply_torch_, write_kv).
    Given an engine.attention.kv_int8.Int8KVCache, the stored rows are quantized in the same launch,
    to the codes and scales its torch write makes from the rotated rows (the ring is the backend's).

    cos/sin are the [max_positions, D] tables with both halves equal; RoPE runs in fp32 and
    rounds once (the torch path rounds after each product in half precision). `rotation`, a [D, D] fp32
    matrix (the backend's key_rotation, D a power of two), then multiplies every q and k head row, as
    engine.attention.key_rotation.rotate does after RoPE: q and k in qkv, and the stored k, are rotated.
    """
    rows = qkv.shape[0]
    if qkv.stride(-1) != 1 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"rope_write_kv needs a row-major fused qkv output, got {tuple(qkv.shape)}")
    rotate = rotation is not None
    if rotate and (rotation.shape != (head_dim, head_dim) or rotation.dtype != torch.float32
                   or not rotation.is_contiguous() or head_dim & (head_dim - 1)):
        raise ValueError(f"rope_write_kv needs a contiguous fp32 [{head_dim}, {head_dim}] rotation and a power-of-two "
                         f"head_dim, got {tuple(rotation.shape)} {rotation.dtype}")
    if rows == 0:
        return
    write = kv_cache is not None
    quant, scales, s_sckv, s_scslot = 0, qkv, 0, 0
    if write and not isinstance(kv_cache, torch.Tensor):  # an 8-bit cache: codes and scales
        scales, s_sckv = kv_cache.scales, kv_cache.scales.stride(0)
        quant, s_scslot = (2, 0) if kv_cache.is_fp8 else (1, num_kv_heads)
        if not kv_cache.is_fp8 and not scales.is_contiguous():
            raise ValueError("rope_write_kv needs contiguous int8 KV scales")
        kv_cache = kv_cache.values
    if write:
        _, _, block_size, kvh, hd = kv_cache.shape
        flat = (kv_cache.stride(-1), kv_cache.stride(-2), kv_cache.stride(-3), kv_cache.stride(-4))
        if (kvh, hd) != (num_kv_heads, head_dim) or flat != (1, hd, kvh * hd, block_size * kvh * hd):
            raise ValueError(f"rope_write_kv needs a contiguous paged cache, got {tuple(kv_cache.shape)}")
    half = head_dim // 2
    min_pad = 16 if rotate else 1  # tl.dot's smallest tile (_rotate_heads), for the rotated variant only
    _rope_kv_kernel[(rows,)](
        qkv, positions, cos, sin, kv_cache if write else qkv, slot_mapping if write else positions, scales,
        rotation if rotate else cos, qkv.stride(0), cos.stride(0), kv_cache.stride(0) if write else 0,
        num_kv_heads * head_dim if write else 0, s_sckv, s_scslot,
        NQ=num_heads, NKV=num_kv_heads, NH_PAD=max(min_pad, triton.next_power_of_2(num_heads + num_kv_heads)),
        NKV_PAD=triton.next_power_of_2(num_kv_heads), D=head_dim, D_PAD=triton.next_power_of_2(head_dim),
        HALF=half, HALF_PAD=max(min_pad, triton.next_power_of_2(half)), WRITE=write, QUANT=quant, ROTATE=rotate,
    )
