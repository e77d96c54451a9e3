"""The Triton kernels against the torch reference, on the CPU under TRITON_INTERPRET=1.

The interpreter runs the kernels' code with numpy, so these tests check their
logic (block tables, masks, online softmax, fused RoPE and K/V write) on small
shapes; speed is a GPU matter. Where a CUDA device is present the same tests
run compiled on it (every tensor is made on DEVICE).
"""

from __future__ import annotations

import os

import pytest
import torch

# Before triton is imported: without a GPU, run the kernels in triton's interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import LLM, SamplingParams
from engine.attention.masks import build_mask
from engine.attention.metadata import MaskSpec, PrefillSpan
from engine.attention.torch_backend import gather_kv
from engine.attention.triton_kernels import paged_decode, paged_prefill

# Slow tier (runs the Triton kernels, interpreted where there is no GPU): `ops/dev.sh test --fast` leaves it out.
pytestmark = pytest.mark.slow

H, KVH, D, BS, NB = 6, 2, 16, 16, 12
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _on_device():
    with DEVICE:  # factory calls without a device make their tensors there
        yield


def dense(q, k, v, mask):
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / D**0.5
    scores = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v.double()).float()


def test_paged_decode_matches_dense():
    torch.manual_seed(0)
    kv = torch.randn(2, NB, BS, KVH, D)
    tables = torch.tensor([[3, 7, 1], [5, 0, 0], [9, 2, 11]])
    lens = torch.tensor([40, 9, 33])
    q = torch.randn(3, H, D)
    out = paged_decode(q, kv, tables, lens, D**-0.5)
    for b in range(3):
        k, v = gather_kv(kv, tables[b:b + 1])
        n = int(lens[b])
        ref = dense(q[b:b + 1], k[0, :n], v[0, :n], torch.ones(1, n, dtype=torch.bool))
        torch.testing.assert_close(out[b], ref[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("spec", [
    MaskSpec(),
    MaskSpec("chunk_bidirectional", start=10, end=21),
    MaskSpec("prefix_bidirectional", end=7),
    MaskSpec("packed_segments", start=6, segment_starts=(6, 12, 19)),
], ids=lambda s: s.policy)
def test_paged_prefill_matches_dense_for_every_policy(spec):
    torch.manual_seed(1)
    kv = torch.randn(2, NB, BS, KVH, D)
    total, cached = 26, 0 if spec.policy == "prefix_bidirectional" else 4
    table = torch.tensor([8, 3])
    q_all = torch.randn(total, H, D)
    # The cache holds the sequence's K/V rows (the backend writes them before attention).
    k_all, v_all = gather_kv(kv, table.view(1, -1))
    k_all, v_all = k_all[0, :total], v_all[0, :total]
    span = PrefillSpan(token_start=0, num_tokens=total - cached, num_cached=cached, block_table=table, mask=spec)
    out = paged_prefill(q_all[cached:], kv, [span], D**-0.5)
    mask = build_mask(spec, torch.arange(cached, total), total)
    ref = dense(q_all[cached:], k_all, v_all, mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_paged_prefill_handles_several_spans_in_one_launch():
    torch.manual_seed(2)
    kv = torch.randn(2, NB, BS, KVH, D)
    spans = [PrefillSpan(0, 5, 0, torch.tensor([4])), PrefillSpan(5, 20, 12, torch.tensor([6, 10]))]
    q = torch.randn(25, H, D)
    out = paged_prefill(q, kv, spans, D**-0.5)
    for s in spans:
        k, v = gather_kv(kv, s.block_table.view(1, -1))
        kv_len = s.num_cached + s.num_tokens
        mask = build_mask(MaskSpec(), torch.arange(s.num_cached, kv_len), kv_len)
        ref = dense(q[s.token_start:s.token_start + s.num_tokens], k[0, :kv_len], v[0, :kv_len], mask)
        torch.testing.assert_close(out[s.token_start:s.token_start + s.num_tokens], ref, atol=1e-5, rtol=0)


def test_the_triton_backend_generates_what_the_torch_backend_does(tiny_llama):
    prompts = [[5, 6, 7, 8, 9] * 5, list(range(3, 60))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=str(tiny_llama), dtype="float32", attention_backend=backend, max_num_batched_tokens=32,
                  num_kv_blocks=32, device=str(DEVICE), cuda_graphs=False, gpu_fused_kernels=False)
        outs[backend] = llm.generate(prompts, params)
    for a, b in zip(outs["torch"], outs["triton"], strict=True):
        assert a.token_ids == b.token_ids
        for (lp_a, _), (lp_b, _) in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(lp_a - lp_b) < 1e-4


def test_fused_add_rms_norm_and_silu_mul_match_torch():
    import torch.nn.functional as F

    from engine.models.fused_ops import add_rms_norm, silu_mul

    torch.manual_seed(3)
    x, res, w = torch.randn(5, 48), torch.randn(5, 48), torch.randn(48)
    out, summed = add_rms_norm(x, w, 1e-6, res)
    ref_sum = x + res
    torch.testing.assert_close(summed, ref_sum)
    torch.testing.assert_close(out, F.rms_norm(ref_sum, (48,), w, 1e-6), atol=1e-5, rtol=1e-5)
    out_nores, same = add_rms_norm(x, w, 1e-6)
    assert same is x  # no residual: the input is the sum
    torch.testing.assert_close(out_nores, F.rms_norm(x, (48,), w, 1e-6), atol=1e-5, rtol=1e-5)
    gu = torch.randn(4, 2 * 40)
    torch.testing.assert_close(silu_mul(gu), F.silu(gu[:, :40]) * gu[:, 40:], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("splits", "pages"), [(1, 4), (2, 4), (3, 1), (5, 1), (7, 2)])
def test_split_paged_decode_matches_dense(splits, pages):
    """The flash-decoding split (a sequence's blocks over several programs, merged after) changes nothing,
    including splits that get no blocks of a short sequence."""
    torch.manual_seed(3)
    kv = torch.randn(2, NB, BS, KVH, D)
    tables = torch.tensor([[3, 7, 1, 4, 10, 6, 8], [5, 0, 0, 0, 0, 0, 0], [9, 2, 11, 0, 0, 0, 0]])
    lens = torch.tensor([103, 9, 40])
    q = torch.randn(3, H, D)
    out = paged_decode(q, kv, tables, lens, D**-0.5, splits=splits, pages=pages)
    for b in range(3):
        k, v = gather_kv(kv, tables[b:b + 1])
        n = int(lens[b])
        ref = dense(q[b:b + 1], k[0, :n], v[0, :n], torch.ones(1, n, dtype=torch.bool))
        torch.testing.assert_close(out[b], ref[0], atol=1e-5, rtol=0)


def test_decode_splits_fill_the_device_only_when_needed():
    from engine.attention.triton_kernels import decode_splits

    cpu = torch.device("cpu")  # counts as 4 multiprocessors
    assert decode_splits(64, 8, 70, 4, cpu) == (1, 70)  # enough programs already
    splits, per_split = decode_splits(1, 2, 70, 4, cpu)
    assert splits == 4 and per_split % 4 == 0 and splits * per_split >= 70 > (splits - 1) * per_split
    assert decode_splits(1, 2, 3, 4, cpu) == (1, 3)  # one iteration's worth of blocks: nothing to split


@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (6, 2), (8, 2), (16, 2)])
@pytest.mark.parametrize("rows", [None, 16])
def test_decode_groups_in_their_own_rows_or_padded_to_16_match_dense(heads, kv_heads, rows):
    """Each KV head's query group fills group_rows(G) rows of the kernel's dot products (1, 4, 4, 8 here)
    by default; 16 (the earlier padding, which the device sweep times beside it) gives the same result.
    Split, so the partials' rows of every group are checked too."""
    import torch.nn.functional as F

    from engine.attention.triton_kernels import group_rows

    assert [group_rows(g) for g in (1, 3, 4, 8)] == [1, 4, 4, 8]
    torch.manual_seed(4)
    kv = torch.randn(2, NB, BS, kv_heads, D)
    tables = torch.tensor([[3, 7, 1], [5, 0, 0]])
    lens = torch.tensor([40, 9])
    q = torch.randn(2, heads, D)
    for splits in (1, 2):
        out = paged_decode(q, kv, tables, lens, D**-0.5, splits=splits, group_rows=rows)
        for b in range(2):
            k, v = gather_kv(kv, tables[b:b + 1])
            n = int(lens[b])
            ref = F.scaled_dot_product_attention(q[b].unsqueeze(1).double(), k[0, :n].transpose(0, 1).double(),
                                                 v[0, :n].transpose(0, 1).double(), scale=D**-0.5, enable_gqa=True)
            torch.testing.assert_close(out[b], ref.squeeze(1).float(), atol=1e-5, rtol=0)


def test_before_triton_3_5_the_group_takes_16_rows_which_its_dot_requires(monkeypatch):
    import triton

    from engine.attention import triton_kernels

    try:
        for version, rows in (("3.4.0", [16, 16, 32]), ("3.5.1", [4, 8, 32]), ("3.10.0+git1a2b", [4, 8, 32])):
            monkeypatch.setattr(triton, "__version__", version)
            triton_kernels._dot_takes_small_rows.cache_clear()
            assert [triton_kernels.group_rows(g) for g in (3, 8, 32)] == rows, version
    finally:
        triton_kernels._dot_takes_small_rows.cache_clear()  # the installed version's answer again


@pytest.mark.parametrize("rows", [2, 6])
def test_decode_refuses_group_rows_that_do_not_hold_the_group_as_a_power_of_two(rows):
    q, kv = torch.zeros(1, 8, D), torch.zeros(2, NB, BS, 2, D)
    with pytest.raises(ValueError, match="power of two rows, at least 4"):
        paged_decode(q, kv, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), 1.0,
                     group_rows=rows)


def _fake_flash_attn(monkeypatch):
    """A stand-in for the flash_attn package with its two entry points written in torch (same
    arguments and layouts), so the flash backend's own plumbing is tested without a GPU."""
    import sys
    import types

    import torch.nn.functional as F

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
        out = torch.empty_like(q)
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
            out[a:b] = F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=causal,
                scale=softmax_scale, enable_gqa=True).transpose(0, 1)
        return out

    def with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal):
        kv = torch.stack([k_cache, v_cache])
        k, v = gather_kv(kv, block_table.long())
        outs = []
        for i, n in enumerate(cache_seqlens.tolist()):
            outs.append(F.scaled_dot_product_attention(
                q[i].transpose(0, 1), k[i, :n].transpose(0, 1), v[i, :n].transpose(0, 1), scale=softmax_scale,
                enable_gqa=True).transpose(0, 1))
        return torch.stack(outs)

    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func, module.flash_attn_with_kvcache = varlen, with_kvcache
    monkeypatch.setitem(sys.modules, "flash_attn", module)


@pytest.mark.parametrize("backend", ["triton", "flash_attn"])
def test_gpu_backends_match_the_torch_backend_on_a_mixed_step(backend, monkeypatch):
    """Decodes, a long fresh prompt (torch SDPA or flash varlen), a short fresh prompt, a chunk after a
    cached prefix and a masked chunk in one step, through every layer's cached launch plan."""
    from engine.attention.metadata import AttentionMetadata
    from engine.attention.selection import select_backend

    if backend == "flash_attn":
        _fake_flash_attn(monkeypatch)
    torch.manual_seed(4)
    nb = 64
    kv_ref = torch.randn(2, nb, BS, KVH, D)
    lens = [300, 7, 20, 30]
    cached = [0, 0, 16, 0]
    masks = [MaskSpec(), MaskSpec(), MaskSpec(), MaskSpec("chunk_bidirectional", start=10, end=25)]
    decode_tables = torch.tensor([[40, 41, 42], [43, 0, 0]])
    decode_lens = torch.tensor([35, 3])
    tables = [list(range(0, 19)), [20], [21, 22], [23, 24]]
    spans, start = [], 2  # two decode rows first
    for n, c, m, t in zip(lens, cached, masks, tables, strict=True):
        spans.append(PrefillSpan(start, n - c, c, torch.tensor(t), m, block_ids=t))
        start += n - c
    slots = [40 * BS + 34, 43 * BS + 2] + [t[r // BS] * BS + r % BS for s, t in zip(spans, tables, strict=True)
                                            for r in range(s.num_cached, s.kv_len)]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), num_decodes=2, decode_block_tables=decode_tables,
                             decode_seq_lens=decode_lens, decode_max_len=35, prefills=spans)
    q, k, v = torch.randn(start, H, D), torch.randn(start, KVH, D), torch.randn(start, KVH, D)
    reference = select_backend("torch", DEVICE, H, KVH, D)
    want = reference.forward(q, k, v, kv_ref.clone(), meta)
    tested = select_backend(backend, DEVICE, H, KVH, D)
    for _ in range(2):  # the second call (another layer) reuses the plan the first one made
        kv = kv_ref.clone()
        got = tested.forward(q, k, v, kv, meta)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert backend in meta.backend_cache


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("spec", [
    MaskSpec(),
    MaskSpec("chunk_bidirectional", start=30, end=75),
    MaskSpec("prefix_bidirectional", end=50),
    MaskSpec("packed_segments", start=25, segment_starts=(25, 40, 88)),
], ids=lambda s: s.policy)
def test_paged_prefill_tiles_stop_at_what_their_rows_may_see(spec, block_m):
    """Several query tiles, several 4-block key pages: each tile reads keys only up to its own limit
    (causal, or a bidirectional region's end), and the rows still match the dense reference."""
    torch.manual_seed(5)
    kv = torch.randn(2, NB, BS, KVH, D)
    total, cached = 110, 0 if spec.policy == "prefix_bidirectional" else 20
    table = torch.tensor([8, 3, 11, 0, 5, 9, 1])
    q = torch.randn(total - cached, H, D)
    k_all, v_all = gather_kv(kv, table.view(1, -1))
    span = PrefillSpan(0, total - cached, cached, table, spec)
    out = paged_prefill(q, kv, [span], D**-0.5, block_m=block_m)
    ref = dense(q, k_all[0, :total], v_all[0, :total], build_mask(spec, torch.arange(cached, total), total))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("write", [True, False])
def test_fused_rope_and_kv_write_match_the_torch_path(write):
    """One launch rotates q and k in place in the fused qkv output and stores k and v at their slots,
    as RotaryEmbedding.apply_torch_ and write_kv do (the rows of other slots stay untouched)."""
    from engine.attention.torch_backend import write_kv
    from engine.models.fused_ops import rope_write_kv
    from engine.models.rope import RotaryEmbedding

    torch.manual_seed(6)
    n = 7
    rope = RotaryEmbedding(D, 64, 10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                           torch.float32, DEVICE)
    positions = torch.tensor([0, 5, 63, 17, 17, 2, 40])
    slots = torch.tensor([3, 40, 41, 100, 7, 191, 64])
    qkv = torch.randn(n, (H + 2 * KVH) * D)
    kv = torch.randn(2, NB, BS, KVH, D)
    want_qkv, want_kv = qkv.clone(), kv.clone()
    q, k, v = (t.view(n, -1, D) for t in want_qkv.split([H * D, KVH * D, KVH * D], dim=-1))
    rope.apply_torch_(positions, q, k)
    if write:
        write_kv(want_kv, k, v, slots)
    rope_write_kv(qkv, positions, rope.cos, rope.sin, H, KVH, D, kv if write else None, slots if write else None)
    torch.testing.assert_close(qkv, want_qkv, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(kv, want_kv, atol=1e-6, rtol=1e-6)


def test_fused_rope_refuses_a_cache_it_cannot_address():
    from engine.models.fused_ops import rope_write_kv

    qkv = torch.randn(2, (H + 2 * KVH) * D)
    cos = sin = torch.ones(8, D)
    with pytest.raises(ValueError, match="contiguous paged cache"):
        rope_write_kv(qkv, torch.tensor([0, 1]), cos, sin, H, KVH, D, torch.randn(2, NB, BS, D, KVH).transpose(-1, -2),
                      torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="fused qkv"):
        rope_write_kv(qkv[:, :-D], torch.tensor([0, 1]), cos, sin, H, KVH, D)


@pytest.mark.parametrize("chunk_rows", [0, 16])
def test_the_fused_decoder_generates_what_the_layer_path_does(tiny_llama, chunk_rows):
    """enable_triton_fusions (residual adds fused into the next norm, RoPE fused with the K/V write, the
    decode written in place) changes no token: a prompt longer than the activation workspace (its MLP
    then adds into the residual chunk by chunk) and a prefix-cached one, batched with decodes."""
    prompts = [list(range(3, 60)), [5, 6, 7, 8, 9] * 5, list(range(3, 40))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    outs = {}
    for fused in (False, True):
        llm = LLM(model=str(tiny_llama), dtype="float32", attention_backend="triton", max_num_batched_tokens=64,
                  num_kv_blocks=32, device=str(DEVICE), activation_chunk_rows=chunk_rows, cuda_graphs=False,
                  gpu_fused_kernels=False)
        if fused:
            llm.engine.model.enable_triton_fusions()
            assert llm.engine.model.layers[0].self_attn.fused_rope_kv
            assert llm.engine.model.layers[0].self_attn.backend.kv_prewritten
        outs[fused] = llm.generate(prompts, params)
    for a, b in zip(outs[False], outs[True], strict=True):
        assert a.token_ids == b.token_ids
        for (lp_a, _), (lp_b, _) in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(lp_a - lp_b) < 1e-4


def test_fusions_leave_the_kv_write_to_backends_that_need_it(tiny_llama):
    """A q/k-norm model keeps its own RoPE and its backend still writes the cache."""
    llm = LLM(model=str(tiny_llama), dtype="float32", attention_backend="triton", num_kv_blocks=32,
              device=str(DEVICE), cuda_graphs=False, gpu_fused_kernels=False)
    model = llm.engine.model
    model.layers[1].self_attn.q_norm = model.layers[1].self_attn.k_norm = torch.nn.Identity()
    model.enable_triton_fusions()
    assert model.triton_fusions
    assert not any(layer.self_attn.fused_rope_kv for layer in model.layers)
    assert not model.layers[0].self_attn.backend.kv_prewritten
