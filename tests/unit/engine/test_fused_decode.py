"""The one-call decoder for decode-only steps (engine/models/csrc/decode_layers.cpp).

With cpu_prepack_weights on an AVX-512 CPU, a step whose every token is a decode runs all layers in
one C++ call. It must compute exactly what the layer-by-layer Python path computes (same tokens,
bitwise-equal logprobs), be used only where that holds, and reject bad arguments with a clear
error. Its agreement with HF transformers is in tests/reference/test_engine_reference.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels.cpu_build import cpu_kernels
from tests.conftest import write_tiny_model

# Slow tier (builds and runs the C++ kernels): `ops/dev.sh test --fast` leaves it out.
# Every test runs on the AVX2 and the AVX-512 kernel module (tests/conftest.py's kernel_isa).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("kernel_isa")]

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5)


def prompts(n: int = 10) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 320) for _ in range(rng.randrange(3, 50))] for _ in range(n)]


def engine_llm(path, **options) -> LLM:
    return LLM(model=str(path), dtype="float32", block_size=8, num_kv_blocks=256, max_num_batched_tokens=64,
               enable_prefix_caching=False, **options)


@pytest.fixture
def counted(decode_layers_calls):
    return decode_layers_calls


@pytest.mark.parametrize(("arch", "options"), [
    ("llama", {}),
    ("qwen2", {}),
    # int8 KV cache: new rows quantized in C++ exactly as kv_int8.quantize_rows does; head_dim 16 takes
    # the int8 kernel's generic path, head_dim 64 its AVX-512 path.
    ("llama", {"cache_bits": 8}),
    ("llama", {"cache_bits": 8, "shape": {"hidden_size": 256, "num_attention_heads": 4}}),
])
def test_decode_steps_equal_the_layer_by_layer_path_bitwise(tmp_path, arch, options, counted):
    options = dict(options)
    path = write_tiny_model(tmp_path / arch, arch, seed=3, **options.pop("shape", {}))
    llm = engine_llm(path, cpu_prepack_weights=True, **options)
    model = llm.engine.model
    assert model.fused_decoder is not None
    fused = llm.generate(prompts(), PARAMS)
    assert counted and max(counted) > 1, "no batched decode-only step went through decode_layers"
    decoder, model.fused_decoder = model.fused_decoder, None
    calls = len(counted)
    layered = llm.generate(prompts(), PARAMS)
    assert len(counted) == calls, "the layer-by-layer run must not call decode_layers"
    model.fused_decoder = decoder
    for a, b in zip(fused, layered, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs  # exact floats: the same kernels in the same order


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    assert torch.get_num_threads() == 2  # what decode_layers reads (at::get_num_threads) to split in two
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("options", [{}, {"cache_bits": 8}])
def test_steps_split_into_a_group_of_rows_per_thread_equal_the_layer_path_bitwise(tmp_path, options, counted,
                                                                                   two_threads):
    """From cpu_decode_split_rows rows a thread up, each of the threads runs its own rows through every layer;
    the tokens and logprobs are still exactly those of the layer-by-layer path."""
    path = write_tiny_model(tmp_path / "llama", "llama", seed=5)
    llm = engine_llm(path, cpu_prepack_weights=True, cpu_decode_split_rows=1, **options)
    model = llm.engine.model
    assert model.fused_decoder.split_rows == 1 and llm.engine.decode_split is None  # fixed by the config: nothing measured
    many = prompts(20)
    fused = llm.generate(many, PARAMS)
    assert counted and max(counted) >= 16, "no decode-only step of many rows went through decode_layers"
    # At these settings (2 threads, from 1 row a thread) a step of that many rows is cut into two groups.
    assert len(cpu_kernels().decode_row_groups(torch.full((max(counted),), 40), 2, 1000, 100, 1)) == 3
    decoder, model.fused_decoder = model.fused_decoder, None
    layered = llm.generate(many, PARAMS)
    model.fused_decoder = decoder
    decoder.split_rows = 1 << 30  # never split: one group, every kernel sharing its rows over the threads
    joint = llm.generate(many, PARAMS)
    for a, b, c in zip(fused, layered, joint, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.logprobs == b.logprobs == c.logprobs


def test_row_groups_cut_a_step_into_contiguous_groups_of_about_equal_work():
    def groups(lens, threads, split_rows=8):
        return cpu_kernels().decode_row_groups(lens, threads, 100, 15, split_rows)

    # A row's work: flops_per_row / 100 plus its context rows * kv_row_bytes / 15 (here 1 + lens[b]).
    assert groups(torch.full((16,), 7), 2) == [0, 8, 16]
    assert groups(torch.full((15,), 7), 2) == [0, 15]  # below 8 rows a thread: one group
    assert groups(torch.full((51,), 7), 2, 26) == [0, 51]  # below 26 rows a thread
    assert groups(torch.full((52,), 7), 2, 26) == [0, 26, 52]
    assert groups(torch.full((64,), 7), 1) == [0, 64]  # one thread: one group
    # Four long rows then sixteen empty ones: 4 x 101 + 16 x 1 = 420, so the first group ends at row 2 (202).
    assert groups(torch.tensor([100] * 4 + [0] * 16), 2) == [0, 2, 20]
    assert groups(torch.full((24,), 7), 3) == [0, 8, 16, 24]
    assert groups(torch.tensor([1000, 1]), 2, 1) == [0, 1, 2]
    assert groups(torch.tensor([5]), 2, 1) == [0, 1]
    with pytest.raises(RuntimeError, match="at least 1"):
        groups(torch.full((4,), 7), 2, 0)


def test_mixed_steps_and_batch_invariant_steps_take_the_layer_path(tiny_llama, counted):
    llm = engine_llm(tiny_llama, cpu_prepack_weights=True)
    engine = llm.engine
    for i, p in enumerate(prompts(3)):
        engine.add_request(f"r{i}", p, PARAMS)
    while engine.has_unfinished_requests():
        before = len(counted)
        engine.step()
        stats = engine.last_stats
        assert (len(counted) > before) == (stats.step_prefill_tokens == 0 and stats.step_decode_seqs > 0)
    # Deterministic requests run their linears batch-invariantly, which decode_layers does not.
    before = len(counted)
    out = llm.generate(prompts(2), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, deterministic=True))
    assert all(len(o.token_ids) == 6 for o in out)
    assert len(counted) == before


@pytest.mark.parametrize(("arch", "options"), [
    ("llama", {}),                                        # no packed copies
    ("qwen3", {"cpu_prepack_weights": True}),             # per-head q/k norms
])
def test_not_enabled_where_it_would_compute_something_else(tmp_path, arch, options, counted):
    path = write_tiny_model(tmp_path / arch, arch, seed=4)
    llm = engine_llm(path, **options)
    assert llm.engine.model.fused_decoder is None
    out = llm.generate(prompts(4), PARAMS)
    assert all(len(o.token_ids) == 12 for o in out)
    assert counted == []


def test_an_int8_cache_with_a_full_precision_window_takes_the_layer_path(tiny_llama, counted):
    # The window's recent rows are read from an fp32 ring, which decode_layers does not do.
    llm = engine_llm(tiny_llama, cpu_prepack_weights=True, cache_bits=8, kv_fp_window=4)
    assert llm.engine.model.fused_decoder is not None
    out = llm.generate(prompts(4), PARAMS)
    assert all(len(o.token_ids) == 12 for o in out)
    assert counted == []


def test_bad_arguments_get_a_clear_error(tiny_llama):
    llm = engine_llm(tiny_llama, cpu_prepack_weights=True)
    model, engine = llm.engine.model, llm.engine
    cfg = model.config
    weights = model.fused_decoder.weights
    kv = engine.kv_caches
    x = torch.randn(1, cfg.hidden_size)
    tables, lens, pos = torch.zeros(1, 4, dtype=torch.int64), torch.ones(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)

    def call(**kw):
        args = dict(x=x, weights=weights, kv=kv, scales=[], slots=torch.zeros(1, dtype=torch.int64))
        args.update(kw)
        return cpu_kernels().decode_layers(
            args["x"], args["weights"], args["kv"], args["scales"], args["slots"], tables, lens, pos, model.rope.cos, model.rope.sin,
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, model.norm.eps, 0.25,
            args.get("final_norm", torch.empty(0)), args.get("token_table", torch.empty(0)), 8)

    capacity = kv[0].shape[1] * kv[0].shape[2]
    kv[0][:, 0, 0].zero_()
    with pytest.raises(RuntimeError, match="outside the cache"):
        call(slots=torch.tensor([capacity]))
    with pytest.raises(RuntimeError, match="weights per layer"):
        call(weights=weights[:-1])
    with pytest.raises(RuntimeError, match="one slot, position"):
        call(x=torch.randn(2, cfg.hidden_size))
    table = model.embed_tokens.weight.detach()
    with pytest.raises(RuntimeError, match="token id 9999999 outside the vocabulary"):
        call(x=torch.tensor([9999999]), token_table=table)
    with pytest.raises(RuntimeError, match="x must be int64 token ids"):
        call(token_table=table)
    with pytest.raises(RuntimeError, match="token_table must be a contiguous fp32"):
        call(x=torch.tensor([3]), token_table=table.half())
    with pytest.raises(RuntimeError, match="final_norm must be empty or"):
        call(final_norm=torch.ones(cfg.hidden_size + 1))
    with pytest.raises(RuntimeError, match="KV scale tensors"):
        call(scales=[torch.zeros(1, dtype=torch.float16)])
    # fp16 scales given with fp32 caches: the caches are not int8.
    with pytest.raises(RuntimeError, match="KV cache must be a contiguous int8"):
        call(scales=[torch.zeros(c.shape[:4], dtype=torch.float16) for c in kv])
    int8 = [torch.zeros(c.shape, dtype=torch.int8) for c in kv]
    with pytest.raises(RuntimeError, match="KV scales must be contiguous fp16"):
        call(kv=int8, scales=[torch.zeros(c.shape[:4]) for c in kv])
    # A rejected call wrote nothing: the checks run before the first layer.
    assert torch.count_nonzero(kv[0][:, 0, 0]) == 0


def test_single_stream_bench_splits_each_decode_step_into_its_parts(tiny_llama):
    """bench.single_stream's clock: every decode step of a round goes through the one-call decoder and the LM
    head once, and the rest of the step is what is left of its wall time; the same tokens with the clock on."""
    from bench.single_stream import PhaseClock, one_round

    llm = engine_llm(tiny_llama, cpu_prepack_weights=True)
    prompt = prompts(1)[0]
    want = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    model = llm.engine.model
    calls = []
    layers = model.fused_decoder.run_layers
    model.fused_decoder.run_layers = lambda *a, **kw: calls.append(1) or layers(*a, **kw)
    clock = PhaseClock(model)
    r = one_round(llm, clock, prompt, 6)
    assert r["steps"] == 5 == len(calls)  # the prefill step is not a round's
    assert r["layers_ms"] > 0 and r["head_ms"] > 0 and r["rest_ms"] > 0
    assert r["layers_ms"] + r["head_ms"] + r["rest_ms"] == pytest.approx(r["step_ms"])
    again = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    assert again == want


def test_decode_split_bench_round_times_the_full_batch_steps(tiny_llama, monkeypatch):
    """bench.kernels.decode_split's round: enough tokens that every request decodes together for the asked steps after
    the chunked prefill, the tokens of each request returned in order, and a clear stop where no step ran the
    whole batch."""
    from bench.kernels import decode_split

    monkeypatch.setattr(decode_split, "PROMPT_TOKENS", 20)
    monkeypatch.setattr(decode_split, "MAX_BATCHED_TOKENS", 64)  # engine_llm's token budget
    llm = engine_llm(tiny_llama, cpu_prepack_weights=True)
    batch = [p[:20] for p in prompts(40) if len(p) >= 20][:6]
    assert len(batch) == 6
    seconds, tokens = decode_split.run_round(llm, batch, 4, "t")
    assert seconds > 0
    assert [len(t) for t in tokens] == [4 + 2] * 6  # 120 prompt tokens take two prefill steps of 64
    want = llm.generate(batch, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert tokens == [o.token_ids for o in want]
    monkeypatch.setattr(decode_split, "MAX_BATCHED_TOKENS", 10**6)  # as if prefill took one step: it takes two
    with pytest.raises(SystemExit, match="no decode step ran the whole batch"):
        decode_split.run_round(llm, batch, 1, "u")
