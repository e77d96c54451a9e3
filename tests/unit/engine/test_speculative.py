"""Speculative decoding: drafts change how many tokens a step emits, never which tokens.

Greedy outputs with prompt-lookup drafts equal those without, across batch
mixes, preemption, prefix-cache hits, masks and an int8 KV cache; sampled
outputs keep their distribution (a two-sample chi-square test on a tiny
model); rejected drafts never reach a cached block.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from engine import LLM, SamplingParams
from engine.attention.metadata import MaskSpec
from engine.block_manager import hash_block
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.request import Request
from engine.speculative import PromptLookupProposer

SPEC = dict(speculative_method="prompt_lookup", num_speculative_tokens=4, prompt_lookup_min=1)


def copy_prompts() -> list[list[int]]:
    """Prompts whose greedy continuations repeat spans of themselves, next to free ones."""
    rng = random.Random(7)
    text = [rng.randrange(3, 320) for _ in range(36)]
    return [text * 3, text + text[:12], [rng.randrange(3, 320) for _ in range(21)], text[5:30] * 2,
            [rng.randrange(3, 320) for _ in range(50)]]


def generate(path, prompts, params, masks=None, **options):
    llm = LLM(model=str(path), dtype="float32", block_size=8, **options)
    return llm.generate(prompts, params, masks=masks), llm.engine


def assert_same_greedy(baseline, outs):
    """Identical tokens, or a first divergence at a near-tie of the baseline's logits (fp32 rounding
    differs between a decode row and a row of a drafted chunk)."""
    for ref, out in zip(baseline, outs, strict=True):
        assert out.finish_reason == ref.finish_reason or out.token_ids != ref.token_ids
        if out.token_ids == ref.token_ids:
            continue
        i = next(j for j, (a, b) in enumerate(zip(ref.token_ids, out.token_ids, strict=False)) if a != b)
        top = dict(ref.logprobs[i][1])
        assert out.token_ids[i] in top and abs(top[out.token_ids[i]] - top[ref.token_ids[i]]) < 1e-3, \
            f"diverged at {i} without a tie"


GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
GREEDY_LP = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def baseline(tiny_llama):
    outs, _ = generate(tiny_llama, copy_prompts(), GREEDY_LP, num_kv_blocks=256)
    return outs


# ---- the proposer ---------------------------------------------------------

def request(tokens: list[int], prompt_len: int | None = None) -> Request:
    req = Request("r", tokens[:prompt_len], SamplingParams(), frozenset())
    req.token_ids = list(tokens)
    return req


def test_prompt_lookup_proposes_what_followed_the_most_recent_longest_match():
    proposer = PromptLookupProposer(max_n=3, min_n=1)
    # "1 2 3" occurs twice before the suffix; the later occurrence wins.
    assert proposer.propose(request([1, 2, 3, 4, 5, 9, 1, 2, 3, 6, 7, 8, 1, 2, 3]), 3) == [6, 7, 8]
    # The 3-gram "5 1 2" is unmatched; the 2-gram "1 2" matches at the start.
    assert proposer.propose(request([1, 2, 7, 7, 5, 1, 2]), 2) == [7, 7]
    assert proposer.propose(request([1, 2, 3, 4, 2, 3]), 10) == [4, 2, 3]  # up to the end of the tokens
    assert proposer.propose(request([1, 2, 3, 4]), 4) == []
    assert PromptLookupProposer(3, 2).propose(request([1, 2, 3, 5, 3]), 4) == []  # only a 1-gram matches


def test_config_validates_speculation():
    with pytest.raises(InvalidRequestError):
        EngineConfig(speculative_method="eagle")
    with pytest.raises(InvalidRequestError):
        EngineConfig(speculative_method="prompt_lookup", async_scheduling=True)
    with pytest.raises(InvalidRequestError):
        EngineConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(InvalidRequestError):
        SamplingParams(speculative="yes")


# ---- greedy: the same tokens ----------------------------------------------

def test_greedy_with_drafts_equals_without(tiny_llama, baseline):
    outs, engine = generate(tiny_llama, copy_prompts(), GREEDY, num_kv_blocks=256, **SPEC)
    stats = engine.last_stats
    assert stats.spec_accepted_tokens > 20 and 0 < stats.spec_acceptance_rate < 1
    assert engine._steps < 40 + 4  # several tokens per step on the copy-heavy prompts
    assert_same_greedy(baseline, outs)


@pytest.mark.slow
def test_streamed_deltas_carry_every_accepted_token_in_order(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=8, **SPEC)
    prompt = copy_prompts()[0]
    llm.engine.add_request("r", prompt, GREEDY)
    deltas: list[list[int]] = []
    final = None
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            deltas.append(out.new_token_ids)
            final = out
    assert max(len(d) for d in deltas) > 1
    assert [t for d in deltas for t in d] == final.token_ids and len(final.token_ids) == 40


def test_greedy_with_drafts_under_preemption(tiny_llama, baseline):
    outs, engine = generate(tiny_llama, copy_prompts(), GREEDY, num_kv_blocks=40, **SPEC)
    assert engine.scheduler.num_preemptions > 0 and engine.last_stats.spec_accepted_tokens > 0
    assert_same_greedy(baseline, outs)


def test_greedy_with_drafts_over_prefix_cache_hits(tiny_llama, baseline):
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=8, num_kv_blocks=256, **SPEC)
    first = llm.generate(copy_prompts(), GREEDY)
    again = llm.generate(copy_prompts(), GREEDY)
    assert all(o.num_cached_tokens > 0 for o in again[:2])
    assert_same_greedy(baseline, first)
    assert_same_greedy(baseline, again)


def test_greedy_with_drafts_small_budget_mixes_prefill_chunks_and_drafts(tiny_llama, baseline):
    outs, engine = generate(tiny_llama, copy_prompts(), GREEDY, num_kv_blocks=256, max_num_batched_tokens=24,
                            max_num_seqs=3, **SPEC)
    assert engine.last_stats.spec_accepted_tokens > 0
    assert_same_greedy(baseline, outs)


def test_greedy_with_drafts_through_the_one_call_decoder(tiny_llama, baseline, decode_layers_calls):
    # Packed weights run decode-only steps in one C++ call; split_rows 1 would give each thread its own rows,
    # which a draft's rows (reading each other's K/V) must not be.
    outs, engine = generate(tiny_llama, copy_prompts(), GREEDY, num_kv_blocks=256, cpu_prepack_weights=True,
                            cpu_decode_split_rows=1, **SPEC)
    assert engine.last_stats.spec_accepted_tokens > 0
    if engine.model.fused_decoder is not None:
        assert max(decode_layers_calls) > len(copy_prompts())  # drafted rows went through it
    assert_same_greedy(baseline, outs)


def test_drafted_rows_are_never_split_over_threads(tiny_llama, baseline, monkeypatch):
    # A draft's rows read each other's K/V inside a layer, so a step with drafts keeps all rows in one group,
    # whatever split_rows says; steps without drafts still split (a race would be timing-dependent, so the
    # test checks the split the kernel is asked for).
    from engine.kernels.cpu_build import cpu_kernels
    from engine.models.fused_decode import FusedDecoder

    ops = cpu_kernels()
    assert ops is not None, "the C++ kernels did not build"
    real_kernel, real_run, drafted, splits = ops.decode_layers, FusedDecoder.run_layers, [], []

    def run_layers(self, x, positions, kv_caches, meta, token_table=None):
        drafted.append(meta.multi_row_decodes)
        return real_run(self, x, positions, kv_caches, meta, token_table)

    monkeypatch.setattr(FusedDecoder, "run_layers", run_layers)
    monkeypatch.setattr(ops, "decode_layers", lambda *a: splits.append(a[-1]) or real_kernel(*a))
    outs, engine = generate(tiny_llama, copy_prompts(), GREEDY, num_kv_blocks=256, cpu_prepack_weights=True,
                            cpu_decode_split_rows=1, **SPEC)
    assert engine.model.fused_decoder is not None
    assert len(drafted) == len(splits) and any(drafted) and not all(drafted)
    assert all(split >= 1 << 30 for d, split in zip(drafted, splits, strict=True) if d)
    assert all(split == 1 for d, split in zip(drafted, splits, strict=True) if not d)
    assert_same_greedy(baseline, outs)


def test_greedy_with_drafts_through_bucketed_decode_graphs(tiny_llama, baseline):
    # A drafted request's rows are decode rows, so a step with drafts replays the captured decode graph of
    # the bucket that holds all its rows (padded). Here the same padding runs eagerly, as on a GPU it replays.
    import torch

    from engine.cuda_graphs import DecodeGraphs

    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=8, num_kv_blocks=256, **SPEC)
    eng = llm.engine
    graphs = DecodeGraphs(eng.model, eng.kv_caches, 8, scratch_block=eng.layout.num_blocks,
                          max_blocks=eng.max_model_len // 8, max_batch=32, device=torch.device("cpu"),
                          use_graphs=False)
    real, rows = graphs.run, []
    graphs.run = lambda ids, *a: rows.append(ids.shape[0]) or real(ids, *a)
    eng.runner.graphs = graphs
    outs = llm.generate(copy_prompts(), GREEDY)
    assert eng.last_stats.spec_accepted_tokens > 0
    assert max(rows) > len(copy_prompts())  # steps with drafts went through the graph path
    assert_same_greedy(baseline, outs)


@pytest.mark.slow
def test_greedy_with_drafts_with_int8_kv_and_a_bidirectional_chunk(tiny_llama):
    prompts = copy_prompts()[:3]
    masks = [MaskSpec("chunk_bidirectional", start=4, end=30), MaskSpec(), MaskSpec("chunk_bidirectional", 2, 9)]
    ref, _ = generate(tiny_llama, prompts, GREEDY_LP, masks=masks, cache_bits=8)
    outs, engine = generate(tiny_llama, prompts, GREEDY, masks=masks, cache_bits=8, **SPEC)
    assert engine.last_stats.spec_accepted_tokens > 0
    assert_same_greedy(ref, outs)


@pytest.mark.slow
def test_stops_inside_an_accepted_run_truncate_it(tiny_llama, baseline):
    # Stop at a token the baseline emits mid-run, and cap max_tokens at an odd length.
    stop_at = baseline[0].token_ids[17]
    for params in (SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop_at], ignore_eos=True),
                   SamplingParams(max_tokens=13, temperature=0, ignore_eos=True)):
        ref, _ = generate(tiny_llama, copy_prompts(), params)
        outs, _ = generate(tiny_llama, copy_prompts(), params, **SPEC)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
        assert [o.finish_reason for o in outs] == [o.finish_reason for o in ref]


@pytest.mark.slow
def test_stop_string_inside_an_accepted_run(tiny_llama, baseline):
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=8)
    text = llm.tokenizer.decode(baseline[0].token_ids)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(stop,))
    ref = llm.generate(copy_prompts()[:1], params)
    outs, _ = generate(tiny_llama, copy_prompts()[:1], params, **SPEC)
    assert (outs[0].text, outs[0].token_ids, outs[0].finish_reason) == \
        (ref[0].text, ref[0].token_ids, ref[0].finish_reason)


def test_a_request_can_turn_drafts_off(tiny_llama):
    _, engine = generate(tiny_llama, copy_prompts(), SamplingParams(max_tokens=20, temperature=0,
                                                                       speculative=False), **SPEC)
    assert engine.last_stats.spec_draft_tokens == 0


# ---- rollback: no unverified token in a cached block ------------------------

class WrongProposer:
    """Drafts that are mostly wrong: the last tokens again, shifted by one."""

    def propose(self, req, max_tokens):
        return [(t + 1) % 320 or 3 for t in req.token_ids[-max_tokens:]]


def test_rejected_drafts_never_reach_the_prefix_cache(tiny_llama, baseline):
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=8, num_kv_blocks=60, **SPEC)
    engine = llm.engine
    engine.scheduler.proposer = WrongProposer()
    outs = llm.generate(copy_prompts(), GREEDY)
    stats = engine.last_stats
    assert stats.spec_draft_tokens > 4 * stats.spec_accepted_tokens  # mostly rejected
    assert_same_greedy(baseline, outs)
    # Every hash in the cache is the hash of a block of verified tokens.
    bs, valid = 8, set()
    for out in outs:
        tokens, parent = out.prompt_token_ids + out.token_ids, None
        for i in range(len(tokens) // bs):
            parent = hash_block(parent, tokens[i * bs:(i + 1) * bs])
            valid.add(parent)
    bm = engine.block_manager
    assert bm.num_cached_blocks > 0
    assert set(bm._cached) <= valid


def test_request_tokens_hold_no_draft_between_steps(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32", block_size=8, **SPEC)
    engine = llm.engine
    engine.scheduler.proposer = WrongProposer()
    req = engine.add_request("r", copy_prompts()[0], GREEDY)
    emitted: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            emitted += out.new_token_ids
        if not req.is_finished:
            assert req.token_ids == req.prompt_token_ids + emitted
            assert req.num_computed_tokens == req.num_tokens - 1
            assert req.num_registered_blocks <= req.num_computed_tokens // 8
    assert req.draft_limit == 1  # drafts that keep failing shrink to one token


# ---- sampling: the same distribution ------------------------------------------

class FixedProposer:
    def __init__(self, tokens):
        self.tokens = tokens

    def propose(self, req, max_tokens):
        return self.tokens[:max_tokens]


def chi_square_two_sample(a: Counter, b: Counter) -> tuple[float, int]:
    """Statistic and degrees of freedom of the two-sample chi-square test (equal sample sizes)."""
    keys = set(a) | set(b)
    stat = sum((a[k] - b[k]) ** 2 / (a[k] + b[k]) for k in keys)
    return stat, len(keys) - 1


def sample_runs(path, prompt, params, n, seed0, proposer=None):
    options = SPEC if proposer is not None else {}
    llm = LLM(model=str(path), dtype="float32", block_size=8, max_num_seqs=128, **options)
    if proposer is not None:
        llm.engine.scheduler.proposer = proposer
    runs = [SamplingParams(max_tokens=3, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                           ignore_eos=True, seed=seed0 + i) for i in range(n)]
    outs = llm.generate([prompt] * n, runs)
    return Counter(tuple(o.token_ids) for o in outs), llm.engine.last_stats


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [dict(temperature=1.0, top_k=3), dict(temperature=0.5, top_k=4, top_p=0.7)],
                         ids=["top_k", "top_p"])
def test_sampled_tokens_keep_their_distribution(tiny_llama, sampling):
    prompt = copy_prompts()[2]
    params = SamplingParams(**sampling)
    # The tiny model's logits are nearly flat, so top-k keeps the outcomes few enough to count. At this size
    # the test fails a rule that forgets to remove the rejected token from the residual (statistic ~3x bound).
    n = 1000
    plain, _ = sample_runs(tiny_llama, prompt, params, n, seed0=0)
    # Draft the most common 2nd and 3rd tokens (often accepted), and a token outside the top-k (always rejected).
    second = Counter(t[1] for t in plain.elements()).most_common(1)[0][0]
    third = Counter(t[2] for t in plain.elements()).most_common(1)[0][0]
    for draft in ([second, third], [second, 319]):
        spec, stats = sample_runs(tiny_llama, prompt, params, n, seed0=10**6, proposer=FixedProposer(draft))
        assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
        stat, dof = chi_square_two_sample(plain, spec)
        # The 0.999 quantile of chi-square(dof) is below dof + 3.3 sqrt(2 dof) + 10 for these sizes.
        assert stat < dof + 3.3 * (2 * dof) ** 0.5 + 10, (stat, dof, plain.most_common(5), spec.most_common(5))


# ---- configuration through the service ------------------------------------------

def test_service_config_maps_speculation_into_the_engine_and_chat_opts_in():
    from engine.errors import InvalidRequestError
    from schemas import ChatRequest, Message
    from worker.config import ConfigError, ServiceConfig, load_config
    from worker.config_sections import SpeculativeConfig
    from worker.handlers.chat import sampling_params_for

    engine = ServiceConfig(speculative=SpeculativeConfig(method="prompt_lookup", k=3, n=5, n_min=3)).engine_config()
    assert (engine.speculative_method, engine.num_speculative_tokens, engine.prompt_lookup_max,
            engine.prompt_lookup_min) == ("prompt_lookup", 3, 5, 3)
    assert ServiceConfig().engine_config().speculative_method is None
    drafted = ServiceConfig(speculative=SpeculativeConfig(method="draft_model", draft_model="smollm2",
                                                          draft_kv_cache_bytes=64 << 20)).engine_config()
    assert (drafted.speculative_method, drafted.draft_model, drafted.draft_kv_cache_bytes) == (
        "draft_model", "smollm2", 64 << 20)
    with pytest.raises(InvalidRequestError, match="n_min: must be <= n"):
        SpeculativeConfig(n=2, n_min=3)
    with pytest.raises(ConfigError, match=r"speculative\.n_min"):
        load_config(None, env={"INFINILM__SPECULATIVE__N": "2", "INFINILM__SPECULATIVE__N_MIN": "3"})
    req = ChatRequest(id="r", messages=[Message(role="user", content="hi")], max_tokens=8)
    assert not sampling_params_for(req).speculative  # chat drafts only with speculative.chat: true
    assert sampling_params_for(req, speculative=True).speculative
