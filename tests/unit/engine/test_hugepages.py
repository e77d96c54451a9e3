"""engine/hugepages.py: tensors carved from one region of transparent huge pages, and the engine's use of it
(the KV cache and the weights a decode step streams), which must not change a single output."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams, hugepages
from engine.models import linear as linear_module
from engine.models.linear import Linear, is_panel_packed

# Slow tier (loads SmolLM2): `ops/dev.sh test --fast` leaves it out.
pytestmark = pytest.mark.slow

needs_thp = pytest.mark.skipif(not hugepages.available(), reason="this host gives no transparent huge pages")


@pytest.fixture(params=["panel-kernel", "onednn-packing"])
def packing(request, monkeypatch):
    """Both ways `prepack` packs an fp32 weight: panels for the panel kernel (AVX2 and AVX-512 hosts), or oneDNN's
    opaque blocked layout (where the kernels cannot be built, emulated here by hiding the panel kernel)."""
    if request.param == "onednn-packing":
        monkeypatch.setattr(linear_module, "_panel_kernel", lambda: False)
    elif not linear_module._panel_kernel():
        pytest.skip("this host has no AVX2: no panel kernel")
    return request.param


def carved(t: torch.Tensor) -> bool:
    """A view into a larger region (an arena), not a tensor of its own."""
    return t.untyped_storage().nbytes() > t.numel() * t.element_size()


def streamed_weight(qkv: Linear) -> torch.Tensor | None:
    """What a decode step streams for `qkv` that huge pages can hold: its panel-packed copy, else its plain
    weight; None for a oneDNN-packed copy, an opaque tensor that has no storage to move."""
    if qkv.packed is None:
        return qkv.weight
    if is_panel_packed(qkv.packed):
        return qkv.packed
    assert qkv.packed.layout == torch._mkldnn
    return None


def huge_kib(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds t's first byte (/proc/self/smaps)."""
    addr, inside, kib = t.data_ptr(), False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("AnonHugePages:"):
            kib = int(line.split()[1])
    return kib


@needs_thp
def test_an_arena_carves_aligned_zeroed_disjoint_tensors_and_refuses_more_than_it_holds():
    specs = [((3, 5), torch.float32), ((7,), torch.int8), ((2, 1000), torch.float16)]
    arena = hugepages.HugePageArena(hugepages.arena_bytes(specs))
    assert arena.capacity % hugepages.HUGE_PAGE == 0
    out = [arena.take(shape, dtype) for shape, dtype in specs]
    for t, (shape, dtype) in zip(out, specs, strict=True):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % 4096 == 0 and not t.any()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in out)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # no overlap
    out[0].fill_(1.0)
    assert not out[1].any() and not out[2].any()
    with pytest.raises(ValueError, match="no room"):
        arena.take((hugepages.HUGE_PAGE,), torch.float32)


@needs_thp
def test_zeros_are_zero_and_live_in_huge_pages():
    a, b = hugepages.zeros([((1 << 20,), torch.float32), ((2, 1 << 19), torch.float32)])  # 4 + 4 MiB
    assert a.shape == (1 << 20,) and b.shape == (2, 1 << 19)
    assert not a.any() and not b.any()
    assert huge_kib(a) >= 2048


@needs_thp
def test_a_fault_budget_faults_the_region_in_and_gives_the_rest_4k_pages_once_spent():
    # A budget no fault can meet: the first huge page is faulted in, then the rest stops asking for huge pages.
    spent = hugepages.HugePageArena(8 * hugepages.HUGE_PAGE, fault_budget_s=0.0)
    assert spent.huge_bytes == hugepages.HUGE_PAGE
    t = spent.take((8 * hugepages.HUGE_PAGE,), torch.uint8)
    assert not t.any()
    t.fill_(1)  # every page touched: the ones past the budget came as 4 KiB pages
    assert huge_kib(t) <= 2048
    # A budget that holds: every page faulted in with huge pages asked for (the host may still give fewer).
    roomy = hugepages.HugePageArena(8 * hugepages.HUGE_PAGE, fault_budget_s=60.0)
    assert roomy.huge_bytes == roomy.capacity
    u = roomy.take((8 * hugepages.HUGE_PAGE,), torch.uint8)
    assert not u.any()
    assert huge_kib(u) >= 2048


def test_huge_pages_must_be_true_false_or_auto():
    from engine.config import EngineConfig
    from engine.errors import InvalidRequestError

    assert EngineConfig(model="m").huge_pages == "auto"
    with pytest.raises(InvalidRequestError, match="huge_pages must be true, false or 'auto'"):
        EngineConfig(model="m", huge_pages="yes")


def test_without_huge_pages_callers_keep_torch_allocations(monkeypatch):
    monkeypatch.setattr(hugepages, "available", lambda: False)
    assert hugepages.arena_for([((4,), torch.float32)]) is None
    (z,) = hugepages.zeros([((4, 2), torch.float16)])
    assert z.dtype == torch.float16 and z.shape == (4, 2) and not z.any()


@needs_thp
@pytest.mark.parametrize("options", [dict(cpu_prepack_weights=True, cpu_compact_weights=False),
                                     dict(cpu_prepack_weights=False), dict(cache_bits=8)],
                         ids=["fp32-packed", "plain-weights", "int8-kv"])
def test_the_engine_gives_the_same_tokens_with_its_kv_and_decode_weights_in_huge_pages(options, packing):
    kw = dict(model="smollm2", dtype="float32", kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False,
              **options)
    prompts = ["The GNU General Public License is", "Once upon a time", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = LLM(huge_pages=False, **kw)
    huge = LLM(huge_pages=True, **kw)
    assert [o.token_ids for o in huge.generate(prompts, params)] == [o.token_ids for o in plain.generate(prompts, params)]
    def kv(llm):
        cache = llm.engine.kv_caches[0]
        return cache.values if options.get("cache_bits") == 8 else cache

    assert carved(kv(huge)) and huge_kib(kv(huge)) > 0
    assert not carved(kv(plain))  # huge_pages false keeps torch's own allocation
    assert not carved(plain.engine.model.layers[0].self_attn.qkv_proj.weight)
    # The weights a decode step streams moved too: each linear's panel-packed copy, else its plain weight.
    qkv = huge.engine.model.layers[0].self_attn.qkv_proj
    assert type(qkv) is Linear
    streamed = streamed_weight(qkv)
    if options.get("cpu_prepack_weights") and packing == "onednn-packing":
        assert streamed is None  # oneDNN owns its packed copy: it stays where oneDNN put it
        assert not carved(qkv.weight)
    else:
        assert carved(streamed) and huge_kib(streamed) > 0
    if huge.engine.model.fused_decoder is not None:  # the one-call decoder reads the moved copies
        assert any(w.data_ptr() == qkv.packed.data_ptr() for w in huge.engine.model.fused_decoder.weights)


@needs_thp
def test_by_default_only_the_decode_streamed_weights_move_to_huge_pages(packing):
    """huge_pages "auto", the default: the weights a decode step streams move (within a time budget), the KV
    cache keeps torch's own allocation, and the tokens are those of an engine without huge pages. Plain fp32
    weights, so that both packings leave a weight that huge pages can hold."""
    kw = dict(model="smollm2", dtype="float32", kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False,
              cpu_prepack_weights=packing == "panel-kernel", cpu_compact_weights=False)
    auto, plain = LLM(**kw), LLM(huge_pages=False, **kw)
    assert auto.engine.config.huge_pages == "auto"
    streamed = streamed_weight(auto.engine.model.layers[0].self_attn.qkv_proj)
    assert carved(streamed) and huge_kib(streamed) > 0
    kv = auto.engine.kv_caches[0]
    assert not carved(kv)
    prompts = ["The GNU General Public License is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in auto.generate(prompts, params)] == [o.token_ids for o in plain.generate(prompts, params)]
