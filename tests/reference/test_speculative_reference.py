"""SmolLM2 (fp32): greedy tokens with prompt-lookup or draft-model drafts equal the tokens without them.

Copy-heavy prompts (correct a transcript chunk, quote a document) next to free
chat, as one batch; then under preemption (a KV pool too small for the batch)
and again over prefix-cache hits.
"""

from __future__ import annotations

import pytest

from bench.speculative import (
    ASR_CHUNKS,
    CHAT_QUESTIONS,
    DOCUMENT,
    QUOTE_QUESTIONS,
    asr_requests,
    chat_requests,
)
from engine import LLM, SamplingParams
from tests.unit.engine.test_speculative import assert_same_greedy

pytestmark = pytest.mark.reference

SPEC = dict(speculative_method="prompt_lookup", num_speculative_tokens=4)


def batch(tok) -> list[list[int]]:
    return ([ids for ids, _ in asr_requests(tok, 3)] + [ids for ids, _ in chat_requests(tok, QUOTE_QUESTIONS[:3],
                                                                                          DOCUMENT, 64)]
            + [ids for ids, _ in chat_requests(tok, CHAT_QUESTIONS[:2], None, 64)])


@pytest.fixture(scope="module")
def baseline():
    llm = LLM(model="smollm2", dtype="float32")
    prompts = batch(llm.tokenizer)
    return prompts, llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0, logprobs=5))


@pytest.mark.parametrize("variant", ["batch", "preemption", "prefix-cache", "draft-model"])
def test_smollm2_greedy_tokens_with_drafts_equal_without(baseline, variant):
    prompts, ref = baseline
    assert len(ASR_CHUNKS) >= 3
    options = dict(kv_cache_memory_bytes=24 * 2**20) if variant == "preemption" else {}
    # SmolLM2 has no smaller sibling here: as its own draft model, the drafts are its own greedy tokens.
    spec = dict(SPEC, speculative_method="draft_model", draft_model="smollm2") if variant == "draft-model" else SPEC
    llm = LLM(model="smollm2", dtype="float32", **options, **spec)
    params = SamplingParams(max_tokens=64, temperature=0)
    if variant == "prefix-cache":
        llm.generate(prompts, params)
    outs = llm.generate(prompts, params)
    stats = llm.engine.last_stats
    assert stats.spec_accepted_tokens > 100
    if variant == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    if variant == "prefix-cache":
        assert all(o.num_cached_tokens > 0 for o in outs)
    assert_same_greedy(ref, outs)
