"""Linear layers that pick the fastest CPU path for the batch at hand.

Chosen over SmolLM2's layer shapes with weights streamed from memory (figures and
commands: docs/perf/engine-notes.md, "Linear paths"):
- 1-8 rows: a linear layer only streams its weight; BLAS picks slow paths
  there, so the skinny kernel of the CPU extension runs it at close to memory
  bandwidth;
- 9-256 rows (decode batches): oneDNN's matmul on the plain weight, faster
  than MKL's sgemm, the LM head most of all. oneDNN keeps a
  compiled primitive (0.5-1 MB each) per input shape for the life of the
  process, up to 1024 of them, so every new row count grew the worker by that
  much, for hours (found by the fuzz suite's RSS check). Rows are padded up to
  a few buckets (multiples of 16 to 128, of 32 to 256): 12 shapes per weight,
  all seen in the first minutes of traffic, then RSS is flat;
- more rows (prefill chunks): MKL, which is as fast or faster there.
Only fp32 on the CPU takes the special paths; everything else is F.linear.

With `prepack` (engine option `cpu_prepack_weights`), each weight also gets a
packed copy, which batches of 1-256 rows then read instead of the plain one.
On AVX2 and AVX-512 CPUs that copy is in panels of 32 output columns for the panel
kernel of the CPU extension (engine/models/csrc/panel_gemm.cpp), which runs
a step's linears faster than the paths above at 1-64 rows and as fast at
128-256 (bench/kernels/panel_gemm.py), needs no padding and keeps no per-shape
state; elsewhere it is oneDNN's
blocked layout, so that oneDNN no longer re-lays the weight out on every call.
It costs a second copy of the linear weights in memory; `bench.throughput`
measures what it buys (its table has the engine with and without it). Where a
weight's fp32 values are exactly integer codes times fp16 scales (a GGUF
Q4_0/Q4_1/Q8_0 import), the copy holds the codes instead (engine option
`cpu_compact_weights`, engine/models/compact_weights.py): a sixth to a quarter
of the bytes, the same values and results bit for bit (bench/compact_weights.py).
The engine's default, `cpu_prepack_weights: auto`, keeps only such compact
copies (`prepack(..., only_compact=True)`), never a second fp32 copy.

With `cpu_prefill_dtype: bfloat16` each weight also has a bf16 copy, and in
steps that carry prompt tokens (`prefill_step`) linears of 64 rows or more
multiply it by the rows rounded to bf16, through oneDNN's bf16 matmul with fp32
accumulation: about twice the fp32 GEMM rate on hosts with AVX512-BF16 or AMX.

Batch-invariant mode (deterministic requests) routes every linear to a kernel
whose per-row arithmetic does not depend on the number of rows, at a
throughput cost measured in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu_build import cpu_kernels
from engine.models.compact_weights import is_compact, pack_compact

log = logging.getLogger(__name__)
SKINNY_MAX_ROWS = 8
ONEDNN_MAX_ROWS = 256
# Up to this many rows a panel-packed weight runs the panel kernel; above it MKL is as fast or faster.
PANEL_MAX_ROWS = 256
# The row count oneDNN chooses the packed layout for (any row count can use it).
PACK_HINT_ROWS = 64
_mode = threading.local()
# bf16 prefill (cpu_prefill_dtype): from this many rows; below it the fp32 kernels are as fast.
BF16_MIN_ROWS = 64


@contextlib.contextmanager
def _mode_flag(name: str, enabled: bool):
    """Set one of this thread's linear modes within the block, then restore it."""
    previous = getattr(_mode, name, False)
    setattr(_mode, name, enabled)
    try:
        yield
    finally:
        setattr(_mode, name, previous)


def batch_invariant(enabled: bool = True):
    """Within this block (on this thread), linears compute each row independently of the others."""
    return _mode_flag("invariant", enabled)


def invariant_enabled() -> bool:
    return getattr(_mode, "invariant", False)


def prefill_step(enabled: bool = True):
    """Within this block (on this thread), linears with a bf16 copy run their taller products in bf16."""
    return _mode_flag("prefill", enabled)


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


@cache
def _panel_kernel() -> bool:
    ops = cpu_kernels()
    return ops is not None and ops.panel_gemm_available()


def is_panel_packed(packed: torch.Tensor | None) -> bool:
    """Whether `packed` (from `prepack`) is in the panel kernel's layout: fp32 [panels, in_features, 32]
    or compact uint8 [panels, in_features / 32, block]."""
    return packed is not None and packed.dim() == 3


def prepack(weight: torch.Tensor, compact: bool = True, only_compact: bool = False) -> torch.Tensor | None:
    """`weight` packed for `linear(..., packed=)`: in panels for the panel kernel on AVX2 and AVX-512 CPUs,
    else in oneDNN's blocked layout; None where neither path runs.

    With `compact`, a weight whose fp32 values are exactly integer codes times fp16 scales (a GGUF
    Q4_0/Q4_1/Q8_0 import) gets compact panels instead (engine/models/compact_weights.py): the same
    values, bit for bit, in 16-27% of the bytes. With `only_compact`, any other weight gets None."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or (only_compact and not compact):
        return None
    if _panel_kernel():
        ops = cpu_kernels()
        if compact and (packed := pack_compact(weight, ops.pack_compact_panels, ops.compact_panels_match)) is not None:
            return packed
        return None if only_compact else ops.pack_panels(weight.detach())
    if only_compact or not _onednn_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_HINT_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None, packed: torch.Tensor | None = None,
           bf16: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) by the fastest path for x's rows; with `out`, written there (a workspace).

    `packed` is `prepack(weight)`, read by the panel kernel or the oneDNN path instead of `weight`; a freed
    `weight` (on the meta device, free_plain_weight) is rebuilt from it where another path needs it.
    `bf16` is the weight in bf16 (add_bf16_copies), read instead in prefill steps (`prefill_step`).
    """
    rows = x.shape[0]
    if (bf16 is not None and rows >= BF16_MIN_ROWS and getattr(_mode, "prefill", False) and x.dim() == 2
            and x.dtype == torch.float32 and not invariant_enabled() and not torch.is_grad_enabled()):
        result = _bf16_product(x, bf16, bias)
        return result if out is None else out.copy_(result)
    # A freed weight (free_plain_weight): the panel kernel reads its codes, every other path a rebuild.
    if weight.is_meta and not (rows <= PANEL_MAX_ROWS and x.dim() == 2 and x.device.type == "cpu"
                               and x.dtype == torch.float32 and not torch.is_grad_enabled()
                               and not invariant_enabled()):
        weight = plain_weight(weight, packed)
    if (x.dim() == 2 and x.device.type == "cpu" and weight.dtype == torch.float32 and x.dtype == torch.float32
            and not torch.is_grad_enabled()):
        result = None
        if invariant_enabled():
            ops = cpu_kernels()
            if ops is None:
                raise RuntimeError("deterministic mode needs the CPU kernels, which could not be built")
            result = ops.invariant_linear(x, weight, bias)
        elif rows <= PANEL_MAX_ROWS and is_panel_packed(packed):
            result = cpu_kernels().panel_linear(x, packed, weight.shape[0], bias)
        elif rows <= SKINNY_MAX_ROWS:
            if (ops := cpu_kernels()) is not None:
                result = ops.skinny_linear(x, weight, bias)
        elif rows <= ONEDNN_MAX_ROWS and _onednn_available():
            padded = onednn_bucket(rows)
            if padded != rows:
                xp = x.new_zeros(padded, x.shape[1])
                xp[:rows] = x
                x = xp
            w = weight if packed is None or is_panel_packed(packed) else packed
            result = torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")[:rows]
        if result is not None:
            return result if out is None else out.copy_(result)
    if out is None:
        return F.linear(x, weight, bias)
    if x.dim() != 2:
        return out.copy_(F.linear(x, weight, bias))
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def _bf16_product(x: torch.Tensor, bf16: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ bf16.T in fp32: oneDNN accumulates in fp32 and rounds the product to bf16 once; the bias is added
    in fp32."""
    result = F.linear(x.to(torch.bfloat16), bf16).float()
    return result if bias is None else result.add_(bias)


def plain_weight(weight: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
    """`weight` as fp32 values: itself, or, where it was freed, rebuilt from its compact panels (the same bits)."""
    if not weight.is_meta:
        return weight
    if not is_compact(packed):
        raise RuntimeError(f"linear weight {tuple(weight.shape)} was freed but has no compact panels to rebuild it")
    return cpu_kernels().unpack_compact_panels(packed, weight.shape[0])


def free_plain_weight(module: nn.Module, packed: torch.Tensor) -> int:
    """Replace `module.weight` by a placeholder on the meta device when `packed` holds it exactly (compact
    panels): larger batches and other paths then rebuild it per call (`plain_weight`). Returns the bytes freed."""
    if not is_compact(packed) or module.weight.is_meta:
        return 0
    freed = module.weight.numel() * module.weight.element_size()
    module.weight = nn.Parameter(torch.empty(module.weight.shape, dtype=module.weight.dtype, device="meta"),
                                 requires_grad=False)
    return freed


class Linear(nn.Linear):
    # Set by prepack_linears and add_bf16_copies; deliberately not parameters or buffers, so state dicts stay plain.
    packed: torch.Tensor | None = None
    bf16: torch.Tensor | None = None

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:  # as Embedding.reset_parameters (engine/models/llama.py)
            super().reset_parameters()

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, self.weight, self.bias, out, self.packed, self.bf16)


def prepack_linears(model: nn.Module, compact: bool = True, free_plain: bool = False,
                    only_compact: bool = False) -> int:
    """Give every fp32 CPU `Linear` in `model` its packed weight (`prepack`); returns the bytes added.

    `only_compact`: only the weights that get compact panels; `free_plain`: a weight whose packed copy is
    compact is then freed (`free_plain_weight`); the model's parameters then count only what stays
    (engine.quant.modules.weight_bytes skips freed ones)."""
    added, freed = 0, False
    for module in model.modules():
        if isinstance(module, Linear) and (packed := prepack(module.weight, compact, only_compact)) is not None:
            module.packed = packed
            added += packed_bytes(packed, module.weight)
            if free_plain:
                freed |= free_plain_weight(module, packed) > 0
    if freed:
        return_freed_memory()
    return added


def add_bf16_copies(model: nn.Module) -> int:
    """Give every fp32 CPU `Linear` in `model` a bf16 copy of its weight (a freed one rebuilt from its compact
    panels first), for the bf16 prefill path of `linear`; returns the bytes added."""
    added = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.dtype == torch.float32 and module.weight.device.type in (
                "cpu", "meta"):
            module.bf16 = plain_weight(module.weight, module.packed).to(torch.bfloat16)
            added += module.bf16.numel() * module.bf16.element_size()
    return added


def return_freed_memory() -> None:
    """Ask glibc to hand freed heap pages back to the system (else RSS keeps them for later allocations)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def packed_bytes(packed: torch.Tensor, weight: torch.Tensor) -> int:
    """Memory a packed copy takes: panels (fp32 or compact) are padded to 32 output columns; oneDNN's copy is
    the weight's size."""
    if is_panel_packed(packed):
        return packed.numel() * packed.element_size()
    return weight.numel() * weight.element_size()
