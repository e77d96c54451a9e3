"""GGUF metadata to config.json and generation_config.json, and the importer's error type."""

from __future__ import annotations

import math
from typing import Any

import gguf
import numpy as np

SUPPORTED_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Consumed into config.json (llama3-style RoPE scaling), not a weight HF models have.
ROPE_FREQS = "rope_freqs.weight"


class GGUFImportError(ValueError):
    """The GGUF file uses something this importer cannot translate faithfully."""


class GGUFMetadata:
    """The GGUF header's key-value fields."""

    def __init__(self, reader: gguf.GGUFReader) -> None:
        self._fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFImportError(f"GGUF metadata lacks required key {key!r}")
        return value


def _short_float(value: float) -> float:
    # GGUF stores float32; print the shortest decimal that round-trips it (1e-05, not 9.9999997e-06).
    return float(str(np.float32(value)))


def _head_count(meta: GGUFMetadata, key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if value is None:
        raise GGUFImportError(f"GGUF metadata lacks required key {key!r}")
    if isinstance(value, list):  # per-layer counts; only uniform ones fit an HF config
        if len(set(value)) != 1:
            raise GGUFImportError(f"{key} varies per layer ({sorted(set(value))}); not supported")
        value = value[0]
    return int(value)


def build_config(meta: GGUFMetadata, arch: str, tensors: dict[str, Any], dtype: str) -> dict[str, Any]:
    hidden = int(meta.require(f"{arch}.embedding_length"))
    n_head = _head_count(meta, f"{arch}.attention.head_count")
    n_kv = _head_count(meta, f"{arch}.attention.head_count_kv", n_head)
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // n_head)
    if "token_embd.weight" not in tensors:
        raise GGUFImportError("GGUF has no token_embd.weight tensor")
    vocab_size = int(tensors["token_embd.weight"].shape[1])
    has_q_bias = "blk.0.attn_q.bias" in tensors
    config: dict[str, Any] = {
        "architectures": [SUPPORTED_ARCHS[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.require(f"{arch}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "rms_norm_eps": _short_float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _short_float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, arch, tensors, head_dim),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if arch == "llama":
        config.update(attention_bias=has_q_bias, mlp_bias=False, pretraining_tp=1)
    else:
        config.update(
            use_sliding_window=False, sliding_window=None, max_window_layers=config["num_hidden_layers"]
        )
        if arch == "qwen3":
            config["attention_bias"] = has_q_bias
    return config


def _rope_scaling(
    meta: GGUFMetadata, arch: str, tensors: dict[str, Any], head_dim: int
) -> dict[str, Any] | None:
    if ROPE_FREQS in tensors:
        return _llama3_rope_scaling(meta, arch, tensors[ROPE_FREQS], head_dim)
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor") or meta.get(f"{arch}.rope.scale_linear")
    if kind is None and factor is not None:
        kind = "linear"  # older files only wrote rope.scale_linear
    if kind in (None, "none") or not factor or factor == 1.0:
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _short_float(factor)}
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if kind == "yarn":
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        # llama.cpp's attn_factor multiplies its own mscale, unlike HF's attention_factor: not mapped.
        for name in ("beta_fast", "beta_slow"):
            value = meta.get(f"{arch}.rope.scaling.yarn_{name}")
            if value is not None:
                scaling[name] = _short_float(value)
    elif kind != "linear":
        raise GGUFImportError(f"unsupported RoPE scaling type {kind!r} (supported: linear, yarn, llama3)")
    return scaling


def _llama3_rope_scaling(meta: GGUFMetadata, arch: str, tensor: Any, head_dim: int) -> dict[str, Any]:
    # llama.cpp replaces Llama 3.1's rope_scaling by the per-frequency factors it implies. They do
    # not store the parameters, so assume the values every Llama 3.x release uses (low 1, high 4,
    # original context 8192) with the largest factor, and refuse the file unless they reproduce it.
    stored = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float64).reshape(-1)
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    dim = int(meta.get(f"{arch}.rope.dimension_count") or head_dim)
    scaling = {
        "rope_type": "llama3",
        "factor": _short_float(stored.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    if not np.allclose(_llama3_rope_factors(scaling, theta, dim), stored, rtol=1e-5, atol=1e-6):
        raise GGUFImportError(
            "rope_freqs.weight does not match llama3 RoPE scaling with low=1, high=4, original=8192"
        )
    return scaling


def _llama3_rope_factors(scaling: dict[str, Any], theta: float, dim: int) -> np.ndarray:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors)


def build_generation_config(meta: GGUFMetadata) -> dict[str, Any]:
    eos = meta.get("tokenizer.ggml.eos_token_id")
    # Chat models end a turn with EOT (e.g. Llama 3's <|eot_id|>), which differs from EOS.
    stops = [
        i
        for i in (eos, meta.get("tokenizer.ggml.eot_token_id"), meta.get("tokenizer.ggml.eom_token_id"))
        if i is not None
    ]
    stops = list(dict.fromkeys(stops))
    config: dict[str, Any] = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": stops[0] if len(stops) == 1 else (stops or None),
    }
    pad = meta.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        config["pad_token_id"] = pad
    return config

