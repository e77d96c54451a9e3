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
    if config.device not in ("auto", "cpu", "cuda"):
        raise InvalidRequestError(f"tensor_parallel_size {n} places rank r on cuda:r; set device to 'cuda', "
                                  f"'cpu' or 'auto', not {config.device!r}")


def check_model(mc: ModelConfig, n: int, weight_bits: int = 16) -> None:
    """`n` must divide the attention heads and the MLP width, and the KV heads must divide `n` or be
    divisible by it (fewer KV heads than ranks: each is replicated on n / num_kv_heads ranks). Quantized
    weights come from a quantized checkpoint, whose int4 groups must not straddle two ranks."""
    if mc.vision is not None:
        # The vision tower would run on rank 0 alone, and its features enter the prefill past the
        # vocabulary-parallel embedding that every rank must run.
        raise ModelLoadError(f"vision-language models do not run with tensor_parallel_size {n} yet; use 1")
    if weight_bits != 16 and not mc.quantization:
        # Load-time quantization calibrates the whole model in one process, which is what TP avoids.
        raise ModelLoadError(f"weight_bits {weight_bits} with tensor_parallel_size {n} quantizes the whole model "
                             "in one process at load time; quantize it once with `infinilm quantize` and serve "
                             "that folder (its weights load sharded)")
    if mc.num_heads % n:
        raise ModelLoadError(f"tensor_parallel_size {n} does not divide the model's {mc.num_heads} attention "
                             f"heads; use a size that does ({_divisors(mc.num_heads)})")
    if mc.num_kv_heads % n and n % mc.num_kv_heads:
        raise ModelLoadError(f"tensor_parallel_size {n} and the model's {mc.num_kv_heads} KV heads: one must "
                             "divide the other, so that each rank holds whole KV heads")
    if mc.intermediate_size % n:
        raise ModelLoadError(f"tensor_parallel_size {n} does not divide the MLP width {mc.intermediate_size}")
    if mc.quantization and mc.quantization.get("quant_method") in ("compressed-tensors", "fp8"):
        raise ModelLoadError(f"{mc.quantization.get('quant_method')} fp8 checkpoints load with tensor_parallel_size 1 "
                             f"for now, not {n}")
    if mc.quantization:
        if weight_bits not in (16, mc.quantization["bits"]):
            raise ModelLoadError(f"the checkpoint holds {mc.quantization['bits']}-bit weights but weight_bits "
                                 f"is {weight_bits}")
        for name, record in mc.quantization["modules"].items():
            width = {"o_proj": mc.num_heads * mc.head_dim, "down_proj": mc.intermediate_size}.get(
                name.rpartition(".")[2])
            if width and record.get("group_size") and (width // n) % record["group_size"]:
                raise ModelLoadError(f"tensor_parallel_size {n} splits {name}'s {width} inputs into "
                                     f"{width // n} per rank, not whole int4 groups of {record['group_size']}")


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
