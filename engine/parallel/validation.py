"""Start-up checks for tensor_parallel_size: the settings it cannot run with, and the model and devices
it needs. Every failure names the setting and says what would work."""

from __future__ import annotations

import torch

from engine.errors import InvalidRequestError, ModelLoadError
from engine.models.config import ModelConfig


def check_engine_config(config) -> None:
    """The settings that do not combine with tensor_parallel_size > 1 (an EngineConfig)."""
    n = config.tensor_parallel_size
    if config.async_scheduling:
        raise InvalidRequestError(f"tensor_parallel_size {n} runs steps synchronously (rank 0 hands each step's "
                                  "inputs to the other ranks); set async_scheduling to false or leave it unset")
    if config.embedding_offload:
        raise InvalidRequestError(f"embedding_offload does not combine with tensor_parallel_size {n}: the "
                                  "embedding table is already split across the ranks")
    if config.weight_bits != 16:
        raise InvalidRequestError(f"weight_bits {config.weight_bits} with tensor_parallel_size {n} is not "
                                  "supported yet: quantized linears are not sharded; use weight_bits: 16")
    if config.device not in ("auto", "cpu", "cuda"):
        raise InvalidRequestError(f"tensor_parallel_size {n} places rank r on cuda:r; set device to 'cuda', "
                                  f"'cpu' or 'auto', not {config.device!r}")


def check_model(mc: ModelConfig, n: int) -> None:
    """`n` must divide the attention heads and the MLP width, and the KV heads must divide `n` or be
    divisible by it (fewer KV heads than ranks: each is replicated on n / num_kv_heads ranks)."""
    if mc.quantization:
        raise ModelLoadError(f"a quantized checkpoint with tensor_parallel_size {n} is not supported yet")
    if mc.num_heads % n:
        raise ModelLoadError(f"tensor_parallel_size {n} does not divide the model's {mc.num_heads} attention "
                             f"heads; use a size that does ({_divisors(mc.num_heads)})")
    if mc.num_kv_heads % n and n % mc.num_kv_heads:
        raise ModelLoadError(f"tensor_parallel_size {n} and the model's {mc.num_kv_heads} KV heads: one must "
                             "divide the other, so that each rank holds whole KV heads")
    if mc.intermediate_size % n:
        raise ModelLoadError(f"tensor_parallel_size {n} does not divide the MLP width {mc.intermediate_size}")


def check_devices(device: torch.device, n: int) -> None:
    """On CUDA, rank r runs on cuda:r: `n` visible devices are needed."""
    if device.type != "cuda":
        return
    found = torch.cuda.device_count()
    if found < n:
        raise ModelLoadError(f"tensor_parallel_size {n} needs {n} visible CUDA devices, found {found} "
                             "(check CUDA_VISIBLE_DEVICES and the container's device ids)")


def _divisors(k: int) -> str:
    return ", ".join(str(d) for d in range(1, k + 1) if k % d == 0)
