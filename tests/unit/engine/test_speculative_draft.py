"""Draft-model speculative decoding: a second, smaller model with the same tokenizer drafts; the target verifies.

Greedy outputs equal the target's own without speculation, with a draft that agrees with the target (the
target as its own draft: nearly every draft accepted) and with one that mostly does not (another random
model), across batch mixes, preemption and prefix-cache hits.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.draft_model import DraftModelProposer
from engine.errors import InvalidRequestError
from tests.conftest import write_tiny_model
from tests.unit.engine.test_speculative import (
    GREEDY,
    assert_same_greedy,
    chi_square_two_sample,
    copy_prompts,
    generate,
    sample_runs,
)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A one-layer random model with the tiny models' tokenizer and vocabulary."""
    return write_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=5, num_hidden_layers=1,
                            hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def baseline(tiny_llama):
    outs, _ = generate(tiny_llama, copy_prompts(), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                                  logprobs=5), num_kv_blocks=256)
    return outs


def spec(draft) -> dict:
    return dict(speculative_method="draft_model", draft_model=str(draft), num_speculative_tokens=4,
                draft_kv_cache_bytes=8 << 20)


def test_the_target_as_its_own_draft_is_nearly_always_accepted(tiny_llama, baseline):
    outs, engine = generate(tiny_llama, copy_prompts(), GREEDY, num_kv_blocks=256, **spec(tiny_llama))
    assert isinstance(engine.scheduler.proposer, DraftModelProposer)
    stats = engine.last_stats
    assert stats.spec_draft_tokens > 100 and stats.spec_acceptance_rate > 0.9
    assert engine._steps < 40 // 2  # several tokens a step
    assert_same_greedy(baseline, outs)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["batch", "preemption", "small-budget", "prefix-cache"])
def test_greedy_with_a_draft_model_equals_without(tiny_llama, other_draft, baseline, variant):
    options = {"batch": dict(num_kv_blocks=256), "preemption": dict(num_kv_blocks=40),
               "small-budget": dict(num_kv_blocks=256, max_num_batched_tokens=24, max_num_seqs=3),
               "prefix-cache": dict(num_kv_blocks=256)}[variant]
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=8, **options, **spec(other_draft))
    if variant == "prefix-cache":
        llm.generate(copy_prompts(), GREEDY)
    outs = llm.generate(copy_prompts(), GREEDY)
    engine = llm.engine
    assert engine.last_stats.spec_draft_tokens > 0
    if variant == "preemption":
        assert engine.scheduler.num_preemptions > 0
    if variant == "prefix-cache":
        assert all(o.num_cached_tokens > 0 for o in outs[:2])
    assert_same_greedy(baseline, outs)


def test_the_draft_engine_reuses_its_prefix_cache_across_proposals(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=8, num_kv_blocks=256, **spec(tiny_llama))
    llm.generate(copy_prompts()[:1], GREEDY)
    draft = llm.engine.scheduler.proposer.engine
    # Each proposal re-reads the request's tokens; all but the tail since the last full block are cache hits.
    assert draft.block_manager.hit_rate > 0.5
    assert not draft.has_unfinished_requests() and not draft.take_kv_events()


def test_draft_model_config_is_validated(tiny_llama, tmp_path):
    with pytest.raises(InvalidRequestError, match="method draft_model needs draft_model"):
        EngineConfig(model=str(tiny_llama), speculative_method="draft_model")
    with pytest.raises(InvalidRequestError, match="only read with method: draft_model"):
        EngineConfig(model=str(tiny_llama), speculative_method="prompt_lookup", draft_model=str(tiny_llama))
    bigger = write_tiny_model(tmp_path / "bigger-vocab", "llama", vocab_size=400)
    with pytest.raises(InvalidRequestError, match="does not share the target model's tokenizer"):
        LLM(model=str(tiny_llama), dtype="float32", **spec(bigger))


@pytest.mark.slow
def test_sampled_tokens_with_model_drafts_keep_their_distribution(tiny_llama):
    prompt = copy_prompts()[2]
    params = SamplingParams(temperature=1.0, top_k=3)
    n = 1000
    plain, _ = sample_runs(tiny_llama, prompt, params, n, seed0=0)
    proposer = LLM(model=str(tiny_llama), dtype="float32", block_size=8, **spec(tiny_llama)
                   ).engine.scheduler.proposer
    drafted, stats = sample_runs(tiny_llama, prompt, params, n, seed0=10**6, proposer=proposer)
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    stat, dof = chi_square_two_sample(plain, drafted)
    assert stat < dof + 3.3 * (2 * dof) ** 0.5 + 10, (stat, dof, plain.most_common(5), drafted.most_common(5))
