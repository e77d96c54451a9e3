"""The model's shape, read from a Hugging Face `config.json`.

Handles both the older layout (`rope_theta`, `rope_scaling`) and the
transformers 5 layout (`rope_parameters`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError

# architecture name -> (qkv bias, per-head q/k RMSNorm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}
# `quantization_config.quant_method`s that load: our own (engine/quant/checkpoint.py), and fp8 in the
# layouts other tools publish (engine/quant/hf_fp8.py).
QUANT_METHODS = ("infinilm", "compressed-tensors", "fp8")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # The quant config of a checkpoint written by `infinilm quantize` (engine.quant), else None.
    quantization: dict[str, Any] | None = None
    # A LLaVA checkpoint's vision tower and projector (engine.vision); None for a text-only model.
    vision: Any = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self, include_embeddings: bool = True) -> int:
        """Parameter count; the FLOP model of the benchmarks uses it."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        per_layer = attn + 3 * h * i + 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        total = self.num_layers * per_layer + h
        if include_embeddings:
            total += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        from engine.vision.config import VisionConfig, is_llava, llava_text_config

        if is_llava(raw):
            text = cls.from_dict(llava_text_config(raw))
            return dataclasses.replace(text, vision=VisionConfig.from_llava_dict(raw, text.hidden_size))
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            model_type = raw.get("model_type", "")
            arch = {
                "llama": "LlamaForCausalLM",
                "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM",
            }.get(model_type)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported activation {raw['hidden_act']!r}; only silu is implemented")
        quantization = raw.get("quantization_config")
        if quantization is not None and quantization.get("quant_method") not in QUANT_METHODS:
            raise ModelLoadError(f"unsupported quantization method {quantization.get('quant_method')!r}; "
                                 "checkpoints written by `infinilm quantize` load quantized, and fp8 ones in the "
                                 "compressed-tensors or block-wise fp8 layout")
        qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        if arch == "LlamaForCausalLM" and raw.get("attention_bias"):
            qkv_bias = True
        if raw.get("mlp_bias"):
            raise ModelLoadError("mlp_bias=true is not supported")

        rope = dict(raw.get("rope_parameters") or {})
        scaling = raw.get("rope_scaling")
        if scaling:
            rope.update(scaling)
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        if rope_scaling and rope_type not in ("llama3", "linear"):
            raise ModelLoadError(f"unsupported rope scaling {rope_type!r}; supported: llama3, linear")

        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            hidden_size=hidden,
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            sliding_window=int(window) if window else None,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            quantization=quantization,
        )

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{folder} is not a model folder: config.json is missing")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
        try:
            return cls.from_dict(raw)
        except KeyError as exc:
            raise ModelLoadError(f"{path} lacks the required field {exc.args[0]!r}") from exc
