"""Exact compact copies of fp32 weights whose values are small integer codes times fp16 scales.

A model imported from a GGUF file holds, in fp32, what gguf's dequantize computed: per run of 32
inputs, Q4_1 gives fl(fl(code * d) + m) with 4-bit codes and fp16 d, m; Q8_0 and Q4_0 give
fl(code * d) with 8-bit (or 4-bit, shifted) codes and an fp16 d. Those values are recovered here
from the fp32 tensor alone: per group, the offset is the smallest value, the scale is searched among
the fp16 values next to (largest - smallest) / 15 (or largest magnitude / 127, 8 or 7), and the codes
are the rounded quotients (the search is C++, engine/models/csrc/compact_codes.cpp: one pass per group; it
took 1.4 s for SmolLM2-135M's weights as torch ops, 0.3 s there). The panel kernel (engine/models/csrc/panel_gemm.cpp) rebuilds each panel
from the codes with the same two roundings, so it runs on exactly the fp32 values, bit for bit; the
packer checks that by rebuilding the whole weight and comparing its bits, and keeps the fp32 panels
for any weight that does not round-trip. A decode step then streams 0.625 bytes per weight (4-bit
codes) or 1.0625 (8-bit) instead of 4.

A weight with arbitrary fp32 values fails the search on its first rows and costs almost nothing.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)
GROUP = 32  # inputs per code group, as in GGUF's Q4_0, Q4_1 and Q8_0 blocks
COLS = 32  # output columns per panel (panel_gemm.cpp's kCols)
AFFINE4_BLOCK = 64 + 64 + GROUP * 16  # bytes per panel and group: fp16 scales, fp16 offsets, 4-bit codes
SYM8_BLOCK = 64 + GROUP * 32  # fp16 scales, int8 codes
_KINDS = {1: "affine4", 2: "sym8"}  # find_compact_codes' kind numbers


def _codes(weight: torch.Tensor, find):
    """(kind, scales [N, G], offsets [N, G] or None, codes [N, G, 32]) for `weight`, or None; `find` is the
    kernels' search (cpu_kernels().find_compact_codes, engine/models/csrc/compact_codes.cpp)."""
    n, k = weight.shape
    if k % GROUP or n == 0:
        return None
    kind, scales, offsets, codes = find(weight)
    if kind not in _KINDS:
        return None
    return _KINDS[kind], scales, offsets if _KINDS[kind] == "affine4" else None, codes


def _panels(t: torch.Tensor, n: int) -> torch.Tensor:
    """[N, G, ...] -> [P, G, 32 columns, ...], the columns padded with zeros to a multiple of 32."""
    panels = -(-n // COLS)
    padded = t.new_zeros((panels * COLS, *tuple(t.shape[1:])))
    padded[:n] = t
    return padded.reshape(panels, COLS, *t.shape[1:]).transpose(1, 2)


def pack_compact(weight: torch.Tensor, find, unpack) -> torch.Tensor | None:
    """`weight` [N, K] (fp32) as compact panels, uint8 [panels, K / 32, block], for panel_linear; None
    where `find` (the kernels' search, cpu_kernels().find_compact_codes) finds no codes times fp16 scales
    for its values, or where `unpack` (the kernel's own rebuild, cpu_kernels().unpack_compact_panels)
    does not give back every bit."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    weight = weight.detach().contiguous()
    found = _codes(weight, find)
    if found is None:
        return None
    kind, scales, offsets, codes = found
    n = weight.shape[0]
    head = [_panels(scales.to(torch.float16), n).contiguous().view(torch.uint8)]  # [P, G, 64]
    c = _panels(codes, n).transpose(2, 3)  # [P, G, 32 steps, 32 columns]
    if kind == "affine4":
        head.append(_panels(offsets.to(torch.float16), n).contiguous().view(torch.uint8))
        c = c.to(torch.uint8)
        body = (c[..., :16] | (c[..., 16:] << 4)).contiguous()
    else:
        body = c.to(torch.int8).contiguous().view(torch.uint8)
    packed = torch.cat([*head, body.flatten(2)], dim=2).contiguous()
    if not torch.equal(unpack(packed, n).view(torch.int32), weight.view(torch.int32)):
        log.warning("compact weight %s did not rebuild bit for bit; keeping fp32 panels", tuple(weight.shape))
        return None
    return packed


def is_compact(packed: torch.Tensor | None) -> bool:
    return packed is not None and packed.dtype == torch.uint8 and packed.dim() == 3
