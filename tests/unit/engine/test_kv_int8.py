"""The int8 KV cache: row quantization, attention against full precision with and without the
full-precision window, both CPU backends, and the engine's greedy tokens on a tiny llama."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.kv_int8 import dequantize_rows, quantize_rows

PROMPT_LENS = (9, 33, 70)


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 320) for _ in range(n)] for n in PROMPT_LENS]


def run(path, **options):
    """Every prompt position scored and 12 greedy tokens with their logprobs."""
    llm = LLM(model=str(path), dtype="float32", block_size=8, num_kv_blocks=96, enable_prefix_caching=False,
              **options)
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3,
                             score_positions=tuple(range(1, len(p)))) for p in prompts()]
    return llm.generate(prompts(), params)


def prompt_lp(outs) -> torch.Tensor:
    return torch.tensor([lp for o in outs for _, lp in sorted(o.prompt_logprobs.items())])


def decode_lp(outs) -> torch.Tensor:
    return torch.tensor([step[0] for o in outs for step in o.logprobs])


@pytest.fixture(scope="module")
def fp(tiny_llama):
    return run(tiny_llama)


def test_rows_round_trip_within_half_a_step_of_their_own_scale():
    x = torch.randn(50, 2, 64) * torch.logspace(-3, 2, 50)[:, None, None]
    codes, scale = quantize_rows(x)
    assert codes.dtype == torch.int8 and scale.shape == (50, 2)
    err = (dequantize_rows(codes, scale, torch.float32) - x).abs()
    assert torch.all(err <= scale.float()[..., None] / 2 * (1 + 1e-3))


@pytest.mark.parametrize("backend", ["torch", "cpu_paged"])
def test_int8_cache_keeps_fp_greedy_tokens_and_close_logprobs(tiny_llama, fp, backend):
    q = run(tiny_llama, cache_bits=8, attention_backend=backend)
    for a, b in zip(fp, q, strict=True):
        assert a.token_ids == b.token_ids
    diff = (prompt_lp(q) - prompt_lp(fp)).abs().max()
    assert 0 < diff < 0.05  # quantization shows, and stays small
    assert (decode_lp(q) - decode_lp(fp)).abs().max() < 0.05


@pytest.mark.parametrize("backend", ["torch", "cpu_paged"])
def test_window_covering_every_row_equals_full_precision(tiny_llama, fp, backend):
    q = run(tiny_llama, cache_bits=8, kv_fp_window=128, attention_backend=backend)
    for a, b in zip(fp, q, strict=True):
        assert a.token_ids == b.token_ids
    torch.testing.assert_close(prompt_lp(q), prompt_lp(fp), atol=1e-4, rtol=0)
    torch.testing.assert_close(decode_lp(q), decode_lp(fp), atol=1e-4, rtol=0)


def test_window_numbers_do_not_depend_on_chunking_or_backend(tiny_llama):
    whole = run(tiny_llama, cache_bits=8, kv_fp_window=8, attention_backend="torch")
    chunked = run(tiny_llama, cache_bits=8, kv_fp_window=8, attention_backend="torch", max_num_batched_tokens=16)
    kernel = run(tiny_llama, cache_bits=8, kv_fp_window=8, attention_backend="cpu_paged", max_num_batched_tokens=16)
    all_int8 = run(tiny_llama, cache_bits=8, attention_backend="torch")
    for other in (chunked, kernel):
        torch.testing.assert_close(prompt_lp(other), prompt_lp(whole), atol=1e-5, rtol=0)
        torch.testing.assert_close(decode_lp(other), decode_lp(whole), atol=1e-5, rtol=0)
    # The window is really read: a window of 8 rows changes the numbers against all-int8.
    assert (prompt_lp(whole) - prompt_lp(all_int8)).abs().max() > 1e-6


def test_int8_prefix_cache_evicts_least_recently_used_blocks(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=8, num_kv_blocks=14, cache_bits=8)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    rng = random.Random(1)
    a, b, c = ([rng.randrange(3, 320) for _ in range(41)] for _ in range(3))  # 5 full blocks and one token

    def cached(prompt) -> int:
        return llm.generate([prompt], params)[0].num_cached_tokens

    assert [cached(a), cached(b)] == [0, 0]
    assert cached(a) == 40  # a hit refreshes A: B is now the least recently used
    assert cached(c) == 0  # 14 blocks hold two prompts of 6: C evicts B's blocks, not A's
    assert cached(a) == 40
    assert cached(b) < 40
