"""Linear layers that route small decode batches to a bandwidth-bound kernel.

With 1-8 rows a linear layer only streams its weight; BLAS picks slow paths
there (measured: about half the bandwidth of a plain reduction), so fp32 CPU
calls with few rows go to the skinny kernel of the CPU extension instead.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

SKINNY_MAX_ROWS = 8


@cache
def _skinny_kernel():
    from engine.attention.cpu_paged import kernels_available, load_kernels

    return load_kernels().skinny_linear if kernels_available() else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if (x.dim() == 2 and x.shape[0] <= SKINNY_MAX_ROWS and x.device.type == "cpu"
            and weight.dtype == torch.float32 and x.dtype == torch.float32 and not torch.is_grad_enabled()):
        kernel = _skinny_kernel()
        if kernel is not None:
            return kernel(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
