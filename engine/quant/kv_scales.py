"""Static per-head scales of the fp8 KV cache (cache_format: fp8), chosen once at start-up.

The cache stores K after RoPE and V as E4M3 codes of x / scale, one fp32 scale per (layer, K or V, KV
head) (engine/attention/kv_int8.py). With scale 1.0 nothing saturates, but the small values of each
head fall into E4M3's subnormal range (below 2^-6), where fewer than 3 mantissa bits are left. A scale
from the head's calibrated range lifts them out:

- absmax: the head's largest |x| on the calibration text maps to 448, E4M3's largest value;
- mse: per head, the scale of a grid of fractions of absmax/448 whose round trip has the least squared
  error on the calibration rows (it may clip the few largest values).

absmax is the default: its perplexity beats mse's. Either gains little over 1.0 next to what K's 3 mantissa
bits cost, which no scale changes (docs/perf/gpu.md, "8-bit KV caches", and bench/kv_fp8_numerics.py).

NOTE: the scales are written before the engine serves anything and never change afterwards, so a stored
code keeps its meaning and prefix-cache blocks stay valid.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from engine.attention.kv_int8 import FP8_MAX, Int8KVCache, quantize_fp8
from engine.attention.torch_backend import TorchAttentionBackend
from engine.quant.calibration import calibration_sequences, causal_prefill

log = logging.getLogger(__name__)

# A few hundred tokens: a head's range settles quickly, and start-up stays short.
KV_CALIBRATION_TOKENS = 512
KV_CALIBRATION_SEQ_LEN = 256
# NOTE: for values that neither clip nor go subnormal, an fp8 round trip's error repeats with every doubling
# of the scale, so one octave of fractions, (0.5, 1] in 1/16-octave steps, covers what smaller scales give.
MSE_FRACTIONS = tuple(2.0 ** (-i / 16) for i in range(16))


def absmax_scales(x: torch.Tensor) -> torch.Tensor:
    """x [rows, kv_heads, head_dim] -> per head absmax / 448 (1.0 for a head of zeros)."""
    amax = x.float().abs().amax(dim=(0, 2))
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def round_trip_mse(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Per head, the mean squared error of x [rows, kv_heads, head_dim] stored as fp8 with `scales`."""
    x = x.float()
    stored = quantize_fp8(x, scales).float() * scales.view(-1, 1)
    return (stored - x).square().mean(dim=(0, 2))


def mse_scales(x: torch.Tensor) -> torch.Tensor:
    """Per head, the fraction of absmax / 448 (MSE_FRACTIONS) with the least round-trip error on x."""
    base = absmax_scales(x)
    candidates = torch.stack([base * f for f in MSE_FRACTIONS])  # [fractions, kv_heads]
    errors = torch.stack([round_trip_mse(x, s) for s in candidates])
    return candidates.gather(0, errors.argmin(0, keepdim=True))[0]


class _RecordingBackend(TorchAttentionBackend):
    """Full-precision attention that keeps the K (after RoPE and any key rotation) and V rows the cache would store."""

    def __init__(self, like) -> None:
        super().__init__(like.num_heads, like.num_kv_heads, like.head_dim)
        self.key_rotation = like.key_rotation  # the model rotates q and k by the backend's matrix
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def forward(self, q, k, v, kv_cache, meta):
        self.k.append(k.float().clone())
        self.v.append(v.float().clone())
        return super().forward(q, k, v, kv_cache, meta)


@torch.inference_mode()
def collect_kv(model, sequences: list[list[int]], block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's rotated K and V [rows, kv_heads, head_dim] over the sequences, run at full precision.

    Each layer's attention is swapped for a recording torch backend for the duration (the fused RoPE + K/V
    write and the one-call CPU decoder off), then put back as it was."""
    attns = [layer.self_attn for layer in model.layers]
    saved = [(a.backend, a.fused_rope_kv) for a in attns]
    recorders = [_RecordingBackend(a.backend) for a in attns]
    leader = getattr(model, "leader", None)
    try:
        for a, r in zip(attns, recorders, strict=True):
            a.backend, a.fused_rope_kv = r, False
        if leader is not None:
            model.leader = None  # rank 0 of a tensor-parallel group: the ranks already run this themselves
        device = model.norm.weight.device
        for seq in sequences:
            causal_prefill(model, seq, block_size, device)
    finally:
        for a, (backend, fused) in zip(attns, saved, strict=True):
            a.backend, a.fused_rope_kv = backend, fused
        if leader is not None:
            model.leader = leader
    return [(torch.cat(r.k), torch.cat(r.v)) for r in recorders]


def choose_scales(kv: list[tuple[torch.Tensor, torch.Tensor]], method: str) -> torch.Tensor:
    """[layers, 2, kv_heads] fp32 scales from each layer's calibration K and V."""
    pick = {"mse": mse_scales, "absmax": absmax_scales}[method]
    return torch.stack([torch.stack([pick(k), pick(v)]) for k, v in kv])


def calibrate_kv_scales(model, kv_caches: list[Int8KVCache], sequences: list[list[int]], block_size: int,
                        method: str) -> torch.Tensor:
    """Choose and write every fp8 layer cache's scales (this rank's KV heads); returns them [layers, 2, heads]."""
    scales = choose_scales(collect_kv(model, sequences, block_size), method)
    for cache, layer_scales in zip(kv_caches, scales, strict=True):
        cache.scales.copy_(layer_scales)
    return scales


def kv_calibration_sequences(tokenizer, calibration_file: str | Path | None, max_len: int) -> list[list[int]]:
    if tokenizer is None:
        from engine.errors import ModelLoadError

        raise ModelLoadError("kv_scales calibrates on text, so the model folder needs a tokenizer; "
                             "set quantization.kv_scales: unit to keep scales of 1.0")
    return calibration_sequences(tokenizer, calibration_file, min(KV_CALIBRATION_SEQ_LEN, max_len),
                                 KV_CALIBRATION_TOKENS)


def calibrate_at_start(config, layout, model, kv_caches, tokenizer, parallel=None) -> None:
    """The engine's start-up step: with an fp8 KV cache and kv_scales other than unit, calibrate its scales
    (on every tensor-parallel rank, each for its own KV heads, when `parallel` is the rank group)."""
    if layout.cache_bits != 8 or layout.cache_format != "fp8" or config.kv_scales == "unit":
        return
    if tokenizer is None and config.load_format == "dummy":
        # Random weights (benchmarks of a shape): no text to calibrate on, and their numbers mean nothing.
        log.info("fp8 KV scales stay 1.0: random weights and no tokenizer to calibrate with")
        return
    start = time.perf_counter()
    sequences = kv_calibration_sequences(tokenizer, config.calibration_file, layout.max_model_len)
    if parallel is not None:
        parallel.calibrate_kv(sequences, config.kv_scales)
    else:
        calibrate_kv_scales(model, kv_caches, sequences, layout.block_size, config.kv_scales)
    log.info("fp8 KV scales (%s) calibrated on %d tokens in %.2fs", config.kv_scales,
             sum(map(len, sequences)), time.perf_counter() - start)
