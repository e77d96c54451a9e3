"""Which attention backend runs: by name, or `auto` for the fastest one that works on the device.

Implementations are imported when chosen, so an unused GPU backend's libraries are never loaded.
"""

from __future__ import annotations

import logging

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.int8_backend import CpuPagedInt8AttentionBackend, TorchInt8AttentionBackend
from engine.attention.key_rotation import resolve_key_rotation

log = logging.getLogger(__name__)


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
            from engine.kernels.cpu_build import kernels_available

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


def select_int8_backend(name: str, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int,
                        cache_format: str = "int8", key_rotation: str = "none") -> AttentionBackend:
    """The backend for cache_bits 8 (`cache_format` int8 or fp8, already resolved for the device).

    CUDA: the Triton kernels that read the codes in place (engine/attention/triton_kvq.py), unless
    `torch` asks for the reference. CPU: the C++ kernels for int8 when they build, else the torch
    reference (fp8 always: it dequantizes, so the engine's fp8 numerics run anywhere). `triton` on the
    CPU runs the Triton kernels interpreted (TRITON_INTERPRET=1, tests). `key_rotation` is the
    kv_key_rotation setting; the backend carries the resolved matrix for the model to apply.
    """
    backend = _int8_backend(name, device, num_heads, num_kv_heads, head_dim, cache_format)
    backend.key_rotation = resolve_key_rotation(key_rotation, cache_format, head_dim, device)
    return backend


def _int8_backend(name: str, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int,
                  cache_format: str) -> AttentionBackend:
    if name == "triton" or (device.type == "cuda" and name != "torch" and _triton_ok()):
        if name not in ("auto", "triton"):
            log.warning("attention backend %r does not read an 8-bit KV cache; using the Triton kernels", name)
        from engine.attention.triton_kvq_backend import TritonQuantAttentionBackend

        return TritonQuantAttentionBackend(num_heads, num_kv_heads, head_dim)
    if device.type == "cpu" and name in ("auto", "cpu_paged") and cache_format == "int8":
        from engine.kernels.cpu_build import kernels_available

        if kernels_available():
            return CpuPagedInt8AttentionBackend(num_heads, num_kv_heads, head_dim)
    if name not in ("auto", "torch", "cpu_paged"):
        log.warning("attention backend %r does not read an 8-bit KV cache; using the torch reference", name)
    return TorchInt8AttentionBackend(num_heads, num_kv_heads, head_dim)
