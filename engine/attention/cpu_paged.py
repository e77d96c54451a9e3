"""CPU attention backend whose decode path reads the paged cache directly.

The batched torch path gathers every sequence's K/V into a padded copy before
SDPA, which doubles the memory traffic of decode, the phase where attention
costs most. This backend compiles a small C++ kernel (torch's cpp_extension,
vectorised with ATen's Vectorized<float>) that walks each sequence's block
table instead. Causal prefill chunks over an fp32 cache run the extension's
prefill kernel (prefill_attention_cpu.cpp), which also reads K/V in place, so a
chunk after cached rows needs no gather and no dense mask; other mask policies
and dtypes take the torch path. When no compiler is available the engine falls
back to the torch backend.
"""

from __future__ import annotations

import hashlib
import logging
import platform
from functools import cache
from pathlib import Path

import torch

from engine.attention.metadata import AttentionMetadata, PrefillSpan
from engine.attention.torch_backend import TorchAttentionBackend

log = logging.getLogger(__name__)
_ENGINE = Path(__file__).resolve().parents[1]
# One extension for every CPU kernel, compiled as one translation unit in this order (the int8
# attention kernel reuses the fp32 one's helpers).
_SOURCES = (
    _ENGINE / "attention" / "csrc" / "paged_attention_cpu.cpp",
    _ENGINE / "attention" / "csrc" / "paged_attention_int8_cpu.cpp",
    _ENGINE / "attention" / "csrc" / "prefill_attention_cpu.cpp",
    _ENGINE / "quant" / "csrc" / "quant_linear_cpu.cpp",
    _ENGINE / "models" / "csrc" / "fused_cpu.cpp",
    _ENGINE / "models" / "csrc" / "panel_gemm.cpp",
    _ENGINE / "models" / "csrc" / "compact_codes.cpp",
    _ENGINE / "models" / "csrc" / "decode_layers.cpp",
)
_FUNCTIONS = ["paged_decode_attention", "skinny_linear", "invariant_linear", "paged_decode_attention_int8",
              "int8_linear", "int4_linear", "rms_norm_rows", "add_rms_norm_rows", "rope_rows_", "silu_mul_rows_",
              "panel_gemm_available", "pack_panels", "panel_linear", "unpack_compact_panels", "compact_rows",
              "pack_compact_panels", "compact_panels_match", "decode_layers", "stream_read_all",
              "decode_row_groups", "argmax_rows", "paged_prefill_attention", "paged_prefill_attention_int8"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build_flags() -> list[str]:
    flags = ["-O3", "-march=native", "-fopenmp"]
    cpu = _cpu_flags()
    if " avx512f" in cpu and " avx512bw" in cpu and " avx512vl" in cpu and " avx512dq" in cpu:
        flags.append("-DCPU_CAPABILITY_AVX512")
    elif " avx2" in cpu and " fma" in cpu:
        flags.append("-DCPU_CAPABILITY_AVX2")
    return flags


@cache
def load_kernels():
    """Build (once per machine and source version, cached on disk) and load the kernel module."""
    from torch.utils.cpp_extension import load_inline

    source = "\n".join(path.read_text() for path in _SOURCES)
    flags = _build_flags()
    digest = hashlib.sha1((source + " ".join(flags) + _cpu_flags() + torch.__version__).encode()).hexdigest()[:12]
    return load_inline(
        name=f"infinilm_paged_attention_cpu_{digest}",
        cpp_sources=[source],
        functions=_FUNCTIONS,
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


def kernels_available() -> bool:
    try:
        load_kernels()
        return True
    except Exception as exc:  # a missing compiler or headers: fall back, but say why
        log.warning("CPU paged-attention kernel unavailable (%s); using the torch backend", exc)
        return False


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
