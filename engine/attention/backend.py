"""The attention-backend interface (engine/attention/selection.py picks an implementation).

A backend writes the step's new K/V into the paged cache and computes
attention for the flat batch described by `AttentionMetadata`, honouring each
prefill span's `MaskSpec`. The KV cache of one layer is a tensor
[2, num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: str = "abstract"
    # Backends over a plain [2, blocks, block_size, kv_heads, head_dim] cache can leave the K/V write
    # to the model (engine.models.fused_ops.rope_write_kv, fused with RoPE on the GPU), which then
    # sets kv_prewritten on the backend it shares with every layer.
    accepts_prewritten_kv: bool = False
    kv_prewritten: bool = False
    # 8-bit caches: the [D, D] rotation the model applies to q and k after RoPE (engine/attention/key_rotation.py),
    # in the fused RoPE + K/V-write launch where the model uses it.
    key_rotation: torch.Tensor | None = None

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Store k/v at meta.slot_mapping (unless kv_prewritten), then return attention output
        [T, num_heads * head_dim]."""
