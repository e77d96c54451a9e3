"""LLaVA against HF transformers: image preprocessing, and greedy tokens and logprobs of
LlavaForConditionalGeneration, on tiny random checkpoints the tests write (tests/vision_models.py)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.vision.preprocess import ImageProcessor
from tests.vision_models import picture, processor_config, write_tiny_llava

pytestmark = pytest.mark.reference

PROMPT = "<s>user: <image>what is this?</s><s>assistant: "
TWO = "<s>user: <image> and <image>: same?</s><s>assistant: "
TEXT = "<s>user: no picture here</s><s>assistant: "

VARIANTS = {
    "layer-2-default": dict(feature_layer=-2, strategy="default"),
    "layers-list-full": dict(feature_layer=[-3, -1], strategy="full"),
}


def _rgba_png() -> bytes:
    from PIL import Image

    rng = np.random.default_rng(3)
    pixels = rng.integers(0, 256, (37, 61, 4), dtype=np.uint8)
    pixels[:10, :, 3] = 0  # fully transparent rows: laid over white
    out = io.BytesIO()
    Image.fromarray(pixels, "RGBA").save(out, format="PNG")
    return out.getvalue()


FILES = {
    "png-landscape": lambda: picture("stripes", (53, 31), "PNG"),
    "png-rgba": _rgba_png,
    "jpeg-portrait": lambda: picture("noise", (45, 90), "JPEG", seed=1),
    "jpeg-grayscale": lambda: _grayscale_jpeg(),
}


def _grayscale_jpeg() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (64, 48), dtype=np.uint8), "L").save(out, "JPEG")
    return out.getvalue()


@pytest.mark.parametrize("size", [28, 336])
@pytest.mark.parametrize("file", list(FILES))
def test_preprocessing_matches_hf_clip_image_processor(file, size):
    from PIL import Image
    from transformers import CLIPImageProcessorPil

    data = FILES[file]()
    cfg = processor_config(size)
    ours = ImageProcessor.from_dict(cfg).load(data).pixel_values
    hf = CLIPImageProcessorPil(**{k: v for k, v in cfg.items() if k != "image_processor_type"})
    expected = hf(images=Image.open(io.BytesIO(data)), return_tensors="pt")["pixel_values"][0]
    assert ours.shape == expected.shape == (3, size, size)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)


@pytest.fixture(scope="module", params=list(VARIANTS))
def llava_pair(request, tmp_path_factory):
    import transformers

    path = write_tiny_llava(tmp_path_factory.mktemp(request.param), seed=2, **VARIANTS[request.param])
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf, transformers.CLIPImageProcessorPil.from_pretrained(path)


def _hf_logprobs(hf, processor, prompt_ids: list[int], tokens: list[int], images: list[bytes]) -> torch.Tensor:
    """log P(token | everything before) under HF for each generated token, teacher-forced."""
    from PIL import Image

    kwargs = {}
    if images:
        kwargs["pixel_values"] = processor(images=[Image.open(io.BytesIO(d)) for d in images],
                                           return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([prompt_ids + tokens]), **kwargs).logits[0].float()
    return torch.log_softmax(logits[len(prompt_ids) - 1:-1], dim=-1)


CASES = [
    (PROMPT, ["circle"]),
    (PROMPT, ["stripes"]),
    (TWO, ["noise", "circle"]),
    (TEXT, []),
    (PROMPT, ["noise"]),
]


@pytest.mark.parametrize("budget", [512, 24], ids=["whole-prefills", "chunks-split-images"])
def test_greedy_tokens_and_logprobs_match_hf_in_a_mixed_batch(llava_pair, budget):
    path, hf, processor = llava_pair
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=budget, enable_prefix_caching=False)
    images = [[picture(kind, seed=i) for kind in kinds] for i, (_, kinds) in enumerate(CASES)]
    outs = llm.generate([p for p, _ in CASES], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                            logprobs=1), images=images)
    for out, imgs in zip(outs, images, strict=True):
        assert out.error is None
        hf_lp = _hf_logprobs(hf, processor, list(out.prompt_token_ids), list(out.token_ids), imgs)
        assert hf_lp.argmax(-1).tolist() == list(out.token_ids)  # HF's greedy choice at every step
        ours = torch.tensor([lp for lp, _ in out.logprobs])
        picked = hf_lp.gather(1, torch.tensor(out.token_ids).view(-1, 1)).view(-1)
        torch.testing.assert_close(ours, picked, atol=2e-4, rtol=0)
    # The images decide the answer: the same text with another picture says something else.
    assert outs[0].token_ids != outs[1].token_ids


def test_image_positions_expand_to_the_patch_count(llava_pair):
    path, hf, _ = llava_pair
    llm = LLM(model=str(path), dtype="float32")
    (out,) = llm.generate([TWO], SamplingParams(max_tokens=1, temperature=0),
                          images=[[picture("circle"), picture("noise")]])
    per_image = hf.config.image_seq_length + (1 if hf.config.vision_feature_select_strategy == "full" else 0)
    text_ids = llm.tokenizer.encode(TWO)
    assert len(out.prompt_token_ids) == len(text_ids) + 2 * (per_image - 1)
    assert out.prompt_token_ids.count(hf.config.image_token_id) == 2 * per_image
