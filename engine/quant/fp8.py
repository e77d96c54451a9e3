"""fp8 (E4M3) weights: W8A8 on GPUs with fp8 tensor cores (compute capability 8.9+), a reference
path with the same numerics elsewhere.

Weights are E4M3 codes with one fp32 scale per output channel. On CUDA sm_89+ each call quantizes
its activations per token (dynamic scales, engine/quant/triton_kernels.py) and multiplies through
torch._scaled_mm with row-wise scales, accumulating in fp32 and writing bf16. Everywhere else (the
CPU, so CI) the reference path computes the same products in full precision: activations rounded
per token to E4M3 and back, weights dequantized a slice at a time. The LM head and the embedding
table stay in the model's dtype.

A layer with `act_fp8` False keeps its activations in the model's dtype (W8A16): on CUDA the Triton
weight-only GEMM reads the same E4M3 codes, elsewhere the reference path skips the rounding. Which
layers: engine/quant/fp8_activations.py.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from engine.errors import InvalidRequestError
from engine.quant.modules import Int8Linear, _sliced_linear, _use_triton
from engine.quant.quantizers import FP8_DTYPE, dequantize_int8, int8_scales, quantize_int8, quantize_rows_fp8

log = logging.getLogger(__name__)
FP8_MIN_CAPABILITY = (8, 9)
# Batches of up to this many rows take the Triton fp8 GEMM instead of torch._scaled_mm (the same
# products). 0: _scaled_mm everywhere, until a GPU run of bench.gpu_weights (its "fp8-triton" rows)
# shows the Triton kernel faster at decode shapes.
TRITON_MAX_ROWS = 0


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def fp8_supported(device: torch.device) -> bool:
    """Whether `device` multiplies fp8 in hardware (CUDA, compute capability 8.9 or later)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= FP8_MIN_CAPABILITY


def resolve_weight_format(requested: str, device: torch.device) -> str:
    """The 8-bit weight format an engine on `device` runs: "fp8" or "int8".

    auto: fp8 where the device multiplies fp8, int8 elsewhere (the CPU keeps its int8 kernels).
    fp8 on a CUDA device below sm_89 is a start-up error; on the CPU it runs the reference path."""
    if requested == "auto":
        return "fp8" if fp8_supported(device) else "int8"
    if requested == "fp8" and device.type == "cuda" and not fp8_supported(device):
        major, minor = _capability(device.index if device.index is not None else torch.cuda.current_device())
        raise InvalidRequestError(
            f"weight_format fp8 needs a GPU of compute capability 8.9 or later (Ada, Hopper, Blackwell); "
            f"{device} is {major}.{minor}: use weight_format int8 or auto")
    if requested not in ("fp8", "int8"):
        raise InvalidRequestError(f"weight_format must be auto, fp8 or int8, got {requested!r}")
    return requested


def _scaled_mm_ok(x: torch.Tensor, k: int, n: int) -> bool:
    # torch._scaled_mm wants both matrix widths in multiples of 16.
    return x.is_cuda and k % 16 == 0 and n % 16 == 0 and fp8_supported(x.device) and not torch.is_grad_enabled()


class Fp8Linear(nn.Module):
    """E4M3 weights with one fp32 scale per output channel. `act_fp8` True: W8A8, activations scaled
    per token; False: W8A16, activations stay in the model's dtype and the codes are dequantized in
    registers by the Triton weight-only GEMM (the same weight bytes read)."""

    bits = 8

    def __init__(self, in_features: int, out_features: int, bias: bool = False, act_fp8: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.act_fp8 = act_fp8
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=FP8_DTYPE))
        self.register_buffer("scales", torch.empty(out_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def dequantize(self, rows: slice = slice(None), dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int8(self.qweight[rows], self.scales[rows], dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.act_fp8:
            if _use_triton(x):
                from engine.quant.triton_kernels import w8a16_linear

                return w8a16_linear(x, self.qweight, self.scales, self.bias)
            return _sliced_linear(x, self.out_features, self.bias, self.dequantize)
        if _scaled_mm_ok(x, self.in_features, self.out_features):
            return self._forward_scaled_mm(x)
        return _sliced_linear(fake_quantize_rows(x), self.out_features, self.bias, self.dequantize)

    def _forward_scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        from engine.quant import triton_kernels

        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        xq, xs = triton_kernels.quantize_rows_fp8(x2)
        if x2.shape[0] <= TRITON_MAX_ROWS:
            out = triton_kernels.w8a8_fp8_linear(xq, xs, self.qweight, self.scales, self.bias)
        else:
            # Row-wise scaling writes bf16 only; the weight's transpose is the column-major operand it wants.
            out = torch._scaled_mm(xq, self.qweight.t(), scale_a=xs, scale_b=self.scales.view(1, -1),
                                   out_dtype=torch.bfloat16)
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        acts = "fp8" if self.act_fp8 else "full"
        return f"in_features={self.in_features}, out_features={self.out_features}, format=fp8, activations={acts}"


def fake_quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded per row (token) to E4M3 with a dynamic scale, and back: what the GPU path multiplies."""
    codes, scales = quantize_rows_fp8(x)
    return (codes.float() * scales).to(x.dtype)


@torch.no_grad()
def fp8_as_int8(model: nn.Module) -> int:
    """Swap every Fp8Linear for an Int8Linear of its dequantized weight (round to nearest, per channel):
    fp8 checkpoints on devices without fp8, where int8 has the fast kernels. Returns how many."""
    swapped = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, Fp8Linear):
            continue
        with torch.device("meta"):  # every tensor is assigned below
            new = Int8Linear(module.in_features, module.out_features, module.bias is not None)
        w = module.dequantize()
        scales = int8_scales(w)
        new.qweight, new.scales = quantize_int8(w, scales), scales
        if module.bias is not None:
            new.bias = module.bias
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
        swapped += 1
    return swapped
