"""Fit a loaded model to the machine it runs on, once, at engine start (`tune_model`).

In order: packed weight copies for the CPU's linear kernels, the one-call decoder where those copies allow
it (engine/models/fused_decode.py), the decode-streamed weights moved into huge pages, bf16 weight copies
for prefill steps where asked for, the decoder's row split measured for this machine, the Triton fusions on
CUDA, and the shared MLP activation workspace. None of it changes a result (each step computes the same bits
with or without it) but the bf16 copies: prefill steps' products then round as bf16 does.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from engine import hugepages
from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.kernels.cpu_build import bf16_matmul_isa, host_isa
from engine.models import decode_split, fused_decode
from engine.models.linear import (
    Linear,
    add_bf16_copies,
    free_plain_weight,
    is_panel_packed,
    packed_bytes,
    prepack,
    prepack_linears,
    return_freed_memory,
)
from engine.models.llama import ActivationWorkspace, Embedding, LlamaForCausalLM

log = logging.getLogger(__name__)

# huge_pages "auto": the most seconds an engine start spends faulting in huge pages for the decode-streamed
# weights; a host that must compact memory to find them gets 4 KiB pages for the rest (engine/hugepages.py).
# Enough for a small model's weights on a host with free huge pages (docs/perf/engine-notes.md).
WEIGHTS_HUGE_PAGE_BUDGET_S = 2.0


@dataclass
class PlatformTuning:
    prepacked_bytes: int = 0  # packed weight copies added
    prepack_s: float = 0.0
    decode_split: decode_split.SplitChoice | None = None  # measured at start; None where nothing was measured


def tune_model(model: LlamaForCausalLM, config: EngineConfig, device: torch.device,
               dtype: torch.dtype) -> PlatformTuning:
    tuning = PlatformTuning()
    start = time.perf_counter()
    # "auto": packed copies only where they are compact, a fraction of the weights' bytes (linear.prepack).
    if config.cpu_prepack_weights:
        tuning.prepacked_bytes = prepack_weights(model, config.cpu_compact_weights, config.cpu_free_plain_weights,
                                                 only_compact=config.cpu_prepack_weights == "auto")
        fused_decode.install(model)
    tuning.prepack_s = time.perf_counter() - start
    if tuning.prepacked_bytes:
        log.info("packed weight copies: %.0f MiB in %.1f s", tuning.prepacked_bytes / 2**20, tuning.prepack_s)
    if config.huge_pages and device.type == "cpu":
        start = time.perf_counter()
        # "auto" bounds the time spent finding huge pages; the rest of the weights keep 4 KiB pages.
        budget = WEIGHTS_HUGE_PAGE_BUDGET_S if config.huge_pages == "auto" else None
        moved, huge = move_decode_weights_to_huge_pages(model, budget)
        if moved:
            log.info("weights a decode step streams: %.0f MiB moved in %.2f s, %.0f MiB of them in huge pages%s",
                     moved / 2**20, time.perf_counter() - start, huge / 2**20,
                     "" if huge >= moved else f" (the host took over {budget} s to find them; the rest "
                     "keep 4 KiB pages)")
    if config.cpu_prefill_dtype == "bfloat16":
        added = add_bf16_prefill_copies(model, device, dtype)
        log.info("bf16 copies of the linear weights for prefill steps: %.0f MiB", added / 2**20)
    fused = model.fused_decoder
    if isinstance(config.cpu_decode_split_rows, int):
        if fused is not None:
            fused.split_rows = config.cpu_decode_split_rows
    elif torch.get_num_threads() >= 2 and fused is not None:
        c = tuning.decode_split = fused.choose_split()
        log.info("one-call decoder: a group of rows per thread from %d rows a thread (fp32 GEMM %.0f GFLOP/s, "
                 "packed weights streamed at %.1f GB/s, %.2f bytes a weight; measured in %.2f s)",
                 c.rows, c.gemm_gflops, c.stream_gbps, c.bytes_per_weight, c.seconds)
    if device.type == "cuda" and config.gpu_fused_kernels:
        model.enable_triton_fusions()
    if 0 < config.activation_chunk_rows < config.max_num_batched_tokens:
        mc = model.config
        model.use_workspace(ActivationWorkspace(config.activation_chunk_rows, mc.hidden_size,
                                                mc.intermediate_size, dtype, device))
    return tuning


def prepack_weights(model: LlamaForCausalLM, compact: bool = True, free_plain: bool = False,
                    only_compact: bool = False) -> int:
    """Packed copies of the fp32 CPU linear weights (linear.prepack), the tied LM head included; bytes added.
    `compact`: exact compact panels where a weight allows them (engine/models/compact_weights.py);
    `only_compact`: no copy for the other weights; `free_plain`: then free the fp32 weights that compact
    panels hold, the tied embedding table included (token lookups rebuild their rows: Embedding.forward)."""
    added = prepack_linears(model, compact, free_plain, only_compact)
    # A tied LM head with plain weights (a quantized table has its own kernels).
    if (model.lm_head is None and type(model.embed_tokens) is Embedding
            and (packed := prepack(model.embed_tokens.weight, compact, only_compact)) is not None):
        model.embed_tokens.packed_head = packed
        added += packed_bytes(packed, model.embed_tokens.weight)
        if free_plain and free_plain_weight(model.embed_tokens, packed):
            return_freed_memory()
    return added


def add_bf16_prefill_copies(model: LlamaForCausalLM, device: torch.device, dtype: torch.dtype) -> int:
    """cpu_prefill_dtype bfloat16: a bf16 copy of each linear weight (linear.add_bf16_copies); bytes added.
    A start-up error where the products would not run in bf16 hardware, or there is nothing to lower."""
    if device.type != "cpu" or dtype != torch.float32:
        raise ModelLoadError(f"execution.cpu_prefill_dtype: bfloat16 lowers the prefill of fp32 models on the CPU; "
                             f"this engine runs {str(dtype).removeprefix('torch.')} on {device.type} (set float32)")
    if bf16_matmul_isa() is None:
        raise ModelLoadError(
            "execution.cpu_prefill_dtype: bfloat16 needs a CPU with bf16 instructions (AVX512-BF16 or AMX"
            f"{', and INFINILM_CPU_ISA not below avx512' if host_isa() == 'avx512' else ''}); on this one bf16 "
            "products run slower than fp32: set float32")
    return add_bf16_copies(model)


def move_decode_weights_to_huge_pages(model: LlamaForCausalLM,
                                      fault_budget_s: float | None = None) -> tuple[int, int]:
    """Move the weights a CPU decode step streams into one region of transparent huge pages
    (engine/hugepages.py): each linear's panel-packed copy, else its fp32 weight, and the tied LM head's
    (its packed copy, else the table). One tensor at a time, each original freed as its copy lands, so
    the peak is the region plus one tensor. `fault_budget_s`: past it, the rest of the region takes 4 KiB
    pages (HugePageArena). Returns the bytes moved and how many of the region's bytes had huge pages
    asked for as they were faulted in ((0, 0) where huge pages are unavailable)."""
    slots: list[tuple[nn.Module, str]] = []
    for m in model.modules():
        if type(m) is Linear:
            if is_panel_packed(m.packed):
                slots.append((m, "packed"))
            elif m.packed is None and m.weight.device.type == "cpu" and not m.weight.is_meta:
                slots.append((m, "weight"))
    emb = model.embed_tokens
    if model.lm_head is None and type(emb) is Embedding:
        if is_panel_packed(emb.packed_head):
            slots.append((emb, "packed_head"))
        elif emb.packed_head is None and emb.weight.device.type == "cpu" and not emb.weight.is_meta:
            slots.append((emb, "weight"))
    arena = hugepages.arena_for([(getattr(m, a).shape, getattr(m, a).dtype) for m, a in slots], fault_budget_s)
    if arena is None:
        return 0, 0
    moved = 0
    for m, attr in slots:
        old = getattr(m, attr)
        new = arena.take(old.shape, old.dtype).copy_(old)
        setattr(m, attr, nn.Parameter(new, requires_grad=False) if attr == "weight" else new)
        moved += new.numel() * new.element_size()
        del old
    if model.fused_decoder is not None:
        fused_decode.install(model)  # its weight list held the old copies
    return_freed_memory()
    return moved, min(arena.huge_bytes, moved)
