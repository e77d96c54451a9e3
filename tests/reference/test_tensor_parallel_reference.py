"""SmolLM2-135M (the packaged GGUF import) with tensor parallelism against one process, on the CPU in fp32.

SmolLM2 has 9 attention heads and 3 KV heads, so 2 ranks cannot split it (start-up says so:
tests/unit/engine/test_tensor_parallel.py); 3 ranks hold 3 query heads and 1 KV head each.
"""

from __future__ import annotations

import multiprocessing

import pytest

from engine import LLM, SamplingParams

pytestmark = [pytest.mark.reference, pytest.mark.slow]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Explain in two sentences why Kafka consumer groups help scale inference "
                                 "workers, and what happens to a partition when a worker dies."}],
    [{"role": "user", "content": "Name three colours."}],
]
MAX_TOKENS = 20


def _run(tp: int):
    # Chunked prefill (a 32-token budget), a pool too small for the batch (preemption; ignore_eos keeps the
    # short answers running), and a second round over the first chat (prefix-cache hits).
    with LLM(model="smollm2", dtype="float32", device="cpu", tensor_parallel_size=tp, num_kv_blocks=8,
             block_size=16, max_num_batched_tokens=32, max_num_seqs=3, enable_prefix_caching=True) as llm:
        assert len(multiprocessing.active_children()) == tp - 1
        tok = llm.tokenizer
        prompts = [tok.encode(tok.apply_chat_template(c), add_special_tokens=False) for c in CHATS]
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=5, ignore_eos=True)
        outs = llm.generate(prompts, params) + llm.generate(prompts[:1], params)
        return outs, llm.engine.scheduler.num_preemptions, llm.engine.block_manager.prefix_hits


def test_smollm2_on_three_ranks_gives_the_greedy_tokens_and_logprobs_of_one():
    one, preempted_1, hits_1 = _run(1)
    three, preempted_3, hits_3 = _run(3)
    assert preempted_1 > 0 and preempted_3 > 0
    assert hits_1 > 0 and hits_3 > 0
    for a, b in zip(one, three, strict=True):
        assert a.error is None and b.error is None
        assert a.token_ids == b.token_ids
        for (lp_a, _), (lp_b, _) in zip(a.logprobs, b.logprobs, strict=True):
            assert lp_b == pytest.approx(lp_a, abs=1e-3)
