"""The engine's frozen configuration and the values derived from it at runtime.

`EngineConfig` is what a user sets. `CacheLayout` is what the engine works out
when it starts (how many KV blocks fit); it never writes back into the config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.errors import InvalidRequestError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MASK_POLICIES = ("causal", "chunk_bidirectional", "prefix_bidirectional", "packed_segments")


@dataclass(frozen=True)
class EngineConfig:
    """Everything that shapes one engine instance.

    Memory: the KV pool is `kv_cache_memory_bytes` when set; otherwise
    `max_cache_ratio` of the device's memory (on the CPU, of `cpu_memory_bytes`
    when set, else of the host's RAM capped by `cpu_kv_cache_cap_bytes`).
    `num_kv_blocks` overrides both and is meant for tests that force preemption.
    """

    model: str = "smollm2"
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None
    max_cache_ratio: float = 0.4
    cpu_kv_cache_cap_bytes: int = 2 << 30
    cpu_memory_bytes: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_policy: str = "lru"
    weight_bits: int = 16
    # int4: inputs per quantization group (a layer whose width it does not divide uses less).
    weight_group_size: int = 128
    # Text or JSONL that load-time quantization calibrates on; None: engine/quant/calibration.txt.
    calibration_file: str | None = None
    cache_bits: int = 16
    # cache_bits 8: each sequence's most recent rows kept at full precision as well (0: all int8).
    kv_fp_window: int = 0
    # Keep the embedding table in host memory and gather rows there (saves device memory on CUDA
    # for untied embeddings; on the CPU the bytes are the same).
    embedding_offload: bool = False
    # fp32 on the CPU: keep a packed copy of each linear weight for batches of up to 256 rows (the
    # panel kernel's layout on AVX-512 CPUs, else oneDNN's; engine/models/linear.py): faster decode.
    # true: every such weight, a second copy of the linear weights in memory where they are not
    # compact (below); "auto": only the weights whose copy is compact, 16-27% of their fp32 bytes
    # (nothing for a model with arbitrary fp32 weights, or off AVX-512 CPUs); false: none.
    cpu_prepack_weights: bool | str = "auto"
    # With cpu_prepack_weights: a weight whose fp32 values are exactly integer codes times fp16 scales
    # (a GGUF Q4_0/Q4_1/Q8_0 import) is packed as those codes, and the kernel rebuilds the same values
    # bit for bit (engine/models/compact_weights.py): 16-27% of the bytes, the same outputs.
    cpu_compact_weights: bool = True
    # With compact panels: free the fp32 weights they hold, a tied embedding table included (prefill
    # chunks over 256 rows and deterministic requests rebuild a layer's weight per call, token lookups
    # their rows); SmolLM2's weights drop from 605 MiB (fp32 weights plus the panels) to 92 MiB.
    cpu_free_plain_weights: bool = False
    # CPU: transparent huge pages (2 MiB, asked for with madvise; engine/hugepages.py) for the bytes a decode
    # step streams. "auto": the weights a decode step streams (each linear's packed copy, else its weight,
    # and the LM head's), with at most WEIGHTS_HUGE_PAGE_BUDGET_S (engine_core.py) of engine start spent
    # finding the pages; a single stream of SmolLM2's fp32 panels decodes 1.07-1.10x as fast
    # (bench.single_stream, 2026-12-05 19:07 UTC). true: those weights without a time bound, and the KV cache too (on the dev VM
    # the KV pool could make an engine start up to 18 s slower, where the kernel compacts memory to find
    # the pages, for 1.00-1.03x on decode from batch 16 up: bench.huge_pages; on the AMD VM the KV cache alone
    # gave 0.99-1.03x at batch 32-64 over "auto": bench.huge_pages --kv-only). false: torch's 4 KiB pages.
    huge_pages: bool | str = "auto"
    # CPU, 2+ threads: rows per thread from which the one-call decoder gives each thread its own group of rows,
    # each thread then streaming the whole weight for its rows (engine/models/decode_split.py). "auto": measured
    # at engine start (the fp32 GEMM rate against how fast the threads stream the packed weights, about 0.2 s):
    # 24-25 for fp32 panels on the Intel dev VM, where splitting below that made decode steps 0.82-0.99x as fast
    # (bench.kernels.decode_split); the AMD VM measured the split 1.03-1.06x from 8 rows a thread (MIN_ROWS). An integer
    # >= 1 fixes it.
    cpu_decode_split_rows: int | str = "auto"
    # Prefills longer than this run each layer's MLP in chunks of this many tokens through one
    # preallocated workspace, adding into the residual in place (0: one pass, no workspace). No workspace
    # either where no step can be longer (max_num_batched_tokens). 2048: taller products than 512-row
    # chunks, 1.07x faster prefill steps on the CPU (docs/BENCHMARKS.md, bench.kernels.activation_chunk).
    activation_chunk_rows: int = 2048
    attention_backend: str = "auto"
    num_threads: int | None = None
    seed: int = 0
    # "safetensors" loads the checkpoint; "dummy" fills random weights from config.json
    # alone (benchmarks of model shapes we have no weights for).
    load_format: str = "safetensors"
    # Capture decode steps as CUDA graphs per batch-size bucket (CUDA only).
    cuda_graphs: bool = True
    # CUDA only: the decoder's Triton fusions (residual add + RMSNorm, RoPE + K/V write; see
    # LlamaForCausalLM.enable_triton_fusions). Off only to measure what they save.
    gpu_fused_kernels: bool = True
    # Pipelined scheduling: build and queue step N+1 while the device runs step N, and read step N's
    # tokens (sampling bookkeeping, detokenization, stop strings) while N+1 runs. None: on where the
    # device runs apart from the host (CUDA); on the CPU the forward pass is the host's own time.
    async_scheduling: bool | None = None
    # Deterministic requests prefill in chunks on this fixed grid of rows, so their
    # chunking never depends on what else is scheduled.
    deterministic_chunk: int = 256

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *DTYPES):
            raise InvalidRequestError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if not (self.cpu_prepack_weights is True or self.cpu_prepack_weights is False
                or self.cpu_prepack_weights == "auto"):
            raise InvalidRequestError(f"cpu_prepack_weights must be true, false or 'auto', got {self.cpu_prepack_weights!r}")
        if not (self.huge_pages is True or self.huge_pages is False or self.huge_pages == "auto"):
            raise InvalidRequestError(f"huge_pages must be true, false or 'auto', got {self.huge_pages!r}")
        split = self.cpu_decode_split_rows
        if not (split == "auto" or (isinstance(split, int) and not isinstance(split, bool) and split >= 1)):
            raise InvalidRequestError(f"cpu_decode_split_rows must be 'auto' or an integer >= 1, got {split!r}")
        positive = ("max_num_seqs", "max_num_batched_tokens", "block_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.deterministic_chunk < 1 or self.deterministic_chunk % self.block_size:
            raise InvalidRequestError(
                f"deterministic_chunk ({self.deterministic_chunk}) must be a positive multiple of block_size")
        if self.block_size & (self.block_size - 1):
            raise InvalidRequestError(f"block_size must be a power of two, got {self.block_size}")
        if not 0 < self.max_cache_ratio <= 1:
            raise InvalidRequestError(f"max_cache_ratio must be in (0, 1], got {self.max_cache_ratio}")
        if self.load_format not in ("safetensors", "dummy"):
            raise InvalidRequestError(f"load_format must be safetensors or dummy, got {self.load_format!r}")
        if self.kv_cache_policy != "lru":
            raise InvalidRequestError(f"kv_cache_policy must be 'lru', got {self.kv_cache_policy!r}")
        if self.weight_bits not in (16, 8, 4):
            raise InvalidRequestError(f"weight_bits must be 16, 8 or 4, got {self.weight_bits}")
        if self.cache_bits not in (16, 8):
            raise InvalidRequestError(f"cache_bits must be 16 or 8, got {self.cache_bits}")
        if self.weight_group_size < 32 or self.weight_group_size % 32:
            raise InvalidRequestError(f"weight_group_size must be a positive multiple of 32, got {self.weight_group_size}")
        if self.kv_fp_window < 0:
            raise InvalidRequestError(f"kv_fp_window must be >= 0, got {self.kv_fp_window}")
        if self.kv_fp_window and self.cache_bits != 8:
            raise InvalidRequestError("kv_fp_window keeps recent rows of an int8 KV cache at full precision; "
                                      "it needs cache_bits: 8")
        if self.activation_chunk_rows < 0:
            raise InvalidRequestError(f"activation_chunk_rows must be >= 0 (0: off), got {self.activation_chunk_rows}")
        if self.cpu_memory_bytes is not None and self.cpu_memory_bytes < 1:
            raise InvalidRequestError(f"cpu_memory_bytes must be positive, got {self.cpu_memory_bytes}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise InvalidRequestError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidRequestError(f"max_model_len must be >= 2, got {self.max_model_len}")

    def replace(self, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_options(cls, **options: object) -> EngineConfig:
        """Build from keyword options, with a clear error for unknown names."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**options)  # type: ignore[arg-type]


@dataclass(frozen=True)
class CacheLayout:
    """The KV pool as sized at start-up."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    cache_bits: int = 16
    # cache_bits 8 with a full-precision window: rows per sequence, sequences held, and their bytes.
    window: int = 0
    window_slots: int = 0
    window_bytes: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size
