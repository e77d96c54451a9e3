"""Images in chat: the vision tower's images/s, end-to-end image requests/s, and the prefix cache on
repeated images.

    .venv/bin/python -m bench.vision            # CLIP ViT-B/16-224 tower + SmolLM2-135M-shaped LM
    .venv/bin/python -m bench.vision --quick    # fewer images, to check the script
    .venv/bin/python -m bench.vision --tower llava-1.5 --device cuda   # llava-1.5's ViT-L/14-336 tower

No installable package ships pretrained CLIP weights, so the checkpoint is a random-weight
LlavaForConditionalGeneration of the named shapes, written once with transformers into a temporary
folder; the compute is that of the real model, the answers are noise. Three measurements:
- vision encode: the tower and projector alone on batches of 1 and of `--batch` images (what a step
  with that many new images costs);
- end-to-end, cold: `--requests` chat-shaped requests, each with its own picture, through LLM.generate
  (16 output tokens each);
- end-to-end, repeated: the same requests again, so every image's blocks come from the prefix cache.

Writes bench/results/vision.json and its section of docs/perf/vision.md.
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from bench.report import PERF, publish_table, run_info, write_json
from engine import LLM, SamplingParams

TOWERS = {
    "vit-b-16": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                     image_size=224, patch_size=16),
    "llava-1.5": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                      image_size=336, patch_size=14),
}
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True)
PROMPT = "<s>user: <image>\nWhat is in this picture? Answer in one sentence.</s><s>assistant: "


def write_checkpoint(folder: Path, tower: str) -> None:
    import transformers

    from tests.conftest import write_byte_tokenizer
    from tests.vision_models import processor_config

    shape = TOWERS[tower]
    vision = transformers.CLIPVisionConfig(**shape, projection_dim=512)
    text = transformers.LlamaConfig(**SMOLLM2_135M, bos_token_id=1, eos_token_id=2)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=259,
                                      image_seq_length=(shape["image_size"] // shape["patch_size"]) ** 2)
    torch.manual_seed(0)
    transformers.LlavaForConditionalGeneration(config).save_pretrained(folder, safe_serialization=True)
    write_byte_tokenizer(folder)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(["<image>"])
    tok.save(str(folder / "tokenizer.json"))
    import json

    (folder / "preprocessor_config.json").write_text(json.dumps(processor_config(shape["image_size"])))


def pictures(n: int, size: int) -> list[bytes]:
    """n different photo-sized JPEGs (gradients with a moving square)."""
    import numpy as np
    from PIL import Image

    out = []
    for i in range(n):
        y, x = np.mgrid[0:size, 0:size * 4 // 3]
        rgb = np.stack([(x + 7 * i) % 256, (y * 2) % 256, (x + y + 31 * i) % 256], axis=-1).astype(np.uint8)
        rgb[40 + i % 50:120 + i % 50, 60:140] = (255, 255 - i % 256, 0)
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def encode_rate(llm: LLM, images: list[bytes], batch: int, rounds: int) -> float:
    engine = llm.engine
    pixels = torch.stack([engine.load_image(images[i % len(images)]).pixel_values for i in range(batch)])
    pixels = pixels.to(engine.device)
    engine.vision(pixels)  # warm-up
    start = time.perf_counter()
    for _ in range(rounds):
        engine.vision(pixels)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return batch * rounds / (time.perf_counter() - start)


def run_requests(llm: LLM, images: list[bytes]) -> tuple[float, float]:
    """(requests/s, share of prompt tokens taken from the prefix cache)."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([PROMPT] * len(images), params, images=[[img] for img in images])
    elapsed = time.perf_counter() - start
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error]
    cached = sum(o.num_cached_tokens for o in outs) / sum(len(o.prompt_token_ids) for o in outs)
    return len(images) / elapsed, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tower", choices=list(TOWERS), default="vit-b-16")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: the engine's default)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.batch = 4, 2
    size = TOWERS[args.tower]["image_size"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_checkpoint(folder, args.tower)
        llm = LLM(model=str(folder), dtype="auto", device=args.device, num_threads=args.threads or None)
        images = pictures(args.requests, size)
        single = encode_rate(llm, images, 1, 2 if args.quick else 4)
        batched = encode_rate(llm, images, args.batch, 1 if args.quick else 2)
        cold_rps, cold_hit = run_requests(llm, images)
        warm_rps, warm_hit = run_requests(llm, images)
    data = {**run_info("bench.vision", torch.get_num_threads()), "tower": args.tower, "device": str(llm.engine.device),
            "image_tokens": llm.engine.model_config.vision.num_image_tokens, "requests": args.requests,
            "encode_images_per_s": {"1": single, str(args.batch): batched},
            "cold": {"requests_per_s": cold_rps, "cached_share": cold_hit},
            "repeated": {"requests_per_s": warm_rps, "cached_share": warm_hit}}
    write_json("vision.json", data)
    rows = [
        ("vision encode, 1 image a batch", f"{single:.2f} images/s", ""),
        (f"vision encode, {args.batch} images a batch", f"{batched:.2f} images/s", ""),
        (f"{args.requests} image requests, each image new", f"{cold_rps:.2f} req/s", f"{cold_hit:.0%}"),
        (f"the same {args.requests} requests again", f"{warm_rps:.2f} req/s", f"{warm_hit:.0%}"),
    ]
    how = (f"random-weight LLaVA, {args.tower} tower ({data['image_tokens']} positions an image) and a "
           f"SmolLM2-135M-shaped LM, on {data['device']}; 16 output tokens a request.")
    publish_table("vision", "Images in chat: vision encode and image requests", data, how,
                  "bench.vision", ["measure", "rate", "prompt tokens from the prefix cache"], rows,
                  docs=PERF / "vision.md")


if __name__ == "__main__":
    main()
