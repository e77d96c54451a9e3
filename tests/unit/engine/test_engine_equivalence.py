"""Outputs must not depend on scheduling: prefix cache, preemption and chunking change nothing."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5)


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, 320) for _ in range(40)]
    return [shared + [rng.randrange(3, 320) for _ in range(n)] for n in (3, 11, 27, 60)] + [
        [rng.randrange(3, 320) for _ in range(n)] for n in (9, 33)]


def run(path, **options):
    llm = LLM(model=str(path), dtype="float32", block_size=8, **options)
    outs = llm.generate(prompts(), PARAMS)
    return outs, llm.engine


def assert_same_greedy(a, b):
    """Identical tokens, or a first divergence at a near-tie inside each other's top-5."""
    for x, y in zip(a, b, strict=True):
        if x.token_ids == y.token_ids:
            continue
        i = next(j for j, (p, q) in enumerate(zip(x.token_ids, y.token_ids, strict=True)) if p != q)
        lp_x = dict(x.logprobs[i][1])
        lp_y = dict(y.logprobs[i][1])
        assert y.token_ids[i] in lp_x and x.token_ids[i] in lp_y
        assert abs(lp_x[x.token_ids[i]] - lp_x[y.token_ids[i]]) < 1e-3, "diverged without a tie"


@pytest.fixture(scope="module")
def baseline(tiny_llama):
    outs, _ = run(tiny_llama, enable_prefix_caching=False, max_num_batched_tokens=4096, num_kv_blocks=256)
    return outs


def test_prefix_cache_on_equals_off(tiny_llama, baseline):
    # Run the batch twice on one engine so the second pass is served from the cache.
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=8, num_kv_blocks=256)
    llm.generate(prompts(), PARAMS)
    cached = llm.generate(prompts(), PARAMS)
    assert all(o.num_cached_tokens >= 40 for o in cached[:4])
    assert_same_greedy(cached, baseline)


def test_forced_preemption_equals_no_preemption(tiny_llama, baseline):
    outs, engine = run(tiny_llama, num_kv_blocks=20, max_num_batched_tokens=4096)
    assert engine.scheduler.num_preemptions > 0
    assert_same_greedy(outs, baseline)


def test_chunked_prefill_equals_unchunked(tiny_llama, baseline):
    # A 16-token budget splits every prompt (up to 100 tokens) into chunks.
    outs, _ = run(tiny_llama, max_num_batched_tokens=16, num_kv_blocks=256, enable_prefix_caching=False)
    assert_same_greedy(outs, baseline)


def test_prepacked_weights_equal_plain(tiny_llama):
    # Twelve sequences, so decode steps (12 rows) and 64-token prefill chunks take the path that
    # reads the packed copies (the panel kernel, or oneDNN without AVX-512); MKL reads the plain weights.
    many = prompts() * 2
    plain = LLM(model=str(tiny_llama), dtype="float32", block_size=8, num_kv_blocks=256,
                max_num_batched_tokens=64, enable_prefix_caching=False).generate(many, PARAMS)
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=8, num_kv_blocks=256, max_num_batched_tokens=64,
              enable_prefix_caching=False, cpu_prepack_weights=True)
    padded = sum(-(-p.shape[0] // 32) * 32 * p.shape[1] * p.element_size()
                 for p in llm.engine.model.parameters() if p.dim() == 2)  # panels pad to 32 output columns
    assert 0 < llm.engine.prepacked_bytes <= padded
    assert_same_greedy(llm.generate(many, PARAMS), plain)
