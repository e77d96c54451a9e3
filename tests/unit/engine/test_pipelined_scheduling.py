"""Pipelined scheduling (config.async_scheduling) gives what the synchronous loop gives.

The pipeline builds step N+1 before step N's tokens are known, with PLACEHOLDER
tokens that the runner fills in on the device. It is on by default for CUDA
only; these tests force it on for the CPU, where the same code paths run (the
device copy is then a plain tensor), and compare against the synchronous loop.
"""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.request import PLACEHOLDER
from tests.unit.engine.test_engine_equivalence import assert_same_greedy


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    shared = [rng.randrange(3, 320) for _ in range(24)]
    return [shared + [rng.randrange(3, 320) for _ in range(n)] for n in (1, 9, 30)] + [
        [rng.randrange(3, 320) for _ in range(n)] for n in (5, 17, 70)]


def make(path, pipelined: bool, **options) -> LLM:
    llm = LLM(model=str(path), dtype="float32", block_size=8, async_scheduling=pipelined, **options)
    assert llm.engine.pipelined is pipelined
    return llm


def check_clean(llm: LLM, outs) -> None:
    """Nothing leaked: every block back in the pool, no placeholder handed out, nothing in flight."""
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished_requests()
    for o in outs:
        assert PLACEHOLDER not in o.token_ids


def stop_tokens_from(outs, position: int) -> list[int]:
    """For each request, the token it produced at `position`: used as its stop token id."""
    return [o.token_ids[position] for o in outs]


@pytest.mark.parametrize("options", [
    dict(num_kv_blocks=256, max_num_batched_tokens=4096),
    dict(num_kv_blocks=18, max_num_batched_tokens=32),  # chunked prefill and preemption
    dict(num_kv_blocks=256, max_num_batched_tokens=4096, enable_prefix_caching=False),
], ids=["plain", "chunked-preempted", "no-prefix-cache"])
def test_greedy_outputs_match_the_synchronous_loop(tiny_llama, options):
    base = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logprobs=3)
    sync = make(tiny_llama, False, **options)
    reference = sync.generate(prompts(), base)
    # Stop some requests on a token they produce mid-way, as an EOS would: the pipeline has then
    # already launched their next step, whose token must be dropped.
    stops = stop_tokens_from(reference, 4)
    params = [SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logprobs=3,
                             stop_token_ids=[t] if i % 2 == 0 else []) for i, t in enumerate(stops)]
    want = sync.generate(prompts(), params)
    pipe = make(tiny_llama, True, **options)
    got = pipe.generate(prompts(), params)
    assert_same_greedy(got, want)
    for g, w in zip(got, want, strict=True):
        assert g.finish_reason == w.finish_reason
        assert len(g.token_ids) == len(w.token_ids)
        assert len(g.logprobs) == len(g.token_ids)
        for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids, strict=True)):
            if a != b:
                break
            assert len(g.logprobs[i][1]) == 3
            assert g.logprobs[i][0] == pytest.approx(w.logprobs[i][0], abs=1e-4)
    assert [o.finish_reason for o in got[::2]] == ["stop"] * 3
    if options["num_kv_blocks"] == 18:
        assert pipe.engine.scheduler.num_preemptions > 0
    check_clean(pipe, got)


def test_seeded_sampling_matches_the_synchronous_loop(tiny_llama):
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts()))]
    want = make(tiny_llama, False, num_kv_blocks=256).generate(prompts(), params)
    pipe = make(tiny_llama, True, num_kv_blocks=256)
    got = pipe.generate(prompts(), params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    check_clean(pipe, got)


def test_stop_strings_and_banned_phrases_match(tiny_llama):
    texts = ["hello there", "a quick brown fox", "zzz"]
    free = make(tiny_llama, False, num_kv_blocks=256).generate(
        texts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    # A stop string taken from each free-running text (its first ASCII character after the first
    # character), and the first text's second token banned as a phrase.
    stops = [next(c for c in o.text[1:] if ord(c) < 128) for o in free]
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[c]) for c in stops]
    sync = make(tiny_llama, False, num_kv_blocks=256)
    banned_token = free[0].token_ids[1]
    params[0] = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                               banned_phrases=[sync.engine.tokenizer.decode([banned_token], False)])
    want = sync.generate(texts, params)
    pipe = make(tiny_llama, True, num_kv_blocks=256)
    got = pipe.generate(texts, params)
    assert [(o.text, o.finish_reason, o.token_ids) for o in got] == \
        [(o.text, o.finish_reason, o.token_ids) for o in want]
    assert [o.finish_reason for o in got[1:]] == ["stop", "stop"]
    assert banned_token not in got[0].token_ids and got[0].token_ids != free[0].token_ids
    check_clean(pipe, got)


def test_abort_while_a_step_is_in_flight(tiny_llama):
    pipe = make(tiny_llama, True, num_kv_blocks=256)
    engine = pipe.engine
    for i, p in enumerate(prompts()[:3]):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    outs = []
    for _ in range(3):
        outs += engine.step()
    assert engine._inflight is not None  # r1 has a token on its way
    assert engine.abort_request("r1")
    while engine.has_unfinished_requests():
        outs += engine.step()
    final = {o.request_id: o for o in outs if o.finished}
    assert final["r1"].finish_reason == "abort"
    assert len(final["r0"].token_ids) == len(final["r2"].token_ids) == 10
    assert PLACEHOLDER not in final["r1"].token_ids
    check_clean(pipe, list(final.values()))


def test_a_failed_launch_fails_its_requests_only(tiny_llama, monkeypatch):
    pipe = make(tiny_llama, True, num_kv_blocks=256)
    engine = pipe.engine
    real, calls = engine.runner.launch, []

    def flaky(sched, previous=None):
        calls.append(sorted(s.request_id for s in sched.scheduled))
        if len(calls) == 3:
            raise RuntimeError("device fault")
        return real(sched, previous)

    monkeypatch.setattr(engine.runner, "launch", flaky)
    engine.add_request("a", prompts()[0], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    outs = []
    for _ in range(4):
        outs += engine.step()
    engine.add_request("b", prompts()[1], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        outs += engine.step()
    final = {o.request_id: o for o in outs if o.finished}
    assert final["a"].finish_reason == "error" and final["a"].error.code == "internal"
    assert final["b"].finish_reason == "length" and len(final["b"].token_ids) == 6
    check_clean(pipe, list(final.values()))


def test_outputs_arrive_one_step_later_and_in_full(tiny_llama):
    """The pipelined loop returns step N's outputs from call N+1; every token still arrives once."""
    pipe = make(tiny_llama, True, num_kv_blocks=256)
    engine = pipe.engine
    engine.add_request("x", prompts()[3], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    first = engine.step()  # launches the prefill; nothing collected yet
    assert first == []
    streamed, calls = [], 1
    while engine.has_unfinished_requests():
        for o in engine.step():
            streamed += o.new_token_ids
        calls += 1
    assert len(streamed) == 5
    assert calls == 6  # five launches, then one call that only collects the last


def test_masked_requests_take_their_pipelined_tokens_through_the_prefill_path(tiny_llama):
    """After a custom-mask prefill, a request's one-token steps are prefill spans, not decodes; their
    placeholder input must be filled in there too."""
    from engine.attention.metadata import MaskSpec

    ps = prompts()[:4]
    masks = [MaskSpec("chunk_bidirectional", start=4, end=12), MaskSpec(), MaskSpec("prefix_bidirectional", end=6),
             MaskSpec("packed_segments", start=3, segment_starts=(3, 20))]
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, logprobs=2)
    want = make(tiny_llama, False, num_kv_blocks=256).generate(ps, params, masks=masks)
    pipe = make(tiny_llama, True, num_kv_blocks=256)
    runner, filled = pipe.engine.runner, []
    real = runner._fill_placeholders

    def spy(input_ids, holes, previous):
        filled.extend(holes)
        return real(input_ids, holes, previous)

    runner._fill_placeholders = spy
    got = pipe.generate(ps, params, masks=masks)
    assert_same_greedy(got, want)
    assert all(len(o.token_ids) == 9 for o in got)
    masked = {o.request_id for o, m in zip(got, masks, strict=True) if not m.is_causal}
    assert masked <= {rid for _, rid in filled}  # their one-token steps were filled in too
    check_clean(pipe, got)


def test_deterministic_requests_are_bitwise_the_same(tiny_llama):
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2, deterministic=True, temperature=0)
    want = make(tiny_llama, False, num_kv_blocks=256).generate(prompts(), params)
    pipe = make(tiny_llama, True, num_kv_blocks=256)
    got = pipe.generate(prompts(), params)
    assert [(o.token_ids, o.logprobs) for o in got] == [(o.token_ids, o.logprobs) for o in want]
    check_clean(pipe, got)


@pytest.mark.parametrize("window", [0, 8])
def test_int8_kv_cache_pipelined(tiny_llama, window):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    options = dict(num_kv_blocks=256, cache_bits=8, kv_fp_window=window)
    want = make(tiny_llama, False, **options).generate(prompts(), params)
    pipe = make(tiny_llama, True, **options)
    got = pipe.generate(prompts(), params)
    assert_same_greedy(got, want)
    check_clean(pipe, got)


def test_a_failed_graph_capture_leaves_eager_decode_steps(tiny_llama, caplog):
    """CUDA-graph capture only runs on a GPU; a stand-in whose capture raises shows the engine then serves
    eagerly (with a warning) instead of failing to start."""

    class BrokenGraphs:
        def capture(self):
            raise RuntimeError("operation not permitted when stream is capturing")

    llm = make(tiny_llama, True, num_kv_blocks=256)
    engine = llm.engine
    engine.runner.graphs = BrokenGraphs()
    with caplog.at_level("WARNING", logger="engine.engine_core"):
        engine._capture_graphs()
    assert engine.runner.graphs is None
    assert "CUDA graph capture failed" in caplog.text
    outs = llm.generate(prompts()[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [4, 4]
