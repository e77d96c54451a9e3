"""Sizing and allocating the paged KV pool."""

from __future__ import annotations

import os

import torch

from engine import hugepages
from engine.config import CacheLayout, EngineConfig
from engine.errors import ModelLoadError
from engine.models.config import ModelConfig


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype, cache_bits: int = 16,
                    cache_format: str = "int8") -> int:
    """K and V of one block over all layers: head_dim values of the model's dtype per (row, kv head),
    or with cache_bits 8, head_dim int8 values and one fp16 scale (int8), or head_dim fp8 values (fp8,
    whose per-head scales are a few bytes per layer)."""
    elem = torch.empty((), dtype=dtype).element_size()
    if cache_bits == 8:
        row = model.head_dim + (2 if cache_format == "int8" else 0)
    else:
        row = model.head_dim * elem
    return model.num_layers * 2 * block_size * model.num_kv_heads * row


def window_bytes(model: ModelConfig, window: int, slots: int, dtype: torch.dtype) -> int:
    """The full-precision rings of an int8 cache: `window` rows for each of `slots` sequences."""
    elem = torch.empty((), dtype=dtype).element_size()
    return model.num_layers * 2 * slots * window * model.num_kv_heads * model.head_dim * elem


def device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan_cache_layout(cfg: EngineConfig, model: ModelConfig, device: torch.device, dtype: torch.dtype) -> CacheLayout:
    """The KV pool for `cfg`: num_kv_blocks, else kv_cache_memory_bytes, else max_cache_ratio of the device's memory
    (on the CPU, of cpu_memory_bytes, else of host RAM capped at cpu_kv_cache_cap_bytes). The budget is the pool's
    own: the weights and any packed copies of them are not subtracted from it."""
    from engine.attention.kv_int8 import resolve_cache_format

    cache_format = resolve_cache_format(cfg.cache_format, device) if cfg.cache_bits == 8 else "int8"
    per_block = bytes_per_block(model, cfg.block_size, dtype, cfg.cache_bits, cache_format)
    ring_bytes = window_bytes(model, cfg.kv_fp_window, cfg.max_num_seqs, dtype)
    if cfg.num_kv_blocks is not None:
        num_blocks = cfg.num_kv_blocks
    else:
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        else:
            if device.type == "cpu" and cfg.cpu_memory_bytes is not None:
                budget = int(cfg.cpu_memory_bytes * cfg.max_cache_ratio)
            else:
                budget = int(device_memory_bytes(device) * cfg.max_cache_ratio)
                if device.type == "cuda":
                    budget = min(budget, torch.cuda.mem_get_info(device)[0] - (1 << 30))
                else:
                    budget = min(budget, cfg.cpu_kv_cache_cap_bytes)
        num_blocks = max(0, budget - ring_bytes) // per_block
    if num_blocks < 2:
        raise ModelLoadError(f"the KV budget holds {num_blocks} block(s) of {per_block} bytes; raise the memory budget")
    limit = cfg.max_model_len or model.max_position_embeddings
    if cfg.max_model_len and cfg.max_model_len > model.max_position_embeddings:
        raise ModelLoadError(f"max_model_len {cfg.max_model_len} exceeds the model's "
                             f"{model.max_position_embeddings} positions")
    if model.sliding_window and limit > model.sliding_window:
        limit = model.sliding_window  # we attend over full context, so stay inside the window
    # One request must always fit the pool, or it could wait forever.
    max_model_len = min(limit, num_blocks * cfg.block_size)
    return CacheLayout(num_blocks, cfg.block_size, per_block, max_model_len, device, dtype, cfg.cache_bits,
                       cfg.kv_fp_window, cfg.max_num_seqs if cfg.kv_fp_window else 0, ring_bytes, cache_format)


def allocate_kv_caches(layout: CacheLayout, model: ModelConfig, huge_pages: bool = False) -> list:
    """Every layer's KV cache, zeroed. `huge_pages`: on the CPU, all of them in one region of transparent huge
    pages (engine/hugepages.py), where the host allows it."""
    # One block more than the block manager hands out: block `num_blocks` is scratch,
    # where padded rows (CUDA-graph buckets) write without touching anyone's KV.
    huge = huge_pages and layout.device.type == "cpu"
    if layout.cache_bits == 8:
        from engine.attention.kv_int8 import KV_SCALE_DTYPE, Int8KVCache

        huge = huge and layout.cache_format == "int8"  # fp8 on the CPU is the reference path: plain pages
        caches = [Int8KVCache.allocate(layout.num_blocks + 1, layout.block_size, model.num_kv_heads, model.head_dim,
                                       layout.window, layout.window_slots, layout.dtype, layout.device,
                                       layout.cache_format)
                  for _ in range(model.num_layers)] if not huge else []
        if huge:
            values_shape = (2, layout.num_blocks + 1, layout.block_size, model.num_kv_heads, model.head_dim)
            scales_shape = values_shape[:-1]
            flat = hugepages.zeros([(values_shape, torch.int8), (scales_shape, KV_SCALE_DTYPE)] * model.num_layers)
            for values, scales in zip(flat[::2], flat[1::2], strict=True):
                ring = (torch.zeros(2, layout.window_slots, layout.window, model.num_kv_heads, model.head_dim,
                                    dtype=layout.dtype) if layout.window else None)
                caches.append(Int8KVCache(values, scales, ring))
        return caches
    shape = (2, layout.num_blocks + 1, layout.block_size, model.num_kv_heads, model.head_dim)
    if huge:
        return hugepages.zeros([(shape, layout.dtype)] * model.num_layers)
    return [torch.zeros(shape, dtype=layout.dtype, device=layout.device) for _ in range(model.num_layers)]
