"""LLaVA's image path: the CLIP tower, the multi-modal projector, and where the projected features go
in a prompt (each image placeholder token expands to `num_image_tokens` positions)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.errors import InvalidRequestError, ModelLoadError
from engine.vision.clip import CLIPVisionTower, activation
from engine.vision.config import VisionConfig
from engine.vision.preprocess import ImageInput

_LAYER_PREFIX = "encoder.layers."


class MultiModalProjector(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.act = cfg.projector_act
        self.linear_1 = nn.Linear(cfg.hidden_size * len(cfg.feature_layers), cfg.text_hidden_size,
                                  bias=cfg.projector_bias)
        self.linear_2 = nn.Linear(cfg.text_hidden_size, cfg.text_hidden_size, bias=cfg.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(activation(self.act, self.linear_1(x)))


class VisionEncoder(nn.Module):
    """Pixels of a batch of images to the language model's embeddings, [images, num_image_tokens, hidden]."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vision_tower = CLIPVisionTower(cfg)
        self.multi_modal_projector = MultiModalProjector(cfg)

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower(pixels))


def checkpoint_part(name: str) -> tuple[str, str]:
    """Which part of a LLaVA checkpoint a tensor belongs to ("vision", "text"), and its name there.

    Two layouts exist: transformers 4 (`language_model.model.*`, `vision_tower.vision_model.*`) and
    transformers 5 (`model.language_model.*`, `model.vision_tower.*`, top-level `lm_head`). Text names
    come back in the plain LlamaForCausalLM form (`model.layers.0...`, `lm_head.weight`)."""
    if name.startswith("model.") and not name.startswith(("model.layers.", "model.embed_tokens.", "model.norm.")):
        name = name[len("model."):]
    for prefix in ("vision_tower.vision_model.", "vision_tower."):
        if name.startswith(prefix):
            return "vision", "vision_tower." + name[len(prefix):]
    if name.startswith("multi_modal_projector."):
        return "vision", name
    if name.startswith("language_model."):
        rest = name[len("language_model."):]
        if rest.startswith(("model.", "lm_head.")):
            return "text", rest
        return "text", "model." + rest
    return "text", name


def load_vision_encoder(folder: Path, files: Sequence[Path], cfg: VisionConfig, dtype: torch.dtype,
                        device: torch.device) -> VisionEncoder:
    """The tower and projector from a LLaVA checkpoint's safetensors files; every parameter must be there."""
    with torch.device("meta"):
        encoder = VisionEncoder(cfg)
    expected = dict(encoder.named_parameters())
    state: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for ckpt_name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                part, name = checkpoint_part(ckpt_name)
                if part != "vision" or _unused(name, cfg):
                    continue
                if name not in expected:
                    raise ModelLoadError(f"{path.name}: unexpected vision tensor {ckpt_name!r}")
                tensor = f.get_tensor(ckpt_name)
                if tuple(tensor.shape) != tuple(expected[name].shape):
                    raise ModelLoadError(f"tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, "
                                         f"the config implies {tuple(expected[name].shape)}")
                state[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"checkpoint in {folder} lacks vision weights: {', '.join(missing[:8])}")
    encoder.load_state_dict(state, assign=True)
    return encoder.eval()


def _unused(name: str, cfg: VisionConfig) -> bool:
    """Tensors of the tower that LLaVA never reads: post_layernorm, the layers past the last feature layer."""
    rest = name[len("vision_tower."):] if name.startswith("vision_tower.") else ""
    if rest.startswith("post_layernorm."):
        return True
    if rest.startswith(_LAYER_PREFIX):
        return int(rest[len(_LAYER_PREFIX):].split(".", 1)[0]) >= cfg.layers_to_run
    return False


@dataclass(frozen=True, eq=False)
class ImageSpan:
    """An image and the prompt positions its features fill: [start, start + length)."""

    image: ImageInput
    start: int
    length: int


def place_images(token_ids: list[int], images: Sequence[ImageInput], cfg: VisionConfig) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """Expand each image placeholder token to cfg.num_image_tokens positions, in order, one image each.

    NOTE: the prompt holds one placeholder per image (as a chat template writes it); a prompt already
    expanded by HF's processor would hold num_image_tokens of them per image and is refused as a
    count mismatch, rather than guessed at."""
    token = cfg.image_token_id
    n = cfg.num_image_tokens
    found = sum(1 for t in token_ids if t == token)
    if found != len(images):
        raise InvalidRequestError(f"the prompt has {found} image placeholder(s) but the request has "
                                  f"{len(images)} image(s)")
    out: list[int] = []
    spans: list[ImageSpan] = []
    for t in token_ids:
        if t == token:
            spans.append(ImageSpan(images[len(spans)], len(out), n))
            out.extend([token] * n)
        else:
            out.append(t)
    return out, tuple(spans)


def step_embeddings(encoder: VisionEncoder, embed_tokens: nn.Module, scheduled: Sequence, input_ids: torch.Tensor,
                    one_by_one: bool = False) -> torch.Tensor | None:
    """The step's input embeddings with image features at image positions; None if no row is an image's.

    `scheduled` is the step's requests in the order of their rows in the flat batch. Every image with a
    position in the step is encoded, all in one batch, whole (a chunk boundary or a prefix-cache hit
    may leave only part of its positions to compute).

    NOTE: `one_by_one` (a step with a deterministic request) encodes each image alone: a GEMM's rounding
    depends on how many rows it has, so a batched image's features depend on the other images."""
    jobs: list[tuple[int, ImageSpan, int, int]] = []  # (first flat row, span, first and end position in the image)
    row = 0
    for s in scheduled:
        n = len(s.token_ids)
        for span in s.images:
            lo, hi = max(span.start, s.start), min(span.start + span.length, s.start + n)
            if lo < hi:
                jobs.append((row + lo - s.start, span, lo - span.start, hi - span.start))
        row += n
    if not jobs:
        return None
    index: dict[int, int] = {}
    pixels: list[torch.Tensor] = []
    for _, span, _, _ in jobs:
        if id(span.image) not in index:
            index[id(span.image)] = len(pixels)
            pixels.append(span.image.pixel_values)
    device = input_ids.device
    batch = torch.stack(pixels).to(device, non_blocking=True)
    features = torch.cat([encoder(batch[i:i + 1]) for i in range(len(pixels))]) if one_by_one else encoder(batch)
    embeds = embed_tokens(input_ids)
    for first, span, lo, hi in jobs:
        embeds[first:first + hi - lo] = features[index[id(span.image)], lo:hi].to(embeds.dtype)
    return embeds
