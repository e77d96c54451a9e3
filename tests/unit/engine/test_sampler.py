"""Sampler: greedy, filters, and per-request seeds."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.sampler import sample
from engine.sampling_params import SamplingParams


def logits_rows(n: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = logits_rows(4)
    res = sample(logits.clone(), [SamplingParams(temperature=0)] * 4, [None] * 4)
    assert res.token_ids == logits.argmax(-1).tolist()


def test_greedy_takes_the_first_of_tied_maxima_in_greedy_and_mixed_batches():
    logits = logits_rows(3)
    logits[:, [7, 3, 30]] = 100.0  # a three-way tie at the top of every row: index 3 comes first
    greedy = SamplingParams(temperature=0)
    assert sample(logits.clone(), [greedy] * 3, [None] * 3).token_ids == [3, 3, 3]
    mixed = [greedy, SamplingParams(temperature=1.0, seed=1), greedy]
    res = sample(logits.clone(), mixed, [None, torch.Generator().manual_seed(1), None])
    assert res.token_ids[0] == res.token_ids[2] == 3
    assert res.token_ids[1] in (3, 7, 30)


def test_top_k_one_and_tiny_top_p_reduce_to_greedy():
    logits = logits_rows(3)
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6),
              SamplingParams(temperature=0.7, min_p=1.0)]
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    assert sample(logits.clone(), params, gens).token_ids == logits.argmax(-1).tolist()


def test_a_top_p_below_float32_keeps_the_most_likely_token():
    """1e-40 is a float32 denormal, 0 where the CPU flushes them, as the engine's CPU steps do: the top token
    still stays, never none."""
    logits = logits_rows(2)
    params = [SamplingParams(temperature=1.0, top_p=1e-40, seed=1), SamplingParams(temperature=1.0, top_p=1e-45)]
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    torch.set_flush_denormal(True)
    try:
        assert sample(logits.clone(), params, gens).token_ids == logits.argmax(-1).tolist()
    finally:
        torch.set_flush_denormal(False)


def test_seeds_at_the_ends_of_the_64_bit_range_are_taken():
    for seed in (-(1 << 63), (1 << 64) - 1):
        logits = logits_rows(1)
        params = SamplingParams(temperature=1.0, seed=seed)
        assert 0 <= sample(logits, [params], [torch.Generator().manual_seed(seed)]).token_ids[0] < 50


def test_top_k_limits_the_support():
    logits = logits_rows(1, seed=3)
    allowed = set(logits[0].topk(3).indices.tolist())
    gen = torch.Generator().manual_seed(0)
    seen = {sample(logits.clone(), [SamplingParams(temperature=2.0, top_k=3)], [gen]).token_ids[0] for _ in range(200)}
    assert seen <= allowed and len(seen) == 3


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two (0.5 < 0.7 <= 0.8)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    seen = {sample(logits.clone(), [SamplingParams(top_p=0.7)], [gen]).token_ids[0] for _ in range(300)}
    assert seen == {0, 1}


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs).unsqueeze(0)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(logits.clone(), [SamplingParams()], [gen]).token_ids[0]] += 1
    assert torch.allclose(counts / counts.sum(), probs, atol=0.03)


def test_same_seed_same_tokens_whatever_the_batch():
    logits = logits_rows(5, seed=7)
    target = SamplingParams(temperature=1.0, seed=1234)
    alone = []
    gen = torch.Generator().manual_seed(1234)
    for _ in range(10):
        alone.append(sample(logits[2:3].clone(), [target], [gen]).token_ids[0])
    batched = []
    gen = torch.Generator().manual_seed(1234)
    others = [torch.Generator().manual_seed(i) for i in range(4)]
    for _ in range(10):
        params = [SamplingParams(temperature=0.5)] * 2 + [target] + [SamplingParams(temperature=0)] * 2
        gens = [*others[:2], gen, *others[2:]]
        batched.append(sample(logits.clone(), params, gens).token_ids[2])
    assert alone == batched


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = logits_rows(2)
    res = sample(logits.clone(), [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0)], [None] * 2)
    chosen_lp, top = res.logprobs[0]
    ref = torch.log_softmax(logits[0], -1)
    assert chosen_lp == pytest.approx(ref.max().item(), abs=1e-6)
    assert [t for t, _ in top] == ref.topk(3).indices.tolist()
    assert res.logprobs[1] is None


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": -1}, {"max_tokens": 0}, {"top_p": 0.0}, {"top_p": 1.5}, {"temperature": float("nan")},
    {"temperature": -0.1}, {"top_k": -2}, {"min_p": 2.0}, {"seed": "x"}, {"stop": [""]}, {"logprobs": 100},
    {"max_tokens": True}, {"logprobs": True}, {"stop_token_ids": [True]}, {"seed": 1 << 64}, {"seed": -(1 << 63) - 1},
    {"ignore_eos": "no"}, {"deterministic": "no"}, {"skip_special_tokens": None},
    {"include_stop_str_in_output": 1}, {"speculative": 0},
])
def test_invalid_parameters_raise_invalid_request(kwargs):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.code == "invalid_request"
