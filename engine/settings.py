"""The engine's settings, declared once, in the groups config.yaml holds them in.

Each group is a frozen msgspec struct whose field names are config.yaml's keys
(`model.name`, `memory.kv_cache_bytes`, ...). The service config embeds them as
its `model`, `execution`, `memory` and `quantization` sections; `EngineConfig`
(engine/config.py) is built from them and reads them under the engine's names.
Decoding validates a group's types and bounds; `__post_init__` adds the checks
a type cannot express. This module imports no torch, so loading a config is cheap.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from engine.errors import InvalidRequestError

# `extra["unit"]` tells a config loader that text such as "2GiB" may stand for the number.
Bytes = Annotated[int, msgspec.Meta(ge=1, extra={"unit": "bytes"})]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]


def require(ok: bool, key: str, message: str) -> None:
    """Raise InvalidRequestError("key: message") unless ok; a config loader prefixes the section."""
    if not ok:
        raise InvalidRequestError(f"{key}: {message}")


class Settings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every config group: frozen, keyword-only, unknown keys are errors."""


class ModelSettings(Settings):
    """Which model, in which dtype, on which device. `max_seq_len` None: the model's own context."""

    # A model alias (`infinilm model prepare smollm2`), a Hugging Face folder or a .gguf file.
    name: NonEmptyStr = "smollm2"
    # auto: bfloat16 on a GPU, float32 on the CPU. Kept equal to engine.config.DTYPES.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"
    max_seq_len: Annotated[int, msgspec.Meta(ge=2)] | None = None

    def __post_init__(self) -> None:
        require(bool(re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device)), "device",
                f"expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")


class ExecutionSettings(Settings):
    """Continuous batching: how many sequences run at once and the token budget of one step."""

    max_num_seqs: PositiveInt = 64
    max_num_batched_tokens: PositiveInt = 2048
    # Torch CPU threads; None leaves torch's default.
    num_threads: PositiveInt | None = None
    # CPU, 2+ threads: rows per thread from which the one-call decoder gives each thread its own group of
    # rows, each thread then streaming the whole weight for its rows (engine/models/decode_split.py).
    # "auto": measured at engine start, about 0.2 s (docs/perf/config-notes.md); an integer fixes it.
    cpu_decode_split_rows: PositiveInt | Literal["auto"] = "auto"
    # CPU, fp32 models: the dtype the linears of steps that carry prompt tokens multiply in. bfloat16 keeps a
    # bf16 copy of each linear weight (half its fp32 bytes) and runs those products through oneDNN at about
    # twice the fp32 rate, within bf16 rounding of the fp32 results; it needs bf16 instructions (AVX512-BF16
    # or AMX). Decode-only steps, the LM head and deterministic requests keep fp32 (engine/models/linear.py).
    cpu_prefill_dtype: Literal["float32", "bfloat16"] = "float32"
    # CUDA only: decode steps replayed from CUDA graphs captured per batch-size bucket.
    cuda_graphs: bool = True
    # Pipelined scheduling: build and queue step N+1 while the device runs step N, and read step N's
    # tokens while N+1 runs. None: on where the device runs apart from the host (CUDA), off on the CPU,
    # where the forward pass is the host's own time.
    async_scheduling: bool | None = None


class MemorySettings(Settings):
    """The KV cache and the weights' memory layout.

    The KV pool is `kv_cache_bytes` when set; otherwise `max_cache_ratio` of the
    device's memory (on the CPU, of `cpu_memory_bytes` when set, else of host RAM
    capped at 2 GiB). Prefix-cache blocks no request holds are evicted least
    recently used first (`kv_cache_policy: lru`).
    """

    kv_cache_policy: Literal["lru"] = "lru"
    max_cache_ratio: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.4
    kv_cache_bytes: Bytes | None = None
    cpu_memory_bytes: Bytes | None = None
    block_size: PositiveInt = 16
    enable_prefix_caching: bool = True
    # Keep the embedding table in host memory and gather rows there (saves device memory on CUDA
    # for untied embeddings; on the CPU the bytes are the same).
    embedding_offload: bool = False
    # Prefills longer than this run each layer's MLP in chunks of this many tokens through one
    # preallocated workspace, adding into the residual in place (0: one pass, no workspace). No workspace
    # either where no step can be longer (max_num_batched_tokens). 2048 rather than 512: taller products,
    # faster prefill steps (docs/perf/config-notes.md).
    activation_chunk_rows: NonNegativeInt = 2048
    # fp32 on the CPU: keep a packed copy of each linear weight for batches of up to 256 rows (the panel
    # kernel's layout on AVX2 and AVX-512 CPUs, else oneDNN's; engine/models/linear.py): faster decode. true: every
    # such weight, a second copy where it is not compact (below); "auto": only the weights whose copy is
    # compact (nothing for a model with arbitrary fp32 weights, or on CPUs without AVX2); false: none.
    cpu_prepack_weights: bool | Literal["auto"] = "auto"
    # With cpu_prepack_weights: a weight whose fp32 values are exactly integer codes times fp16 scales
    # (a GGUF Q4_0/Q4_1/Q8_0 import) is packed as those codes, and the kernel rebuilds the same values
    # bit for bit (engine/models/compact_weights.py): a sixth to a quarter of the bytes, the same outputs.
    cpu_compact_weights: bool = True
    # With compact panels: free the fp32 weights they hold, a tied embedding table included (prefill
    # chunks over 256 rows and deterministic requests rebuild a layer's weight per call, token lookups
    # their rows).
    cpu_free_plain_weights: bool = False
    # CPU: transparent huge pages (2 MiB, asked for with madvise; engine/hugepages.py) for the bytes a
    # decode step streams. "auto": the weights a decode step streams (each linear's packed copy, else its
    # weight, and the LM head's), spending at most WEIGHTS_HUGE_PAGE_BUDGET_S (platform_tuning.py) of engine
    # start finding the pages. true: those weights without a time bound, and the KV cache too, which can
    # make engine start much slower for little decode gain (docs/perf/config-notes.md). false: 4 KiB pages.
    huge_pages: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        require(self.block_size & (self.block_size - 1) == 0, "block_size",
                f"must be a power of two, got {self.block_size}")


class QuantizationSettings(Settings):
    """Weight and KV-cache precision."""

    weight_bits: Literal[16, 8, 4] = 16
    # weight_bits 8: fp8 (E4M3 weights, activations scaled per token: W8A8 on CUDA sm_89+) or int8
    # (weight-only). auto: fp8 where the GPU multiplies fp8 (sm_89+), int8 elsewhere, the CPU included.
    weight_format: Literal["auto", "fp8", "int8"] = "auto"
    # fp8 weights: which linears also round their activations to E4M3 per token (W8A8) rather than keep
    # them in the model's dtype (W8A16 on the same fp8 bytes). all, none, or auto: the layer roles whose
    # rounding costs the most on the calibration data, up to 30% of the weight bytes
    # (engine/quant/fp8_activations.py); a saved fp8 checkpoint keeps its own choice under auto.
    fp8_activations: Literal["auto", "all", "none"] = "auto"
    # int4: inputs per quantization group (a layer whose width it does not divide uses less).
    weight_group_size: Annotated[int, msgspec.Meta(ge=32, multiple_of=32)] = 128
    cache_bits: Literal[16, 8] = 16
    # cache_bits 8: int8 codes with a scale per token and KV head, or fp8 (E4M3) codes with a scale per
    # KV head (engine/attention/kv_int8.py). auto: int8 (fp8 loses more perplexity); fp8 needs
    # CUDA compute capability 8.9+ on a GPU and runs the torch reference on the CPU.
    cache_format: Literal["auto", "fp8", "int8"] = "auto"
    # fp8 KV cache: its static per-head scales, chosen once at start-up on the calibration text
    # (engine/quant/kv_scales.py): absmax (each head's largest value maps to 448), mse (the least
    # round-trip error per head; SmolLM2's perplexity prefers absmax: docs/perf/gpu.md) or unit (1.0).
    kv_scales: Literal["absmax", "mse", "unit"] = "absmax"
    # 8-bit KV cache: q and k rotated after RoPE by a Hadamard matrix, so the cache stores rotated keys
    # (engine/attention/key_rotation.py); auto: for fp8 caches (power-of-two head_dim), not int8's.
    kv_key_rotation: Literal["auto", "hadamard", "none"] = "auto"
    # cache_bits 8: each sequence's most recent rows kept at full precision as well (0: all int8).
    kv_fp_window: NonNegativeInt = 0
    # Text or JSONL that load-time quantization and fp8 KV scales calibrate on; None: engine/quant/calibration.txt.
    calibration_file: NonEmptyStr | None = None

    def __post_init__(self) -> None:
        if self.calibration_file is not None:
            path = Path(self.calibration_file).expanduser()
            require(path.is_file(), "calibration_file", f"file {self.calibration_file} does not exist")
            # Normalized while the struct is built, so every reader sees the same absolute-or-given path.
            msgspec.structs.force_setattr(self, "calibration_file", str(path))
        require(self.weight_format == "auto" or self.weight_bits == 8, "weight_format",
                f"{self.weight_format} is an 8-bit weight format; it needs weight_bits: 8, got {self.weight_bits}")
        require(self.fp8_activations == "auto" or (self.weight_bits == 8 and self.weight_format != "int8"),
                "fp8_activations", f"{self.fp8_activations} chooses the activations of fp8 weights; it needs "
                f"weight_bits: 8 and weight_format fp8 or auto, got {self.weight_bits} and {self.weight_format}")
        require(self.kv_fp_window == 0 or self.cache_bits == 8, "kv_fp_window",
                "keeps recent rows of an int8 KV cache at full precision; it needs cache_bits: 8")
        require(self.cache_format == "auto" or self.cache_bits == 8, "cache_format",
                f"{self.cache_format} is the format of an 8-bit KV cache; it needs cache_bits: 8")
        require(self.kv_scales == "absmax" or (self.cache_bits == 8 and self.cache_format in ("fp8", "auto")),
                "kv_scales", f"{self.kv_scales} sets the scales of an fp8 KV cache; it needs cache_bits: 8 and "
                f"cache_format: fp8, got {self.cache_bits} and {self.cache_format}")
        require(self.kv_key_rotation != "hadamard" or self.cache_bits == 8, "kv_key_rotation",
                "hadamard rotates the keys an 8-bit KV cache stores; it needs cache_bits: 8")


class SpeculativeSettings(Settings):
    """Speculative decoding (engine/speculative.py). Up to `k` draft tokens a step, verified in the same
    forward pass. `method` prompt_lookup drafts from the request's own tokens, matching its last `n` down to
    `n_min` tokens; draft_model drafts greedily with `draft_model`, a smaller model with the same tokenizer
    (engine/draft_model.py), whose KV cache takes `draft_kv_cache_bytes`. A draft is built from the step
    before's tokens, so it needs synchronous scheduling."""

    method: Literal["prompt_lookup", "draft_model"] | None = None
    k: PositiveInt = 4
    n: PositiveInt = 4
    n_min: PositiveInt = 2
    draft_model: NonEmptyStr | None = None
    draft_kv_cache_bytes: Bytes = 256 << 20

    def __post_init__(self) -> None:
        require(self.n_min <= self.n, "n_min", f"must be <= n ({self.n}), got {self.n_min}")
        require(self.method != "draft_model" or self.draft_model is not None, "draft_model",
                "method draft_model needs draft_model: a model name or folder with the target's tokenizer")
        require(self.draft_model is None or self.method == "draft_model", "draft_model",
                f"is only read with method: draft_model (method is {self.method!r})")


class ParallelSettings(Settings):
    """Tensor parallelism (engine/parallel/): one process per rank on torch.distributed, NCCL on CUDA and
    gloo on the CPU. Rank 0 schedules and samples; the others run the same forward pass on their shard."""

    tensor_parallel_size: PositiveInt = 1
    # A collective that waits longer than this (a rank hung or died) fails the engine instead of waiting.
    collective_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 120.0


class EngineOptions(Settings):
    """Engine settings that config.yaml does not expose: the offline API, tests and benchmarks set them."""

    # The CPU KV pool's cap when it is a ratio of host RAM.
    cpu_kv_cache_cap_bytes: Bytes = 2 << 30
    # A fixed number of KV blocks, overriding the memory settings; for tests that force preemption.
    num_kv_blocks: Annotated[int, msgspec.Meta(ge=2)] | None = None
    attention_backend: Literal["auto", "torch", "cpu_paged", "triton", "flash_attn"] = "auto"
    seed: int = 0
    # "safetensors" loads the checkpoint; "dummy" fills random weights from config.json
    # alone (benchmarks of model shapes we have no weights for).
    load_format: Literal["safetensors", "dummy"] = "safetensors"
    # CUDA only: the decoder's Triton fusions (residual add + RMSNorm, RoPE + K/V write; see
    # LlamaForCausalLM.enable_triton_fusions). Off only to measure what they save.
    gpu_fused_kernels: bool = True
    # Deterministic requests prefill in chunks on this fixed grid of rows, so their
    # chunking never depends on what else is scheduled. A multiple of memory.block_size.
    deterministic_chunk: PositiveInt = 256
