"""SmolLM2 with fp8 weights, run through the CPU reference path (the GPU's numerics: E4M3 weights per
channel, activations rounded to E4M3 per token where a layer is W8A8), against fp32 on held-out text.

NOTE: the issue's bound is +1%. Every linear W8A8 misses it on SmolLM2 (+1.2% on the first 2048 tokens of
GPL-3 in windows of 1024); the default, fp8_activations auto, keeps the attention projections' activations
at full precision and is within it (docs/perf/gpu.md, "Weight formats"). This test holds auto, calibrated on
the default text as an engine calibrates, to the bound: +0.75% loaded on 2 threads, +0.46% on 1 (the clip and
input-scale searches' choices move with a thread count's summation order). A 3000-character calibration text
was quicker but gave +0.80% and +1.15%."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM
from engine.perplexity import perplexity
from engine.quant.fp8 import Fp8Linear
from engine.quant.fp8_activations import w8a8_share

pytestmark = pytest.mark.slow
GPL3 = Path("/usr/share/common-licenses/GPL-3")
TOKENS, CONTEXT = 1024, 512


def test_smollm2_fp8_perplexity_stays_within_the_measured_margin_of_fp32():
    fp32 = LLM(model="smollm2", dtype="float32", max_num_batched_tokens=1024)
    ids = fp32.tokenizer.encode(GPL3.read_text())[:TOKENS]
    base = perplexity(fp32, ids, CONTEXT, CONTEXT // 2).perplexity
    fp8 = LLM(model="smollm2", dtype="float32", weight_bits=8, weight_format="fp8", max_num_batched_tokens=1024)
    assert isinstance(fp8.engine.model.layers[0].mlp.down_proj, Fp8Linear)
    assert w8a8_share(fp8.engine.model) >= 0.7
    ours = perplexity(fp8, ids, CONTEXT, CONTEXT // 2).perplexity
    assert ours <= 1.01 * base, (ours, base)
