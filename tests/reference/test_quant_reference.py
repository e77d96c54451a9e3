"""Quantization against references: `eval ppl`'s perplexity against HF transformers' on the same
weights, and the seed article's pitfall (numbers copied from the context) on SmolLM2 int8."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.perplexity import perplexity

pytestmark = pytest.mark.reference
GPL3 = Path("/usr/share/common-licenses/GPL-3")


def hf_perplexity(hf, ids: list[int], context: int, stride: int) -> float:
    """The Hugging Face guide's sliding-window loop, counting each window's scored tokens exactly."""
    nll, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + context, len(ids))
        window = torch.tensor([ids[begin:end]])
        labels = window.clone()
        labels[:, : window.shape[1] - (end - prev_end)] = -100
        with torch.no_grad():
            logits = hf(window).logits[0, :-1].float()
        target = labels[0, 1:]
        keep = target != -100
        nll += torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum").item()
        count += int(keep.sum())
        prev_end = end
        if end == len(ids):
            break
    return math.exp(nll / count)


def test_perplexity_equals_hf_on_a_tiny_llama(tiny_llama):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    llm = LLM(model=str(tiny_llama), dtype="float32", max_model_len=200)
    ids = llm.tokenizer.encode(GPL3.read_text()[:600])
    for context, stride in ((128, 128), (128, 40)):
        ours = perplexity(llm, ids, context, stride).perplexity
        assert ours == pytest.approx(hf_perplexity(hf, ids, context, stride), rel=1e-4)


@pytest.fixture(scope="module")
def smol_fp32():
    return LLM(model="smollm2", dtype="float32", max_num_batched_tokens=1024)


def test_perplexity_equals_hf_on_smollm2_gpl3(smol_fp32):
    import transformers

    from engine.model_registry import resolve_model

    hf = transformers.AutoModelForCausalLM.from_pretrained(resolve_model("smollm2"), dtype=torch.float32).eval()
    ids = smol_fp32.tokenizer.encode(GPL3.read_text())[:400]
    ours = perplexity(smol_fp32, ids, context=192, stride=96).perplexity
    assert ours == pytest.approx(hf_perplexity(hf, ids, 192, 96), rel=1e-4)


# Questions whose answers copy numbers from the context; SmolLM2 fp32 answers each from the context.
COPY_PROMPTS = [
    "Order #58213 was placed on 2024-03-17 for $74.99. What is the order number, the date and the price? "
    "Answer briefly.",
    "Invoice 90417: 3 items at $12.50 each, total $37.50, due 2025-01-09. What is the invoice number and the total?",
    "The meeting moved from 14:30 to 16:45 on March 22, room 4B. When and where is the meeting now?",
    "Customer ID 448120 paid $1,249.00 on 2023-11-28. How much did customer 448120 pay, and when?",
    "Flight UA 2291 departs at 07:15 from gate 32 and arrives at 10:40. What is the flight number and "
    "departure gate?",
]
NUMBER = re.compile(r"\d[\d,.:-]*\d|\d")


def copied_numbers(llm: LLM) -> list[list[str]]:
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
               for p in COPY_PROMPTS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0))
    return [NUMBER.findall(o.text) for o in outs]


@pytest.mark.slow
def test_calibrated_int8_copies_the_same_numbers_as_fp32(smol_fp32):
    fp32 = copied_numbers(smol_fp32)
    for prompt, numbers in zip(COPY_PROMPTS, fp32, strict=True):
        assert numbers and all(n in prompt or n.lstrip("0") in prompt for n in numbers), (prompt, numbers)
    int8 = LLM(model="smollm2", dtype="float32", weight_bits=8, max_num_batched_tokens=1024)
    assert int8.engine.model.config.quantization["calibrated"]
    assert copied_numbers(int8) == fp32
