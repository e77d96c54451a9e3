"""The vision half of a Hugging Face LLaVA `config.json` (`LlavaForConditionalGeneration`).

Real llava-1.5 configs list only the fields that differ from the transformers defaults, so the
defaults of `CLIPVisionConfig` and `LlamaConfig` fill in what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import ModelLoadError

LLAVA_ARCHITECTURE = "LlavaForConditionalGeneration"

# transformers' CLIPVisionConfig defaults
CLIP_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "num_channels": 3, "image_size": 224, "patch_size": 32, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5,
}
# transformers' LlamaConfig defaults, for a llava text_config that omits them
LLAMA_DEFAULTS: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
    "bos_token_id": 1, "eos_token_id": 2,
}
ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh", "gelu_new")
SELECT_STRATEGIES = ("default", "full")


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float
    # LLaVA's choices: which tower layers feed the projector, whether the CLS row is kept, which token
    # stands for an image in the prompt.
    feature_layers: tuple[int, ...]
    select_strategy: str
    image_token_id: int
    projector_act: str
    projector_bias: bool
    text_hidden_size: int

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_image_tokens(self) -> int:
        """Prompt positions one image fills: one per patch, plus the CLS row for the "full" strategy."""
        return self.num_patches + (1 if self.select_strategy == "full" else 0)

    @property
    def layers_to_run(self) -> int:
        """Tower layers needed: hidden state k is the output of layer k (0 is the embeddings)."""
        return max(k if k >= 0 else self.num_layers + 1 + k for k in self.feature_layers)

    @classmethod
    def from_llava_dict(cls, raw: dict[str, Any], text_hidden_size: int) -> VisionConfig:
        vision = {**CLIP_VISION_DEFAULTS, **(raw.get("vision_config") or {})}
        if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise ModelLoadError(f"unsupported vision tower {vision['model_type']!r}; only CLIP is implemented")
        layer = raw.get("vision_feature_layer", -2)
        layers = tuple(int(x) for x in layer) if isinstance(layer, list) else (int(layer),)
        strategy = raw.get("vision_feature_select_strategy", "default")
        token = raw.get("image_token_index", raw.get("image_token_id"))
        acts = (vision["hidden_act"], raw.get("projector_hidden_act", "gelu"))
        num_layers = int(vision["num_hidden_layers"])
        if strategy not in SELECT_STRATEGIES:
            raise ModelLoadError(f"unsupported vision_feature_select_strategy {strategy!r}")
        if token is None:
            raise ModelLoadError("a llava config needs image_token_index")
        for act in acts:
            if act not in ACTIVATIONS:
                raise ModelLoadError(f"unsupported activation {act!r} in the vision model")
        if any(not -num_layers - 1 <= k <= num_layers for k in layers):
            raise ModelLoadError(f"vision_feature_layer {layer!r} is outside the tower's {num_layers} layers")
        return cls(
            hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
            num_layers=num_layers, num_heads=int(vision["num_attention_heads"]),
            num_channels=int(vision["num_channels"]), image_size=int(vision["image_size"]),
            patch_size=int(vision["patch_size"]), hidden_act=acts[0], layer_norm_eps=float(vision["layer_norm_eps"]),
            feature_layers=layers, select_strategy=strategy, image_token_id=int(token), projector_act=acts[1],
            projector_bias=bool(raw.get("multimodal_projector_bias", True)), text_hidden_size=text_hidden_size,
        )


def is_llava(raw: dict[str, Any]) -> bool:
    return raw.get("model_type") == "llava" or LLAVA_ARCHITECTURE in (raw.get("architectures") or [])


def llava_text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The language model's config, with LlamaConfig defaults where the llava config leaves them out."""
    text = {**LLAMA_DEFAULTS, **(raw.get("text_config") or {})}
    text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    return text
