"""The attention-backend interface and backend selection.

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


def select_backend(name: str, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int,
                   block_size: int = 16) -> AttentionBackend:
    """`auto` picks the fastest backend that works on the device.

    CUDA: flash-attn when installed (and the block size suits its paged KV), else
    our Triton kernels, else torch. CPU: the C++ paged kernels when they build,
    else torch.
    """
    from engine.attention.torch_backend import TorchAttentionBackend

    if name == "auto":
        if device.type == "cuda":
            from engine.attention.flash_backend import flash_available

            name = "flash_attn" if flash_available(device, block_size) else ("triton" if _triton_ok() else "torch")
        else:
            from engine.attention.cpu_paged import kernels_available

            name = "cpu_paged" if kernels_available() else "torch"
    if name == "cpu_paged":
        from engine.attention.cpu_paged import CpuPagedAttentionBackend

        return CpuPagedAttentionBackend(num_heads, num_kv_heads, head_dim)
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(num_heads, num_kv_heads, head_dim)
    if name == "flash_attn":
        from engine.attention.flash_backend import FlashAttentionBackend

        return FlashAttentionBackend(num_heads, num_kv_heads, head_dim)
    if name == "torch":
        return TorchAttentionBackend(num_heads, num_kv_heads, head_dim)
    raise ValueError(f"unknown attention backend {name!r}; available: auto, torch, cpu_paged, triton, flash_attn")


def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
