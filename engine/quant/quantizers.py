"""Weight quantizers: int8 and fp8 (E4M3) per output channel (symmetric), int4 per group (asymmetric).

Pure tensor functions, shared by offline quantization, load-time quantization and
the tests. Every function rounds the scales to the dtype they are stored in
*before* computing the integer codes, so what the runtime dequantizes is exactly
what the error search measured.

int4 layout (ours, not torch's tinygemm layout, whose byte order depends on the
CPU's vector width): a row of K codes is stored as K/2 bytes; within each run of
32 inputs, byte j holds input j in its low nibble and input j + 16 in its high
nibble, so one 16-byte load unpacks to 32 consecutive inputs. Each group of G
inputs (a multiple of 32) has an fp16 scale and offset: w = q * scale + offset,
q in [0, 15].
"""

from __future__ import annotations

import torch

INT8_MAX = 127
INT4_LEVELS = 15
INT4_RUN = 32  # inputs per 16-byte run of the packed layout
SCALE_DTYPE_INT4 = torch.float16


def int4_group_size(in_features: int, requested: int = 128) -> int:
    """The group size used for a layer: `requested` when it divides the input width, else the
    largest multiple of 32 below it that does (SmolLM2's 576-wide layers: 96)."""
    if in_features % INT4_RUN:
        raise ValueError(f"int4 needs an input width that is a multiple of {INT4_RUN}, got {in_features}")
    if requested % INT4_RUN or requested < INT4_RUN:
        raise ValueError(f"the int4 group size must be a positive multiple of {INT4_RUN}, got {requested}")
    for g in range(min(requested, in_features), 0, -INT4_RUN):
        if in_features % g == 0:
            return g
    return INT4_RUN


# ---- int8, one scale per output row --------------------------------------------------------------

def int8_scales(weight: torch.Tensor, clip: torch.Tensor | float = 1.0) -> torch.Tensor:
    """fp32 scale per row: clip * max|w| / 127 (clip may be one ratio per row)."""
    absmax = weight.float().abs().amax(dim=1)
    return (absmax * clip / INT8_MAX).clamp(min=torch.finfo(torch.float32).tiny)


def quantize_int8(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch.round(weight.float() / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Codes times their row's scale; also the fp8 dequantization (E4M3 codes convert exactly)."""
    return (qweight.to(dtype) * scales[:, None].to(dtype))


# ---- fp8 (E4M3), one fp32 scale per output row ---------------------------------------------------

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite E4M3 value


def fp8_scales(weight: torch.Tensor, clip: torch.Tensor | float = 1.0) -> torch.Tensor:
    """fp32 scale per row: clip * max|w| / 448 (clip may be one ratio per row)."""
    absmax = weight.float().abs().amax(dim=1)
    return (absmax * clip / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)


def quantize_fp8(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """E4M3 codes, rounded to nearest; values a clip ratio below 1 pushes past 448 saturate."""
    return (weight.float() / scales[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


# The smallest activation scale: a row of zeros quantizes to zeros instead of dividing by zero.
ACT_SCALE_MIN = 1e-12


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations per row (token): (E4M3 codes, fp32 scales [..., 1]), scale = max|x| / 448.
    The torch twin of the Triton kernel engine.quant.triton_kernels.quantize_rows_fp8."""
    xf = x.float()
    s = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_(min=ACT_SCALE_MIN)
    return (xf / s).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s


# ---- int4, one fp16 scale and offset per group of inputs -----------------------------------------

def int4_params(weight: torch.Tensor, group_size: int, clip: torch.Tensor | float = 1.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and offset [N, K/G] (fp16) covering each group's [min, max], narrowed around its
    centre to `clip` of its width (clip may be one ratio per group)."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)
    mn, mx = groups.amin(-1), groups.amax(-1)
    centre, half = (mx + mn) / 2, (mx - mn) / 2 * clip
    lo = centre - half
    scale = (2 * half / INT4_LEVELS).to(SCALE_DTYPE_INT4)
    # A constant group has width 0 (or underflows fp16); a zero scale would divide by zero below.
    scale = torch.where(scale == 0, torch.full_like(scale, 2**-24), scale)
    return scale, lo.to(SCALE_DTYPE_INT4)


def quantize_int4(weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Codes in [0, 15] as uint8, shape [N, K] (unpacked)."""
    n, k = weight.shape
    g = k // scale.shape[1]
    groups = weight.float().reshape(n, k // g, g)
    q = torch.round((groups - offset.float()[..., None]) / scale.float()[..., None]).clamp_(0, INT4_LEVELS)
    return q.reshape(n, k).to(torch.uint8)


def dequantize_int4_codes(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n, k = codes.shape
    g = k // scale.shape[1]
    w = codes.reshape(n, k // g, g).to(dtype) * scale.to(dtype)[..., None] + offset.to(dtype)[..., None]
    return w.reshape(n, k)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes in [0, 15] -> [N, K/2] bytes in the run-of-32 layout (see the module doc)."""
    n, k = codes.shape
    runs = codes.to(torch.uint8).reshape(n, k // INT4_RUN, 2, INT4_RUN // 2)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: [N, K/2] bytes -> [N, K] codes."""
    n, half = packed.shape
    runs = packed.reshape(n, half * 2 // INT4_RUN, 1, INT4_RUN // 2)
    return torch.cat((runs & 0x0F, runs >> 4), dim=2).reshape(n, half * 2)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequantize_int4_codes(unpack_int4(packed), scale, offset, dtype)
