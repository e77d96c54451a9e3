"""Quantized modules swapped in for the model's linears and embedding table.

Weights live in buffers (int8 codes and fp32 row scales; or packed int4 codes and fp16 group
scales and offsets), so the module owns exactly the bytes it needs. On the CPU with fp32
activations, batches of up to `KERNEL_MAX_ROWS` rows (decode) run the C++ kernels, which read the
quantized weights directly; larger batches (prefill) dequantize the weight a slice at a time and
use the fp32 GEMM, which is faster there (docs/BENCHMARKS.md, "Quantized linear kernels").
Batch-invariant mode always takes the kernel, whose rows never depend on each other.
On CUDA, int8 and int4 weights in bf16/fp16 models run Triton weight-only GEMMs that dequantize
the codes in registers (engine/quant/triton_kernels.py); fp8 weights: engine/quant/fp8.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.models.linear import invariant_enabled, linear
from engine.quant.quantizers import dequantize_int4, dequantize_int8

KERNEL_MAX_ROWS = 64
# Elements of a dequantized weight slice on the fallback path (64 MiB in fp32).
_DEQUANT_SLICE = 1 << 24


def _kernels():
    from engine.kernels.cpu_build import cpu_kernels

    return cpu_kernels()


def _use_kernel(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and not torch.is_grad_enabled()
            and (x.shape[0] <= KERNEL_MAX_ROWS or invariant_enabled()) and _kernels() is not None)


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and not torch.is_grad_enabled()


def _sliced_linear(x: torch.Tensor, n_out: int, bias: torch.Tensor | None,
                   dequant: Callable[[slice, torch.dtype], torch.Tensor]) -> torch.Tensor:
    """x @ W^T with W dequantized `rows` output rows at a time, so no full-precision copy exists."""
    rows = max(1, _DEQUANT_SLICE // max(1, x.shape[-1]))
    if rows >= n_out:
        return linear(x, dequant(slice(0, n_out), x.dtype), bias)
    out = torch.empty(*x.shape[:-1], n_out, dtype=x.dtype, device=x.device)
    for start in range(0, n_out, rows):
        sl = slice(start, min(n_out, start + rows))
        out[..., sl] = linear(x, dequant(sl, x.dtype), None if bias is None else bias[sl])
    return out


class Int8Linear(nn.Module):
    """W8A16: int8 weights with one scale per output channel."""

    bits = 8

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def dequantize(self, rows: slice = slice(None), dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int8(self.qweight[rows], self.scales[rows], dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _use_kernel(x):
            return _kernels().int8_linear(x, self.qweight, self.scales, self.bias)
        if _use_triton(x):
            from engine.quant.triton_kernels import w8a16_linear

            return w8a16_linear(x, self.qweight, self.scales, self.bias)
        return _sliced_linear(x, self.out_features, self.bias, self.dequantize)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits=8"


class Int4Linear(nn.Module):
    """W4A16: 4-bit codes in groups of `group_size` inputs, each group with an fp16 scale and offset."""

    bits = 4

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        groups = in_features // group_size
        self.register_buffer("qweight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(out_features, groups, dtype=torch.float16))
        self.register_buffer("offsets", torch.empty(out_features, groups, dtype=torch.float16))
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def dequantize(self, rows: slice = slice(None), dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_int4(self.qweight[rows], self.scales[rows], self.offsets[rows], dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _use_kernel(x):
            return _kernels().int4_linear(x, self.qweight, self.scales, self.offsets, self.bias)
        if _use_triton(x):
            from engine.quant.triton_kernels import w4a16_linear

            return w4a16_linear(x, self.qweight, self.scales, self.offsets, self.bias)
        return _sliced_linear(x, self.out_features, self.bias, self.dequantize)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits=4, group_size={self.group_size}"


def make_quantized_linear(in_features: int, out_features: int, bias: bool, bits: int,
                          group_size: int | None) -> Int8Linear | Int4Linear:
    if bits == 8:
        return Int8Linear(in_features, out_features, bias)
    if bits == 4:
        assert group_size is not None
        return Int4Linear(in_features, out_features, group_size, bias)
    raise ValueError(f"no quantized linear for {bits} bits")


class QuantizedEmbedding(nn.Module):
    """An embedding table stored quantized by row (vocabulary entry).

    The same table doubles as the LM head when the embeddings are tied: `project` is a
    quantized linear over it, calibrated on the final hidden states.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, bits: int, group_size: int | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.table = make_quantized_linear(embedding_dim, num_embeddings, False, bits, group_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.table
        flat = ids.reshape(-1)
        if isinstance(t, Int8Linear):
            rows = dequantize_int8(t.qweight[flat], t.scales[flat], self.dtype)
        else:
            rows = dequantize_int4(t.qweight[flat], t.scales[flat], t.offsets[flat], self.dtype)
        return rows.view(*ids.shape, self.embedding_dim)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.table(hidden)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of everything the model loads: parameters and persistent buffers (not RoPE tables)."""
    seen: set[int] = set()
    total = 0
    tensors = [p for p in model.parameters()] + [b for _, b in _persistent_buffers(model)]
    for t in tensors:
        if id(t) not in seen and not t.is_meta:  # a freed weight (linear.free_plain_weight) holds no bytes
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _persistent_buffers(model: nn.Module):
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                yield f"{module_name}.{name}", buf
