"""Linear layers that pick the fastest CPU path for the batch at hand.

Measured on the 2-core dev machine over SmolLM2's layer shapes with weights
streamed from memory (bench numbers in docs/BENCHMARKS.md):
- 1-8 rows: a linear layer only streams its weight; BLAS picks slow paths
  there, so the skinny kernel of the CPU extension runs it at close to memory
  bandwidth (2-4x faster than MKL);
- 9-256 rows (decode batches): oneDNN's matmul on the plain weight is 10-30%
  faster than MKL's sgemm, and about 1.4x on the LM head. oneDNN keeps a
  compiled primitive (0.5-1 MB each) per input shape for the life of the
  process, up to 1024 of them, so every new row count grew the worker by that
  much, for hours (found by the fuzz suite's RSS check). Rows are padded up to
  a few buckets (multiples of 16 to 128, of 32 to 256): 12 shapes per weight,
  all seen in the first minutes of traffic, then RSS is flat;
- more rows (prefill chunks): MKL, which is as fast or faster there.
Only fp32 on the CPU takes the special paths; everything else is F.linear.

Batch-invariant mode (deterministic requests) routes every linear to a kernel
whose per-row arithmetic does not depend on the number of rows, at a
throughput cost measured in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)
SKINNY_MAX_ROWS = 8
ONEDNN_MAX_ROWS = 256
_mode = threading.local()


@contextlib.contextmanager
def batch_invariant(enabled: bool = True):
    """Within this block (on this thread), linears compute each row independently of the others."""
    previous = getattr(_mode, "invariant", False)
    _mode.invariant = enabled
    try:
        yield
    finally:
        _mode.invariant = previous


def invariant_enabled() -> bool:
    return getattr(_mode, "invariant", False)


@cache
def _invariant_kernel():
    from engine.attention.cpu_paged import kernels_available, load_kernels

    return load_kernels().invariant_linear if kernels_available() else None


@cache
def _skinny_kernel():
    from engine.attention.cpu_paged import kernels_available, load_kernels

    return load_kernels().skinny_linear if kernels_available() else None


@cache
def _onednn_available() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        x, w = torch.randn(9, 8), torch.randn(4, 8)
        out = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return bool(torch.allclose(out, F.linear(x, w), atol=1e-5))
    except Exception as exc:  # an unusual build: use plain F.linear
        log.info("oneDNN linear unavailable (%r)", exc)
        return False


def onednn_bucket(rows: int) -> int:
    """The row count a oneDNN linear runs at: one of 12 buckets, so its primitive cache stays small."""
    step = 16 if rows <= 128 else 32
    return -(-rows // step) * step


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) by the fastest path for x's rows; with `out`, written there (a workspace)."""
    rows = x.shape[0]
    if (x.dim() == 2 and x.device.type == "cpu" and weight.dtype == torch.float32 and x.dtype == torch.float32
            and not torch.is_grad_enabled()):
        result = None
        if invariant_enabled():
            kernel = _invariant_kernel()
            if kernel is None:
                raise RuntimeError("deterministic mode needs the CPU kernels, which could not be built")
            result = kernel(x, weight, bias)
        elif rows <= SKINNY_MAX_ROWS:
            kernel = _skinny_kernel()
            if kernel is not None:
                result = kernel(x, weight, bias)
        elif rows <= ONEDNN_MAX_ROWS and _onednn_available():
            padded = onednn_bucket(rows)
            if padded != rows:
                xp = x.new_zeros(padded, x.shape[1])
                xp[:rows] = x
                x = xp
            result = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")[:rows]
        if result is not None:
            return result if out is None else out.copy_(result)
    if out is None:
        return F.linear(x, weight, bias)
    if x.dim() != 2:
        return out.copy_(F.linear(x, weight, bias))
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, self.weight, self.bias, out)
