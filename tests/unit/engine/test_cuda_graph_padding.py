"""Bucketed decode batches: padding rows up to a bucket changes nothing for the real rows.

On a GPU the buckets are replayed from CUDA graphs; here the same padding runs
eagerly (use_graphs=False), which is what this test checks.
"""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams
from engine.cuda_graphs import DecodeGraphs, bucket_for


def test_buckets():
    buckets = (1, 2, 4, 8, 16)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, None]


def test_padded_decode_steps_give_the_same_tokens_and_logprobs(tiny_llama):
    prompts = [list(range(3, 3 + n)) for n in (5, 19, 40)]  # 3 sequences -> bucket 4, one padded row
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    plain = LLM(model=str(tiny_llama), dtype="float32", num_kv_blocks=40, block_size=8)
    expected = plain.generate(prompts, params)
    padded = LLM(model=str(tiny_llama), dtype="float32", num_kv_blocks=40, block_size=8)
    eng = padded.engine
    eng.runner.graphs = DecodeGraphs(eng.model, eng.kv_caches, 8, scratch_block=eng.layout.num_blocks,
                                     max_blocks=eng.max_model_len // 8, max_batch=16, device=torch.device("cpu"),
                                     use_graphs=False)
    got = padded.generate(prompts, params)
    for a, b in zip(expected, got, strict=True):
        assert a.token_ids == b.token_ids
        for (lp_a, _), (lp_b, _) in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(lp_a - lp_b) < 1e-5
    # The padded rows wrote only to the scratch block past the pool.
    assert eng.kv_caches[0][:, eng.layout.num_blocks].abs().sum() > 0
