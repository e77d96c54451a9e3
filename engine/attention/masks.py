"""Dense boolean masks for the mask policies (True = may attend).

The torch backend uses these directly; faster backends must match them, and
the tests compare every backend against these masks.
"""

from __future__ import annotations

import torch

from engine.attention.metadata import MaskSpec
from engine.transfer import to_device


def build_mask(spec: MaskSpec, q_rows: torch.Tensor, kv_len: int, device: torch.device | None = None) -> torch.Tensor:
    """Mask of shape [len(q_rows), kv_len] for query rows `q_rows` of one sequence."""
    q = q_rows.view(-1, 1)
    k = torch.arange(kv_len, device=device or q_rows.device).view(1, -1)
    causal = k <= q
    if spec.policy == "causal":
        return causal
    if spec.policy == "chunk_bidirectional":
        in_chunk_q = (q >= spec.start) & (q < spec.end)
        in_chunk_k = (k >= spec.start) & (k < spec.end)
        return causal | (in_chunk_q & in_chunk_k)
    if spec.policy == "prefix_bidirectional":
        return causal | ((q < spec.end) & (k < spec.end))
    if spec.policy == "packed_segments":
        starts = to_device(spec.segment_starts or (spec.start,), k.device)
        q_seg = torch.searchsorted(starts, q, right=True) - 1  # -1: shared prefix
        k_seg = torch.searchsorted(starts, k, right=True) - 1
        shared_prefix = k < spec.start
        same_segment = (q_seg == k_seg) & (q >= spec.start)
        return causal & (shared_prefix | same_segment)
    raise ValueError(f"unknown mask policy {spec.policy!r}")


def mask_positions(spec: MaskSpec, rows: torch.Tensor) -> torch.Tensor:
    """RoPE positions for rows: packed segments restart after the shared prefix."""
    if spec.policy != "packed_segments":
        return rows
    starts = to_device(spec.segment_starts or (spec.start,), rows.device)
    seg = torch.searchsorted(starts, rows, right=True) - 1
    seg_start = starts[seg.clamp(min=0)]
    return torch.where(rows >= spec.start, spec.start + rows - seg_start, rows)
