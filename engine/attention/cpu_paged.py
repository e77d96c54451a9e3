"""CPU attention backend whose decode path reads the paged cache directly.

The batched torch path gathers every sequence's K/V into a padded copy before
SDPA, which doubles the memory traffic of decode, the phase where attention
costs most. This backend runs a small C++ kernel (built by engine/kernels/cpu_build.py,
vectorised with ATen's Vectorized<float>) that walks each sequence's block
table instead. Causal prefill chunks over an fp32 cache run the extension's
prefill kernel (prefill_attention_cpu.cpp), which also reads K/V in place, so a
chunk after cached rows needs no gather and no dense mask; other mask policies
and dtypes take the torch path. When no compiler is available the engine falls
back to the torch backend.
"""

from __future__ import annotations

import torch

from engine.attention.metadata import AttentionMetadata, PrefillSpan
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels.cpu_build import load_kernels


class CpuPagedAttentionBackend(TorchAttentionBackend):
    name = "cpu_paged"
    accepts_prewritten_kv = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self._ops = load_kernels()

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self._ops.paged_decode_attention(q, kv_cache, meta.decode_block_tables, meta.decode_seq_lens,
                                                self.scale)

    def _prefill(self, q, k, v, kv_cache, span: PrefillSpan, out: torch.Tensor | None = None) -> torch.Tensor:
        if prefill_kernel_applies(q, span, self.head_dim) and kv_cache.dtype == torch.float32:
            out = kernel_output(q, out)
            self._ops.paged_prefill_attention(out, q, kv_cache, span.block_table, span.num_cached, self.scale)
            return out
        return super()._prefill(q, k, v, kv_cache, span)


def kernel_output(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Where a C++ prefill kernel writes (a contiguous [T, H, D] fp32 tensor): `out`, the chunk's rows of the
    step's output, when it is one; else a new tensor."""
    if out is not None and out.shape == q.shape and out.dtype == torch.float32 and out.is_contiguous():
        return out
    return torch.empty(q.shape, dtype=q.dtype)


def prefill_kernel_applies(q: torch.Tensor, span: PrefillSpan, head_dim: int) -> bool:
    """The C++ prefill kernels take causal chunks of fp32 queries whose heads are dense (rows may be strided)."""
    return (span.mask.is_causal and q.dtype == torch.float32 and q.device.type == "cpu"
            and q.stride(2) == 1 and q.stride(1) == head_dim)
