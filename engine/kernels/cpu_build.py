"""Build and load the one C++ extension that holds every CPU kernel.

Attention (engine/attention/csrc), quantized linears (engine/quant/csrc) and the model's fused ops
(engine/models/csrc) compile together as one translation unit, cached on disk per machine and source
version. `load_kernels()` raises where it cannot be built (no compiler); `cpu_kernels()` is then None
and callers run the plain torch ops. Callers look functions up on the module at call time, so the
benchmark's profiler labels (bench.throughput --profile) see every call.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)
_ENGINE = Path(__file__).resolve().parents[1]
# Compiled in this order (the int8 attention kernel reuses the fp32 one's helpers).
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


# Caps the instruction set the kernels are built for, e.g. "avx2" on an AVX-512 host to run and test the
# path every other x86 host takes. Unset: the host's best.
ISA_ENV = "INFINILM_CPU_ISA"
ISAS = ("avx512", "avx2", "baseline")


def host_isa() -> str:
    """The best instruction set of this CPU the kernels have a path for."""
    cpu = _cpu_flags()
    if " avx512f" in cpu and " avx512bw" in cpu and " avx512vl" in cpu and " avx512dq" in cpu:
        return "avx512"
    if " avx2" in cpu and " fma" in cpu:
        return "avx2"
    return "baseline"


def target_isa() -> str:
    """The instruction set the kernels are built for: the host's best, or less where INFINILM_CPU_ISA says so.
    Raises ValueError for an unknown name or one this CPU lacks."""
    host = host_isa()
    wanted = os.environ.get(ISA_ENV, "").strip().lower()
    if not wanted:
        return host
    if wanted not in ISAS:
        raise ValueError(f"{ISA_ENV}={wanted!r}: expected one of {', '.join(ISAS)}")
    if ISAS.index(wanted) < ISAS.index(host):
        raise ValueError(f"{ISA_ENV}={wanted!r}, but this CPU's best is {host!r}")
    return wanted


def build_flags() -> list[str]:
    """The compiler flags: native code capped at target_isa(), OpenMP, and ATen's vector width."""
    flags = ["-O3", "-march=native", "-fopenmp"]
    isa, host = target_isa(), host_isa()
    if isa == "avx512":
        flags.append("-DCPU_CAPABILITY_AVX512")
    elif isa == "avx2":
        # -mno-avx512f turns off every AVX-512 subset, so the AVX-512-only kernels compile out.
        flags += (["-mno-avx512f"] if host == "avx512" else []) + ["-DCPU_CAPABILITY_AVX2"]
    elif host != "baseline":
        flags += ["-mno-avx512f", "-mno-avx2", "-mno-fma"]
    return flags


@cache
def load_kernels() -> ModuleType:
    """Build (once per machine and source version, cached on disk) and load the kernel module."""
    from torch.utils.cpp_extension import load_inline

    source = "\n".join(path.read_text() for path in _SOURCES)
    flags = build_flags()
    # NOTE: the name keeps its historical prefix so that builds cached on disk stay valid.
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
        log.warning("CPU kernels unavailable (%s); using the torch ops", exc)
        return False


@cache
def cpu_kernels() -> ModuleType | None:
    """The extension module, or None where it cannot be built."""
    return load_kernels() if kernels_available() else None


def fused_cpu_ok(x: torch.Tensor) -> bool:
    """Whether x takes the fused fp32 CPU kernels: fp32 on the CPU, inference only, kernels built."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled()
            and cpu_kernels() is not None)
