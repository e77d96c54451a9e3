"""Exact compact copies of fp32 weights whose values are small integer codes times fp16 scales.

A model imported from a GGUF file holds, in fp32, what gguf's dequantize computed: per run of 32
inputs, Q4_1 gives fl(fl(code * d) + m) with 4-bit codes and fp16 d, m; Q8_0 and Q4_0 give
fl(code * d) with 8-bit (or 4-bit, shifted) codes and an fp16 d. Those values are recovered here
from the fp32 tensor alone: per group, the offset is the smallest value, the scale is searched among
the fp16 values next to (largest - smallest) / 15 (or largest magnitude / 127, 8 or 7), and the codes
are the rounded quotients (engine/models/csrc/compact_codes.cpp, one pass per group straight into the
panels). The panel kernel (engine/models/csrc/panel_gemm.cpp) rebuilds each panel
from the codes to the same values (Q4_1's code * d is exact in fp32, so one FMA rounds as the add does),
so it runs on exactly the fp32 values, bit for bit; the
packer checks that by rebuilding every panel with the kernel's code and comparing its bits, and keeps the fp32 panels
for any weight that does not round-trip. A decode step then streams 0.625 bytes per weight (4-bit
codes) or 1.0625 (8-bit) instead of 4.

A weight with arbitrary fp32 values fails the search on its first rows and costs almost nothing.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)
GROUP = 32  # inputs per code group, as in GGUF's Q4_0, Q4_1 and Q8_0 blocks
AFFINE4_BLOCK = 64 + 64 + GROUP * 16  # bytes per panel and group: fp16 scales, fp16 offsets, 4-bit codes
SYM8_BLOCK = 64 + GROUP * 32  # fp16 scales, int8 codes


def pack_compact(weight: torch.Tensor, pack, match) -> torch.Tensor | None:
    """`weight` [N, K] (fp32) as compact panels, uint8 [panels, K / 32, block], for panel_linear; None where its
    values are not codes times fp16 scales in one of the two forms (`pack`: cpu_kernels().pack_compact_panels,
    which searches and packs, compact_codes.cpp), or where the panels do not rebuild every bit (`match`:
    cpu_kernels().compact_panels_match, which rebuilds them with the kernel's own code)."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    if weight.shape[1] % GROUP or weight.numel() == 0:
        return None
    weight = weight.detach().contiguous()
    packed = pack(weight)
    if not packed.numel():
        return None
    if not match(packed, weight):
        log.warning("compact weight %s did not rebuild bit for bit; keeping fp32 panels", tuple(weight.shape))
        return None
    return packed


def is_compact(packed: torch.Tensor | None) -> bool:
    return packed is not None and packed.dtype == torch.uint8 and packed.dim() == 3
