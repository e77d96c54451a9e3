"""Tiny random-weight LLaVA checkpoints (CLIP tower + projector + Llama) and test pictures, written by
the tests themselves with transformers and Pillow."""

from __future__ import annotations

import io
import json
from pathlib import Path

from tests.conftest import write_byte_tokenizer

IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = 259  # the first id after the byte tokenizer's 3 specials and 256 bytes
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def processor_config(size: int, crop: int | None = None) -> dict:
    """A CLIPImageProcessor config as llava-1.5 ships it (size 336 there)."""
    crop = crop or size
    return {"image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": size},
            "resample": 3, "do_center_crop": True, "crop_size": {"height": crop, "width": crop},
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": CLIP_MEAN,
            "image_std": CLIP_STD, "do_convert_rgb": True}


def write_tiny_llava(path: Path, seed: int = 0, feature_layer: int | list[int] = -2,
                     strategy: str = "default", image_size: int = 28, patch_size: int = 7) -> Path:
    """A LlavaForConditionalGeneration with a 3-layer CLIP tower and a 2-layer Llama, saved as safetensors
    with a byte tokenizer that has IMAGE_TOKEN and a preprocessor_config.json."""
    import torch
    import transformers

    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=4, image_size=image_size, patch_size=patch_size,
                                           projection_dim=16)
    text = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                                    max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID,
                                      vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy,
                                      image_seq_length=(image_size // patch_size) ** 2)
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layer_norm1.weight", "layer_norm2.weight", "layrnorm.weight")):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.normal_(0, 0.02)
            elif "multi_modal_projector" in name or "embeddings" in name:
                # Features as large as token embeddings, so an image visibly changes what the model says.
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path)
    tok_path = path / "tokenizer.json"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    tok.add_special_tokens([IMAGE_TOKEN])
    assert tok.token_to_id(IMAGE_TOKEN) == IMAGE_TOKEN_ID
    tok.save(str(tok_path))
    (path / "preprocessor_config.json").write_text(json.dumps(processor_config(image_size)))
    return path


def picture(kind: str, size: tuple[int, int] = (40, 30), fmt: str = "PNG", seed: int = 0) -> bytes:
    """A small drawn picture as encoded bytes: "circle", "stripes" or "noise"."""
    import numpy as np
    from PIL import Image, ImageDraw

    w, h = size
    if kind == "noise":
        rng = np.random.default_rng(seed)
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    else:
        image = Image.new("RGB", size, (20, 40, 200) if kind == "circle" else (250, 250, 250))
        draw = ImageDraw.Draw(image)
        if kind == "circle":
            draw.ellipse((w // 4, h // 4, 3 * w // 4, 3 * h // 4), fill=(255, 200, 0))
        else:
            for x in range(0, w, 6):
                draw.rectangle((x, 0, x + 2, h), fill=(200, 0, 0))
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()
