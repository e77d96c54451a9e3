"""Deterministic mode: a request's numerics do not depend on what shares its batch."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


TARGET = prompt(70, 1)
OTHERS = [prompt(n, 10 + n) for n in (5, 33, 90, 12, 47)]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), dtype="float32", attention_backend="cpu_paged", block_size=8,
               max_num_batched_tokens=64, deterministic_chunk=32, num_kv_blocks=256)


def run(llm, target_params, others, other_params):
    """The target and the others submitted together; returns the target's output."""
    outs = llm.generate([*others, TARGET], [*([other_params] * len(others)), target_params])
    return outs[-1]


@pytest.mark.parametrize("sampling", [
    dict(temperature=0.0),
    dict(temperature=0.9, top_p=0.95, seed=7),
])
@pytest.mark.slow
def test_same_tokens_and_bitwise_logprobs_alone_and_in_any_mix(llm, sampling):
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3, deterministic=True, **sampling)
    filler = SamplingParams(max_tokens=9, temperature=0.7, ignore_eos=True)
    alone = run(llm, params, [], filler)
    mixes = [OTHERS[:1], OTHERS[1:3], OTHERS, OTHERS[::-1][:4]]
    for others in mixes:
        mixed = run(llm, params, others, filler)
        assert mixed.token_ids == alone.token_ids
        assert mixed.logprobs == alone.logprobs  # bit for bit, float equality
    # And from run to run on a fresh engine cache state (prefix cache hits on the grid).
    again = run(llm, params, OTHERS[2:], filler)
    assert again.logprobs == alone.logprobs and again.num_cached_tokens > 0


def test_without_deterministic_mode_the_batch_changes_the_bits(llm):
    """The control: the same comparison without the mode shows the batch does move the numerics."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    filler = SamplingParams(max_tokens=9, temperature=0.7, ignore_eos=True)
    llm.engine.block_manager.reset_prefix_cache()
    alone = run(llm, params, [], filler)
    differs = False
    for others in (OTHERS[:1], OTHERS, OTHERS[1:4]):
        llm.engine.block_manager.reset_prefix_cache()
        differs |= run(llm, params, others, filler).logprobs != alone.logprobs
    assert differs
