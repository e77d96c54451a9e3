"""The Triton kernels over the 8-bit KV caches (engine/attention/triton_kvq.py) against the torch reference
(engine/attention/int8_backend.py), both cache formats, with and without the full-precision window and
under every mask policy; the fused RoPE + quantized K/V write, with and without the key rotation; the
engine on the Triton path.

Without a GPU they run in Triton's interpreter (fp8 codes included: the interpreter converts E4M3 in
software); with one, compiled, and the last test captures real CUDA graphs over an 8-bit cache.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

# Before triton is imported: without a GPU, run the kernels in triton's interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import LLM, SamplingParams
from engine.attention.int8_backend import TorchInt8AttentionBackend
from engine.attention.kv_int8 import Int8KVCache, KVWindowSlots, quantize_fp8, quantize_rows, write_int8
from engine.attention.metadata import AttentionMetadata, MaskSpec, PrefillSpan
from engine.attention.triton_kvq import paged_decode_quant
from engine.attention.triton_kvq_backend import TritonQuantAttentionBackend

pytestmark = pytest.mark.slow

H, KVH, D, BS, NB = 4, 2, 16, 16, 12
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FORMATS = ("int8", "fp8")


@pytest.fixture(autouse=True)
def _on_device():
    with DEVICE:
        yield


def skip_without_fp8(fmt: str) -> None:
    if fmt == "fp8" and DEVICE.type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 KV needs compute capability 8.9+")


def new_cache(fmt: str, window: int) -> Int8KVCache:
    skip_without_fp8(fmt)
    cache = Int8KVCache.allocate(NB, BS, KVH, D, window, 4, torch.float32, DEVICE, fmt)
    if fmt == "fp8":
        cache.scales.copy_(torch.tensor([[0.5, 2.0], [0.25, 1.5]]))  # per (K|V, head): not all 1.0
    return cache


def clone(cache: Int8KVCache) -> Int8KVCache:
    return Int8KVCache(cache.values.clone(), cache.scales.clone(),
                       cache.window.clone() if cache.window is not None else None)


class Seq:
    """A running sequence as KVWindowSlots.metadata sees it, with its blocks."""

    def __init__(self, rid: str, blocks: list[int]) -> None:
        self.request_id, self.blocks, self.start, self.token_ids = rid, blocks, 0, []

    def schedule(self, start: int, n: int) -> Seq:
        """This sequence as one step schedules it (a copy: the steps are built before they run)."""
        s = Seq(self.request_id, self.blocks)
        s.start, s.token_ids = start, [0] * n
        return s

    def slots(self) -> list[int]:
        return [self.blocks[r // BS] * BS + r % BS for r in range(self.start, self.start + len(self.token_ids))]


def step_meta(decodes: list[Seq], prefills: list[tuple[Seq, MaskSpec]], win: KVWindowSlots | None):
    slots = [s for d in decodes for s in d.slots()] + [s for p, _ in prefills for s in p.slots()]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), num_decodes=len(decodes))
    if decodes:
        width = max(len(d.blocks) for d in decodes)
        meta.decode_block_tables = torch.tensor([d.blocks + [0] * (width - len(d.blocks)) for d in decodes])
        meta.decode_seq_lens = torch.tensor([d.start + 1 for d in decodes])
        meta.decode_max_len = int(meta.decode_seq_lens.max())
    offset = len(decodes)
    for p, mask in prefills:
        n = len(p.token_ids)
        meta.prefills.append(PrefillSpan(offset, n, p.start, torch.tensor(p.blocks), mask, block_ids=p.blocks))
        offset += n
    if win is not None:
        meta.kv_window = win.metadata(decodes, [p for p, _ in prefills], DEVICE)
    return meta


def run_both(fmt: str, window: int, steps, seed: int = 0):
    """Run the same steps through both backends on copies of one cache; yield each step's two outputs."""
    torch.manual_seed(seed)
    ref_cache = new_cache(fmt, window)
    tri_cache = clone(ref_cache)
    ref, tri = TorchInt8AttentionBackend(H, KVH, D), TritonQuantAttentionBackend(H, KVH, D)
    wins = [KVWindowSlots(window, 4) if window else None for _ in range(2)]
    for decodes, prefills in steps:
        n = len(decodes) + sum(len(p.token_ids) for p, _ in prefills)
        q, k, v = torch.randn(n, H, D), torch.randn(n, KVH, D), torch.randn(n, KVH, D)
        outs = []
        for backend, cache, win in ((ref, ref_cache, wins[0]), (tri, tri_cache, wins[1])):
            meta = step_meta(decodes, prefills, win)
            outs.append(backend.forward(q, k, v, cache, meta))
        yield outs


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("spec", [
    MaskSpec(),
    MaskSpec("chunk_bidirectional", start=24, end=31),
    MaskSpec("prefix_bidirectional", end=7),
    MaskSpec("packed_segments", start=25, segment_starts=(25, 29)),
], ids=lambda s: s.policy)
def test_quant_backend_matches_the_torch_reference(spec, fmt, window):
    """Two steps: prompts prefilled from nothing; then a later chunk under the mask policy (its band reads
    the ring for older rows and the step's K/V for its own) beside a decode reading its ring."""
    a, b = Seq("a", [8, 3, 5]), Seq("b", [1, 9, 2])
    steps = [
        ([], [(a.schedule(0, 20), MaskSpec()), (b.schedule(0, 39), MaskSpec())]),
        ([b.schedule(39, 1)], [(a.schedule(20, 14), spec)]),
    ]
    for ref, got in run_both(fmt, window, steps):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("splits", "window"), [(1, 0), (3, 0), (3, 6)])
def test_quant_decode_splits_match_one_program(fmt, splits, window):
    torch.manual_seed(4)
    cache = new_cache(fmt, window)
    lens = torch.tensor([103, 9, 40])
    tables = torch.tensor([[3, 7, 1, 4, 10, 6, 8], [5, 0, 0, 0, 0, 0, 0], [9, 2, 11, 0, 0, 0, 0]])
    slots = torch.cat([tables[i, r // BS] * BS + r % BS for i in range(3) for r in [torch.arange(int(lens[i]))]])
    rows = int(lens.sum())
    write_int8(cache, torch.randn(rows, KVH, D) * 3, torch.randn(rows, KVH, D), slots)
    win = None
    if window:
        cache.window.normal_()
        win = SimpleNamespace(size=window, decode_slots=torch.tensor([2, 0, 1]), decode_lo=lens - window)
    q = torch.randn(3, H, D)
    meta = AttentionMetadata(slot_mapping=slots, num_decodes=3, decode_block_tables=tables, decode_seq_lens=lens,
                             kv_window=win)
    ref = TorchInt8AttentionBackend(H, KVH, D)._decode(q, cache, meta)
    got = paged_decode_quant(q, cache, tables, lens, D**-0.5, win, splits=splits, pages=2)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    if splits == 3:  # into a given output: a strided view is written in place, a transposed one refused
        out = torch.full((3, H + 1, D), float("nan"))[:, 1:]
        assert paged_decode_quant(q, cache, tables, lens, D**-0.5, win, splits=splits, pages=2, out=out) is out
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match="unit stride in D"):
            paged_decode_quant(q, cache, tables, lens, D**-0.5, win, out=torch.empty(3, D, H).transpose(1, 2))


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_rope_write_quantizes_as_the_torch_write_does(fmt):
    from engine.models.fused_ops import rope_write_kv
    from engine.models.rope import RotaryEmbedding

    skip_without_fp8(fmt)
    torch.manual_seed(5)
    nq, nkv, d, t = 4, 2, 16, 7
    rope = RotaryEmbedding(d, 64, 10000.0, None, torch.float32, DEVICE)
    qkv = torch.randn(t, (nq + 2 * nkv) * d) * 4
    positions = torch.tensor([0, 3, 9, 10, 11, 30, 63])
    slots = torch.tensor([17, 2, 40, 41, 42, 100, 5])
    cache = Int8KVCache.allocate(8, 16, nkv, d, 0, 1, torch.float32, DEVICE, fmt)
    if fmt == "fp8":
        cache.scales.copy_(torch.tensor([[0.5, 2.0], [0.25, 1.5]]))
    want = clone(cache)
    rope_write_kv(qkv, positions, rope.cos, rope.sin, nq, nkv, d, cache, slots)
    k = qkv[:, nq * d:(nq + nkv) * d].reshape(t, nkv, d)  # rotated in place by the kernel
    v = qkv[:, (nq + nkv) * d:].reshape(t, nkv, d)
    write_int8(want, k, v, slots)
    assert torch.equal(cache.values.float(), want.values.float())  # fp8: +0 and -0 alike (see below)
    assert torch.equal(cache.scales, want.scales)
    codes = cache.values[0].view(-1, nkv, d)[slots].float()  # the rows are really there
    expected = quantize_rows(k)[0] if fmt == "int8" else quantize_fp8(k, cache.scales[0])
    assert torch.equal(codes, expected.float()) and codes.abs().sum() > 0


ROTATED_SHAPES = {"smollm2": (9, 3, 64), "8b": (32, 8, 128), "tiny": (4, 2, 16)}  # q heads, kv heads, head_dim


def rope_kv_case(fmt: str, nq: int, nkv: int, d: int, dtype: torch.dtype = torch.float32):
    """A fused qkv output of 7 tokens (positions, slots) and a cache of `fmt` (QUANT 0, 1, 2) to write into."""
    from engine.models.rope import RotaryEmbedding

    skip_without_fp8(fmt)
    torch.manual_seed(nq * d)
    rope = RotaryEmbedding(d, 64, 10000.0, None, torch.float32, DEVICE)
    qkv = (torch.randn(7, (nq + 2 * nkv) * d) * 4).to(dtype)
    positions = torch.tensor([0, 3, 9, 10, 11, 30, 63])
    slots = torch.tensor([17, 2, 40, 41, 42, 100, 5])
    if fmt == "plain":
        cache = torch.randn(2, 8, 16, nkv, d, dtype=dtype)
    else:
        cache = Int8KVCache.allocate(8, 16, nkv, d, 0, 1, dtype, DEVICE, fmt)
        if fmt == "fp8":
            cache.scales.uniform_(0.25, 2.0)  # per (K|V, head)
    return rope, qkv, positions, slots, cache


def write_cache(cache, k, v, slots) -> None:
    """The backend's torch write of k and v at their slots."""
    from engine.attention.torch_backend import write_kv

    if isinstance(cache, torch.Tensor):
        write_kv(cache, k, v, slots)
    else:
        write_int8(cache, k, v, slots)


def copy_cache(cache):
    return cache.clone() if isinstance(cache, torch.Tensor) else clone(cache)


def split_qkv(qkv: torch.Tensor, nq: int, nkv: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(t.view(qkv.shape[0], -1, d) for t in qkv.split([nq * d, nkv * d, nkv * d], dim=-1))


@pytest.mark.parametrize("shape", ["smollm2", "8b", "tiny"])
@pytest.mark.parametrize("fmt", ["plain", *FORMATS])
def test_fused_rope_write_with_a_key_rotation_matches_rope_then_rotate_then_the_write(fmt, shape):
    """The kernel's rotated q and k (in place) are RoPE then rotate(), and the cache holds what the backend's
    write stores for that k: the same codes and scales exactly, and, from the torch path's own rotated k,
    the same rows within one rounding step (the two round fp32 sums of different order)."""
    from engine.attention.key_rotation import hadamard, rotate
    from engine.models.fused_ops import rope_write_kv

    nq, nkv, d = ROTATED_SHAPES[shape]
    rope, qkv, positions, slots, cache = rope_kv_case(fmt, nq, nkv, d)
    rotation = hadamard(d).to(DEVICE)
    want_qkv, want_cache, own_cache = qkv.clone(), copy_cache(cache), copy_cache(cache)
    q, k, v = split_qkv(want_qkv, nq, nkv, d)
    rope.apply_torch_(positions, q, k)
    q, k = rotate(q, rotation), rotate(k, rotation)
    write_cache(want_cache, k, v, slots)
    rope_write_kv(qkv, positions, rope.cos, rope.sin, nq, nkv, d, cache, slots, rotation)
    got_q, got_k, got_v = split_qkv(qkv, nq, nkv, d)
    torch.testing.assert_close(got_q, q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, k, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_v, v)  # V is not rotated
    write_cache(own_cache, got_k, got_v, slots)  # the backend's write of the kernel's rotated k
    if fmt == "plain":
        torch.testing.assert_close(cache, want_cache, atol=1e-5, rtol=1e-5)
        assert torch.equal(cache, own_cache)
        return
    assert torch.equal(cache.values.float(), own_cache.values.float()) and torch.equal(cache.scales, own_cache.scales)
    codes, want = (c.values[0].view(-1, nkv, d)[slots].float() for c in (cache, want_cache))
    if fmt == "int8":
        torch.testing.assert_close(cache.scales, want_cache.scales, atol=0, rtol=1e-3)
        assert (codes - want).abs().max() <= 1
    else:  # one E4M3 step: 2**-3 of the value, 2**-9 among the subnormals
        torch.testing.assert_close(codes, want, atol=2.0**-9, rtol=2.0**-3)
    assert (codes != 0).float().mean() > 0.5  # the rows are really there


@pytest.mark.parametrize("fmt", ["plain", "fp8"])
def test_fused_rotation_in_bf16_rounds_once_from_the_rows_rope_rounded(fmt):
    """In bf16 the rotated rows are rotate() of the kernel's own RoPE output (what the torch path rotates once
    RoPE has rounded), within one bf16 rounding, and the cache holds the backend's write of them."""
    from engine.attention.key_rotation import hadamard, rotate
    from engine.models.fused_ops import rope_write_kv

    nq, nkv, d = ROTATED_SHAPES["8b"]
    rope, qkv, positions, slots, cache = rope_kv_case(fmt, nq, nkv, d, torch.bfloat16)
    rotation = hadamard(d).to(DEVICE)
    roped, own_cache = qkv.clone(), copy_cache(cache)
    rope_write_kv(roped, positions, rope.cos, rope.sin, nq, nkv, d)
    rope_write_kv(qkv, positions, rope.cos, rope.sin, nq, nkv, d, cache, slots, rotation)
    q, k, v = split_qkv(roped, nq, nkv, d)
    got_q, got_k, got_v = split_qkv(qkv, nq, nkv, d)
    torch.testing.assert_close(got_q, rotate(q, rotation), atol=2.0**-7, rtol=2.0**-7)
    torch.testing.assert_close(got_k, rotate(k, rotation), atol=2.0**-7, rtol=2.0**-7)
    assert torch.equal(got_v, v)
    write_cache(own_cache, got_k, got_v, slots)
    if fmt == "plain":
        assert torch.equal(cache, own_cache)
    else:
        assert torch.equal(cache.values.float(), own_cache.values.float())


def test_fused_rope_refuses_a_rotation_it_cannot_apply():
    from engine.models.fused_ops import rope_write_kv

    rope, qkv, positions, _, _ = rope_kv_case("plain", 4, 2, 16)
    for bad in (torch.eye(8), torch.eye(16, dtype=torch.float64), torch.eye(32)[::2, ::2]):
        with pytest.raises(ValueError, match="rotation"):
            rope_write_kv(qkv, positions, rope.cos, rope.sin, 4, 2, 16, rotation=bad)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_triton_8bit_path_generates_what_the_torch_reference_does(tiny_llama, fmt):
    skip_without_fp8(fmt)
    prompts = [[5, 6, 7, 8, 9] * 5, list(range(3, 60))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=str(tiny_llama), dtype="float32", attention_backend=backend, max_num_batched_tokens=32,
                  num_kv_blocks=32, device=str(DEVICE), cuda_graphs=False, gpu_fused_kernels=False, cache_bits=8,
                  cache_format=fmt, kv_fp_window=4)
        assert type(llm.engine.model.layers[0].self_attn.backend).__name__ == (
            "TritonQuantAttentionBackend" if backend == "triton" else "TorchInt8AttentionBackend")
        outs[backend] = llm.generate(prompts, params)
    for a, b in zip(outs["torch"], outs["triton"], strict=True):
        assert a.token_ids == b.token_ids
        for (lp_a, _), (lp_b, _) in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(lp_a - lp_b) < 1e-4


def test_the_fused_rotation_generates_what_rope_then_rotate_does_over_an_fp8_cache(tiny_llama):
    """With an fp8 cache's default key rotation, enable_triton_fusions keeps RoPE, the rotation and the K/V
    write in one launch; the tokens and logprobs are those of the unfused path (RoPE, rotate(), the write).
    The kernel-level tests above cover SmolLM2's and the 8B model's head shapes."""
    skip_without_fp8("fp8")
    path = tiny_llama
    prompts = [[5, 6, 7, 8, 9] * 5, list(range(3, 60))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    outs, keys = {}, {}
    for fused in (False, True):
        llm = LLM(model=str(path), dtype="float32", attention_backend="triton", max_num_batched_tokens=32,
                  num_kv_blocks=32, device=str(DEVICE), cuda_graphs=False, gpu_fused_kernels=fused, cache_bits=8,
                  cache_format="fp8", kv_fp_window=4)
        model_ = llm.engine.model
        if fused and DEVICE.type == "cpu":  # the engine enables them on CUDA only
            model_.enable_triton_fusions()
        attn = model_.layers[0].self_attn
        assert attn.backend.key_rotation is not None and attn.fused_rope_kv == fused == attn.backend.kv_prewritten
        outs[fused] = llm.generate(prompts, params)
        keys[fused] = torch.stack([c.values[0].float() for c in llm.engine.kv_caches])
    for a, b in zip(outs[False], outs[True], strict=True):
        assert a.token_ids == b.token_ids
        for (lp_a, _), (lp_b, _) in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(lp_a - lp_b) < 1e-4
    # The same rotated keys in the same slots: codes differ only where the two sums round apart.
    stored = (keys[False] != 0).sum()
    assert stored > 0 and (keys[True] != keys[False]).sum() <= 0.01 * stored


def test_calibration_with_the_fused_rotation_on_records_the_rotated_keys(tiny_llama):
    """collect_kv runs the unfused path (RoPE, rotate()) for the duration and puts the fused write back: with
    fusions on it records what it does with them off, keys rotated (K R for the unrotated K)."""
    from engine.attention.key_rotation import rotate
    from engine.quant.kv_scales import collect_kv

    skip_without_fp8("fp8")
    llm = LLM(model=str(tiny_llama), dtype="float32", attention_backend="triton", num_kv_blocks=32,
              device=str(DEVICE), cuda_graphs=False, gpu_fused_kernels=False, cache_bits=8, cache_format="fp8")
    model = llm.engine.model
    backend = model.layers[0].self_attn.backend
    rotation = backend.key_rotation
    seqs = [list(range(3, 40)), [5, 6, 7, 8, 9] * 4]
    unfused = collect_kv(model, seqs, 16)
    model.enable_triton_fusions()
    fused = collect_kv(model, seqs, 16)
    assert all(layer.self_attn.fused_rope_kv for layer in model.layers) and backend.kv_prewritten  # put back
    backend.key_rotation = None
    plain = collect_kv(model, seqs, 16)
    backend.key_rotation = rotation
    for (k, v), (k_f, v_f), (k_p, v_p) in zip(unfused, fused, plain, strict=True):
        torch.testing.assert_close(k_f, k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v_f, v, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k, rotate(k_p, rotation), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, v_p, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: captures real CUDA graphs")
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_graphs_over_an_8bit_cache_generate_what_eager_steps_do(tiny_llama, fmt):
    skip_without_fp8(fmt)
    prompts = [[5, 6, 7, 8, 9] * 5, list(range(3, 60)), [11, 12] * 9]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    outs = {}
    for graphs in (False, True):
        llm = LLM(model=str(tiny_llama), dtype="float32", device="cuda", cache_bits=8, cache_format=fmt,
                  num_kv_blocks=64, cuda_graphs=graphs)
        runner = llm.engine.runner
        assert llm.engine.model.layers[0].self_attn.backend.kv_prewritten  # quantized by the RoPE kernel
        assert (runner.graphs is not None and any(st.graph is not None for st in runner.graphs._static.values())) \
            == graphs
        outs[graphs] = llm.generate(prompts, params)
    for a, b in zip(outs[False], outs[True], strict=True):
        assert a.token_ids == b.token_ids


def test_fused_fp8_write_rounds_half_to_even_saturates_and_keeps_subnormals():
    """The V rows go through the kernel unrotated: their codes are those of torch's cast, for ties at
    both scales of the grid, E4M3's subnormals, values past +-448 and carries into the exponent."""
    from engine.models.fused_ops import rope_write_kv
    from engine.models.rope import RotaryEmbedding

    skip_without_fp8("fp8")
    nq, nkv, d = 2, 1, 16
    special = torch.tensor([1.0625, 1.1875, 1.9951, -1.9375, 3 * 2.0**-10, 5 * 2.0**-10, 2.0**-6 - 2.0**-11,
                            447.0, 460.0, 1000.0, -1e6, 0.0, 240.0, 248.0, 232.0, -0.0])
    values = torch.cat([special, torch.randn(7 * d) * torch.logspace(-4, 3, 7 * d)])
    t = values.numel() // d
    qkv = torch.zeros(t, (nq + 2 * nkv) * d)
    qkv[:, (nq + nkv) * d:] = values.view(t, d)
    cache = Int8KVCache.allocate(1, 16, nkv, d, 0, 1, torch.float32, DEVICE, "fp8")
    rope = RotaryEmbedding(d, 16, 10000.0, None, torch.float32, DEVICE)
    rope_write_kv(qkv, torch.zeros(t, dtype=torch.long), rope.cos, rope.sin, nq, nkv, d, cache, torch.arange(t))
    got = cache.values[1, 0, :t, 0].reshape(-1).float()
    want = values.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    assert torch.equal(got, want)  # as values: tiny negatives may store +0 where torch stores -0


def test_gpu_checks_fused_rotation_probe_measures_the_rotation(monkeypatch):
    """bench.gpu_check's kernel check of the fused rotation (compiled on a device, interpreted here): near zero for
    the kernel as it is, and large for a launch that leaves the rotation out."""
    from bench.gpu_check import _fused_rotation_error
    from engine.models import fused_ops

    assert _fused_rotation_error(4, 2, 16, DEVICE, torch.float32, torch.Generator().manual_seed(0)) < 1e-5
    real = fused_ops.rope_write_kv
    monkeypatch.setattr(fused_ops, "rope_write_kv", lambda *a, rotation=None, **kw: real(*a, **kw))
    assert _fused_rotation_error(4, 2, 16, DEVICE, torch.float32, torch.Generator().manual_seed(0)) > 0.1
