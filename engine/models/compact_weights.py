"""Exact compact copies of fp32 weights whose values are small integer codes times fp16 scales.

A model imported from a GGUF file holds, in fp32, what gguf's dequantize computed: per run of 32
inputs, Q4_1 gives fl(fl(code * d) + m) with 4-bit codes and fp16 d, m; Q8_0 and Q4_0 give
fl(code * d) with 8-bit (or 4-bit, shifted) codes and an fp16 d. Those values are recovered here
from the fp32 tensor alone: per group, the offset is the smallest value, the scale is searched among
the fp16 values next to (largest - smallest) / 15 (or largest magnitude / 127, 8 or 7), and the codes
are the rounded quotients. The panel kernel (engine/models/csrc/panel_gemm.cpp) rebuilds each panel
from the codes with the same two roundings, so it runs on exactly the fp32 values, bit for bit; the
packer checks that by rebuilding the whole weight and comparing its bits, and keeps the fp32 panels
for any weight that does not round-trip. A decode step then streams 0.625 bytes per weight (4-bit
codes) or 1.0625 (8-bit) instead of 4.

A weight with arbitrary fp32 values fails the search on its first rows and costs almost nothing.
"""

from __future__ import annotations

import itertools
import logging

import torch

log = logging.getLogger(__name__)
GROUP = 32  # inputs per code group, as in GGUF's Q4_0, Q4_1 and Q8_0 blocks
COLS = 32  # output columns per panel (panel_gemm.cpp's kCols)
AFFINE4_BLOCK = 64 + 64 + GROUP * 16  # bytes per panel and group: fp16 scales, fp16 offsets, 4-bit codes
SYM8_BLOCK = 64 + GROUP * 32  # fp16 scales, int8 codes
_ULP_STEPS = (0, -1, 1, -2, 2)  # fp16 neighbours of the estimated scale that are tried
_PROBE_ROWS = 64  # rows searched first; a weight that fails there is not searched further


def _fp16_exact(x: torch.Tensor) -> bool:
    return torch.equal(x.to(torch.float16).to(torch.float32).view(torch.int32), x.view(torch.int32))


def _fp16_step(s: torch.Tensor, steps: int) -> torch.Tensor:
    """`s` (non-negative, fp16-representable fp32 values) moved by `steps` fp16 ulps, kept non-negative."""
    if steps == 0:
        return s
    bits = s.to(torch.float16).view(torch.int16).to(torch.int32) + steps
    return bits.clamp(0, 0x7BFF).to(torch.int16).view(torch.float16).to(torch.float32)


def _search(groups: torch.Tensor, offset: torch.Tensor | None, estimates: list[torch.Tensor],
            low: int, high: int, signs: tuple[int, ...] = (1,)) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per group, an fp16 scale and codes in [low, high] that rebuild `groups` [N, G, 32] bit for bit.

    Rebuilt value: fl(code * scale) (+ offset, a second rounding); None if some group has none.
    `estimates` are scale magnitudes; `signs` (-1 too) lets a scale be negative, as Q4_0's can be,
    where a zero code gives -0.0.
    """
    found = torch.zeros((*groups.shape[:-1], 1), dtype=torch.bool)
    scales = torch.zeros(found.shape, dtype=torch.float32)
    codes = torch.zeros(groups.shape, dtype=torch.int16)
    target = groups.view(torch.int32)
    centred = groups - offset if offset is not None else groups
    for estimate in estimates:
        for steps, sign in itertools.product(_ULP_STEPS, signs):
            s = _fp16_step(estimate, steps) * sign
            q = torch.round(centred / torch.where(s != 0, s, torch.ones_like(s))).clamp(low, high)
            # + 0.0 turns a rounded -0.0 into the +0.0 that the kernel's integer code 0 converts to.
            q = torch.where(s != 0, q, torch.zeros_like(q)) + 0.0
            rebuilt = q * s
            if offset is not None:
                rebuilt = rebuilt + offset
            new = (rebuilt.view(torch.int32) == target).all(-1, keepdim=True) & ~found
            scales = torch.where(new, s, scales)
            codes = torch.where(new, q.to(torch.int16), codes)
            found |= new
            if bool(found.all()):
                return scales.squeeze(-1), codes
    return None


def _affine4(groups: torch.Tensor):
    offset = groups.amin(-1, keepdim=True)
    if not _fp16_exact(offset):
        return None
    estimate = ((groups.amax(-1, keepdim=True) - offset) / 15).to(torch.float16).to(torch.float32)
    found = _search(groups, offset, [estimate], 0, 15)
    return None if found is None else (found[0], offset.squeeze(-1), found[1])


def _sym8(groups: torch.Tensor):
    amax = groups.abs().amax(-1, keepdim=True)
    estimates = [(amax / d).to(torch.float16).to(torch.float32) for d in (127, 8, 7)]
    found = _search(groups, None, estimates, -127, 127, signs=(1, -1))
    return None if found is None else (found[0], None, found[1])


def _codes(weight: torch.Tensor):
    """(kind, scales [N, G], offsets [N, G] or None, codes [N, G, 32]) for `weight`, or None."""
    n, k = weight.shape
    if k % GROUP or n == 0 or not bool(torch.isfinite(weight).all()):
        return None
    groups = weight.reshape(n, k // GROUP, GROUP)
    for kind, fn in (("affine4", _affine4), ("sym8", _sym8)):
        if n > _PROBE_ROWS and fn(groups[:_PROBE_ROWS]) is None:
            continue
        if (found := fn(groups)) is not None:
            return (kind, *found)
    return None


def _panels(t: torch.Tensor, n: int) -> torch.Tensor:
    """[N, G, ...] -> [P, G, 32 columns, ...], the columns padded with zeros to a multiple of 32."""
    panels = -(-n // COLS)
    padded = t.new_zeros((panels * COLS, *tuple(t.shape[1:])))
    padded[:n] = t
    return padded.reshape(panels, COLS, *t.shape[1:]).transpose(1, 2)


def pack_compact(weight: torch.Tensor, unpack=None) -> torch.Tensor | None:
    """`weight` [N, K] (fp32) as compact panels, uint8 [panels, K / 32, block], for panel_linear; None
    where its values are not codes times fp16 scales, or where `unpack` (the kernel's own rebuild,
    cpu_kernels().unpack_compact_panels) does not give back every bit."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    weight = weight.detach().contiguous()
    found = _codes(weight)
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
    if unpack is not None and not torch.equal(unpack(packed, n).view(torch.int32), weight.view(torch.int32)):
        log.warning("compact weight %s did not rebuild bit for bit; keeping fp32 panels", tuple(weight.shape))
        return None
    return packed


def is_compact(packed: torch.Tensor | None) -> bool:
    return packed is not None and packed.dtype == torch.uint8 and packed.dim() == 3
