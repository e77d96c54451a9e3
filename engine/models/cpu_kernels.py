"""The compiled CPU kernels (engine.attention.cpu_paged builds them), for the model's fp32 paths.

`cpu_kernels()` is the extension module, or None where it cannot be built (no compiler): the
callers then run the plain torch ops. Callers look functions up on the module at call time, so
the benchmark's profiler labels (bench.throughput --profile) see every call.
"""

from __future__ import annotations

from functools import cache
from types import ModuleType

import torch


@cache
def cpu_kernels() -> ModuleType | None:
    from engine.attention.cpu_paged import kernels_available, load_kernels

    return load_kernels() if kernels_available() else None


def fused_cpu_ok(x: torch.Tensor) -> bool:
    """Whether x takes the fused fp32 CPU kernels: fp32 on the CPU, inference only, kernels built."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled()
            and cpu_kernels() is not None)
