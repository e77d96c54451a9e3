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


@pytest.mark.parametrize("window", [0, 128])
def test_fp8_cache_on_the_reference_path_keeps_greedy_tokens_and_close_logprobs(tiny_llama, fp, window):
    """E4M3 keeps 3 mantissa bits (int8 rows keep about 7), so on this random model, whose top logits
    nearly tie, a greedy token may flip: each token must then be in full precision's top 3."""
    q = run(tiny_llama, cache_bits=8, cache_format="fp8", kv_fp_window=window)
    diff = (prompt_lp(q) - prompt_lp(fp)).abs().max()
    if window:  # every row read at full precision
        assert [a.token_ids for a in fp] == [b.token_ids for b in q]
        assert diff < 1e-4
        return
    assert 0 < diff < 0.05
    for a, b in zip(fp, q, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y), len(a.token_ids))
        assert n == len(a.token_ids) or b.token_ids[n] in [t for t, _ in a.logprobs[n][1]]


def test_cache_format_resolution_and_start_up_errors():
    from engine import EngineConfig
    from engine.attention.int8_backend import CpuPagedInt8AttentionBackend, TorchInt8AttentionBackend
    from engine.attention.kv_int8 import resolve_cache_format
    from engine.attention.selection import select_int8_backend
    from engine.errors import InvalidRequestError

    cpu = torch.device("cpu")
    assert resolve_cache_format("auto", cpu) == "int8" and resolve_cache_format("fp8", cpu) == "fp8"
    with pytest.raises(InvalidRequestError, match="cache_format"):
        EngineConfig(cache_format="fp8")  # cache_bits 16
    assert EngineConfig(cache_bits=8, cache_format="fp8").cache_format == "fp8"
    # The CPU's C++ kernels read int8 only: fp8 takes the reference.
    assert type(select_int8_backend("auto", cpu, 4, 2, 16, "fp8")) is TorchInt8AttentionBackend
    assert type(select_int8_backend("torch", cpu, 4, 2, 16, "int8")) is TorchInt8AttentionBackend
    from engine.kernels.cpu_build import kernels_available

    if kernels_available():
        assert type(select_int8_backend("auto", cpu, 4, 2, 16, "int8")) is CpuPagedInt8AttentionBackend


@pytest.mark.parametrize(("capability", "fp8_ok"), [((9, 0), True), ((8, 0), False)])
def test_auto_is_int8_on_every_gpu_and_fp8_is_refused_below_sm89(monkeypatch, capability, fp8_ok):
    from engine.attention.kv_int8 import resolve_cache_format
    from engine.errors import ModelLoadError

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    gpu = torch.device("cuda", 0)
    assert resolve_cache_format("auto", gpu) == "int8"
    if fp8_ok:
        assert resolve_cache_format("fp8", gpu) == "fp8"
    else:
        with pytest.raises(ModelLoadError, match=r"8\.9 or newer"):
            resolve_cache_format("fp8", gpu)


def test_fp8_pool_takes_half_the_bytes_of_int8_scales_aside(tiny_llama):
    from engine.kv_cache import bytes_per_block
    from engine.models.config import ModelConfig

    mc = ModelConfig.from_folder(tiny_llama)
    fp8 = bytes_per_block(mc, 16, torch.float32, 8, "fp8")
    assert fp8 == mc.num_layers * 2 * 16 * mc.num_kv_heads * mc.head_dim
    assert bytes_per_block(mc, 16, torch.float32, 8, "int8") == fp8 + mc.num_layers * 2 * 16 * mc.num_kv_heads * 2
    llm = LLM(model=str(tiny_llama), dtype="float32", cache_bits=8, cache_format="fp8", num_kv_blocks=8)
    cache = llm.engine.kv_caches[0]
    assert cache.is_fp8 and cache.scales.shape == (2, mc.num_kv_heads) and llm.engine.layout.cache_format == "fp8"
