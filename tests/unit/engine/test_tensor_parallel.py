"""Tensor parallelism on the CPU (gloo, fp32): shard plans, start-up checks, and TP=2 against TP=1."""

from __future__ import annotations

import multiprocessing
import os
import re

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.errors import InvalidRequestError, ModelLoadError
from engine.models.config import ModelConfig
from engine.parallel.sharding import ShardPlan
from engine.parallel.validation import check_devices, check_model
from tests.conftest import write_tiny_model


def _config(heads: int, kv_heads: int, vocab: int = 320, inter: int = 128) -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", hidden_size=64, num_layers=2, num_heads=heads, num_kv_heads=kv_heads,
                       head_dim=16, intermediate_size=inter, vocab_size=vocab, rms_norm_eps=1e-5, rope_theta=1e4,
                       rope_scaling=None, max_position_embeddings=512, tie_word_embeddings=False, qkv_bias=False,
                       qk_norm=False, sliding_window=None, bos_token_id=1, eos_token_ids=(2,))


def test_shard_plan_splits_heads_in_order_and_keeps_each_rank_on_its_kv_head():
    mc = _config(heads=8, kv_heads=2)
    plans = [ShardPlan.for_rank(mc, r, 4) for r in range(4)]
    assert [p.q_heads for p in plans] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # Two KV heads, four ranks: each KV head is replicated on two ranks, the ones whose query heads use it
    # (query head h reads KV head h // 4).
    assert [p.kv_heads for p in plans] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert all(p.q_heads[0] // 4 == p.kv_heads[0] and (p.q_heads[1] - 1) // 4 == p.kv_heads[0] for p in plans)
    assert [p.intermediate for p in plans] == [(0, 32), (32, 64), (64, 96), (96, 128)]
    local = plans[1].local_config(mc)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (2, 1, 32, 80)


def test_shard_plan_pads_a_vocabulary_the_ranks_do_not_divide():
    plans = [ShardPlan.for_rank(_config(4, 2, vocab=321), r, 2) for r in range(2)]
    assert [p.vocab for p in plans] == [(0, 161), (161, 322)]  # the last row of rank 1 is padding
    assert all(p.local_vocab == 161 and p.vocab_size == 321 for p in plans)


@pytest.mark.parametrize(("mc", "n", "message"), [
    (_config(heads=9, kv_heads=3), 2, "does not divide the model's 9 attention heads; use a size that does (1, 3, 9)"),
    (_config(heads=12, kv_heads=4), 3, "and the model's 4 KV heads: one must divide the other"),
    (_config(heads=4, kv_heads=2, inter=130), 4, "does not divide the MLP width 130"),
])
def test_start_up_rejects_a_size_that_does_not_split_the_model(mc, n, message):
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        check_model(mc, n)


def test_start_up_refuses_load_time_quantization_and_int4_groups_split_across_ranks():
    with pytest.raises(ModelLoadError, match="quantize it once with `infinilm quantize`"):
        check_model(_config(heads=4, kv_heads=2), 2, weight_bits=8)
    import dataclasses

    qconfig = {"bits": 4, "modules": {"layers.0.mlp.down_proj": {"bits": 4, "group_size": 64}}}
    quantized = dataclasses.replace(_config(heads=4, kv_heads=2, inter=128), quantization=qconfig)
    check_model(quantized, 2)  # 64 inputs a rank: one whole group
    with pytest.raises(ModelLoadError, match="not whole int4 groups of 64"):
        check_model(quantized, 4)
    with pytest.raises(ModelLoadError, match="holds 4-bit weights but weight_bits is 8"):
        check_model(quantized, 2, weight_bits=8)


def test_start_up_accepts_kv_heads_that_divide_or_are_divisible_by_the_size():
    check_model(_config(heads=8, kv_heads=2), 4)
    check_model(_config(heads=8, kv_heads=8), 4)
    check_model(_config(heads=8, kv_heads=1), 8)


def test_start_up_rejects_more_ranks_than_visible_cuda_devices():
    n = torch.cuda.device_count() + 1
    with pytest.raises(ModelLoadError, match=f"needs {n} visible CUDA devices, found {n - 1}"):
        check_devices(torch.device("cuda"), n)
    check_devices(torch.device("cpu"), 8)  # the CPU runs any number of gloo ranks


@pytest.mark.parametrize(("options", "message"), [
    (dict(async_scheduling=True), "runs steps synchronously"),
    (dict(embedding_offload=True), "embedding_offload does not combine"),
    (dict(device="cuda:1"), "places rank r on cuda:r"),
])
def test_settings_that_do_not_combine_with_tensor_parallelism_are_refused(options, message):
    with pytest.raises(InvalidRequestError, match=message):
        EngineConfig(tensor_parallel_size=2, **options)
    EngineConfig(tensor_parallel_size=1, **options)  # each is fine on one process


def test_smollm2_with_two_ranks_fails_at_start_up_before_spawning_any():
    with pytest.raises(ModelLoadError, match="does not divide the model's 9 attention heads"):
        LLM(model="smollm2", dtype="float32", device="cpu", tensor_parallel_size=2, num_kv_blocks=16)
    assert not multiprocessing.active_children()


def test_a_vision_language_model_with_two_ranks_fails_at_start_up(tmp_path):
    from tests.vision_models import write_tiny_llava

    path = write_tiny_llava(tmp_path / "llava", seed=1)
    with pytest.raises(ModelLoadError, match="vision-language models do not run with tensor_parallel_size 2"):
        LLM(model=str(path), dtype="float32", device="cpu", tensor_parallel_size=2, num_kv_blocks=16)
    assert not multiprocessing.active_children()


# ---- TP=2 against TP=1, end to end through the offline API ----
VARIANTS = {
    # GQA (4 query heads on 2 KV heads, one per rank), untied head, a vocabulary the ranks do not divide.
    "llama-gqa-padded-vocab": ("llama", dict(vocab_size=321), {}),
    # qkv bias, tied embeddings, one KV head replicated on both ranks.
    "qwen2-tied-replicated-kv": ("qwen2", dict(num_key_value_heads=1, tie=True), {}),
    # Per-head q/k RMSNorm (replicated: it acts within a head).
    "qwen3-qk-norm": ("qwen3", {}, {}),
    # The int8 KV cache: each rank quantizes its own heads' rows.
    "llama-int8-kv": ("llama", {}, dict(cache_bits=8)),
    # The fp8 KV cache: each rank calibrates its own heads' scales, in one forward pass with the others.
    "llama-fp8-kv": ("llama", {}, dict(cache_bits=8, cache_format="fp8")),
}


QUANTIZED = {
    # int8 codes with per-row scales: o and down keep every scale, their codes are cut by column.
    "int8-untied": ("llama", dict(), 8),
    # int4 in groups of 32 inputs (each rank's o and down inputs are whole groups), a tied quantized table.
    "int4-tied": ("qwen2", dict(tie=True), 4),
}


@pytest.fixture(scope="module", params=[*VARIANTS, *QUANTIZED])
def variant(request, tmp_path_factory):
    if request.param in VARIANTS:
        arch, shape, options = VARIANTS[request.param]
        return write_tiny_model(tmp_path_factory.mktemp(request.param), arch, seed=3, **shape), options, "Linear"
    from engine.quant.checkpoint import save_quantized
    from engine.quant.convert import QuantSpec
    from engine.quant.loading import quantize_pretrained

    arch, shape, bits = QUANTIZED[request.param]
    source = write_tiny_model(tmp_path_factory.mktemp(request.param), arch, seed=3, **shape)
    state, qconfig = quantize_pretrained(source, ModelConfig.from_folder(source), QuantSpec(bits, 32, False), None)
    return save_quantized(source, tmp_path_factory.mktemp(f"{request.param}-quantized"), state, qconfig,
                          overwrite=True), {}, f"Int{bits}Linear"


def _run(path, tp: int, options: dict):
    """Two rounds of a mixed batch: the second reuses the first's prefixes. Long prompts are prefilled in
    chunks (a 24-token budget) and the pool (10 blocks of 8 rows) is too small for all at once: preemption."""
    shared = list(range(40, 72))  # 4 full blocks every prompt starts with
    prompts = [[*shared, 5, 6, 7], shared + list(range(100, 130)), [9, 10, 11], "hello, tensor parallel world"]
    params = SamplingParams(max_tokens=14, temperature=0.0, logprobs=3)
    with LLM(model=str(path), dtype="float32", device="cpu", tensor_parallel_size=tp, num_kv_blocks=10,
             block_size=8, max_num_batched_tokens=24, max_num_seqs=4, enable_prefix_caching=True,
             **options) as llm:
        assert len(multiprocessing.active_children()) == tp - 1
        outs = llm.generate(prompts, params) + llm.generate(prompts[:2], params)
        engine = llm.engine
        down = type(engine.model.layers[0].mlp.down_proj).__name__
        return outs, engine.scheduler.num_preemptions, engine.block_manager.prefix_hits, down


@pytest.mark.slow
def test_two_ranks_give_the_greedy_tokens_and_logprobs_of_one(variant):
    path, options, linear = variant
    one, preempted_1, hits_1, down_1 = _run(path, 1, options)
    two, preempted_2, hits_2, down_2 = _run(path, 2, options)
    assert down_1 == down_2 == linear  # quantized checkpoints run their quantized modules on every rank
    # The run exercises what it claims to: preemption, chunked prefill and prefix-cache hits.
    assert preempted_1 > 0 and preempted_2 > 0
    assert hits_1 > 0 and hits_2 > 0
    for a, b in zip(one, two, strict=True):
        assert a.error is None and b.error is None
        assert a.token_ids == b.token_ids
        assert len(a.token_ids) == 14 or a.finish_reason == "stop"
        for (lp_a, top_a), (lp_b, top_b) in zip(a.logprobs, b.logprobs, strict=True):
            assert lp_b == pytest.approx(lp_a, abs=2e-4)
            assert [t for t, _ in top_a] == [t for t, _ in top_b]
    assert not multiprocessing.active_children()  # close() stopped rank 1


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tp-tiny"), "llama", seed=4)


def test_speculative_drafts_verify_on_two_ranks_as_on_one(tiny_path):
    # A prompt that repeats itself, so prompt-lookup drafts are proposed (and some accepted).
    prompt = [7, 8, 9, 10, 11, 12] * 6
    params = SamplingParams(max_tokens=24, temperature=0.0, speculative=True)  # drafts take no logprobs
    runs = []
    for tp in (1, 2):
        with LLM(model=str(tiny_path), dtype="float32", device="cpu", tensor_parallel_size=tp, num_kv_blocks=32,
                 speculative_method="prompt_lookup", num_speculative_tokens=3, prompt_lookup_min=1) as llm:
            (out,) = llm.generate([prompt], params)
            runs.append((out, llm.engine.scheduler.num_draft_tokens))
    (one, drafted_1), (two, drafted_2) = runs
    assert drafted_1 > 0 and drafted_2 > 0
    assert one.token_ids == two.token_ids and len(one.token_ids) == 24


def test_a_deterministic_request_gives_the_same_bits_alone_and_in_a_batch_on_two_ranks(tiny_path):
    # Every rank must run the batch-invariant kernels for such a step, not only rank 0.
    prompt = list(range(20, 60))
    det = SamplingParams(max_tokens=10, temperature=0.0, logprobs=1, deterministic=True)
    others = [list(range(100 + 7 * i, 130 + 7 * i)) for i in range(5)]
    with LLM(model=str(tiny_path), dtype="float32", device="cpu", tensor_parallel_size=2, num_kv_blocks=64,
             enable_prefix_caching=False) as llm:
        (alone,) = llm.generate([prompt], det)
        batched = llm.generate([*others, prompt], [SamplingParams(max_tokens=10)] * 5 + [det])[-1]
    assert alone.token_ids == batched.token_ids
    assert [lp for lp, _ in alone.logprobs] == [lp for lp, _ in batched.logprobs]  # bitwise


def test_rank_0_runs_on_its_share_of_the_cores_and_the_process_gets_its_thread_count_back(tiny_path):
    share = max(1, (os.cpu_count() or 1) // 2)
    before = torch.get_num_threads()
    torch.set_num_threads(share + 1)  # a count the group's share differs from
    try:
        with LLM(model=str(tiny_path), dtype="float32", device="cpu", tensor_parallel_size=2, num_kv_blocks=16) as llm:
            llm.generate([list(range(20, 30))], SamplingParams(max_tokens=2))
            during = torch.get_num_threads()
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert during == share
    # A later engine in this process quantizes and runs on the count it had: the clip and scale searches'
    # choices move with the summation order of another count (an fp8 perplexity 0.35% apart).
    assert after == share + 1
