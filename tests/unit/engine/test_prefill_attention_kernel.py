"""The CPU causal prefill-attention kernels (engine/attention/csrc/prefill_attention_cpu.cpp).

The fp32 and the int8 cache's variant, against a float64 reference over K/V (for int8: the
dequantized rows) gathered through the block table, for head sizes with and
without a compiled-in head_dim, GQA groups, chunks after cached rows, block sizes below, at and
above the kernel's 16 (or 8) query rows per tile, and scattered blocks. Also: a row's output does
not depend on the chunk it was computed in, q may be a strided view (the fused qkv output), and
bad arguments get errors, not reads out of bounds.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention.cpu_paged import CpuPagedAttentionBackend
from engine.attention.int8_backend import CpuPagedInt8AttentionBackend, TorchInt8AttentionBackend
from engine.attention.kv_int8 import Int8KVCache
from engine.attention.metadata import AttentionMetadata, MaskSpec, PrefillSpan
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels.cpu_build import load_kernels
from tests.unit.engine.test_paged_decode_kernel import int8_cache

# Slow tier (builds and runs the C++ kernels): `ops/dev.sh test --fast` leaves it out.
# Every test runs on the AVX2 and the AVX-512 kernel module (tests/conftest.py's kernel_isa).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("kernel_isa")]


def cache(g, rows, kv_heads, head_dim, block_size, spare=4):
    """A pool with spare blocks, a scattered table covering `rows` rows, and random K/V in it."""
    nb = -(-rows // block_size)
    kv = torch.randn(2, nb + spare, block_size, kv_heads, head_dim, generator=g)
    table = torch.randperm(nb + spare, generator=g)[:nb]
    return kv, table


def reference(q, kv, table, num_cached, scale):
    """Causal softmax(q k^T * scale) v for rows num_cached.. of the sequence, in float64."""
    t, h, _ = q.shape
    bs, kvh = kv.shape[2], kv.shape[3]
    rows = torch.arange(num_cached + t)
    k = kv[0, table[rows // bs], rows % bs].double().repeat_interleave(h // kvh, dim=1)
    v = kv[1, table[rows // bs], rows % bs].double().repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), k) * scale
    visible = rows.view(1, -1) <= (num_cached + torch.arange(t)).view(-1, 1)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v).float()


def run(q, kv, table, num_cached, scale):
    out = torch.empty(q.shape)
    load_kernels().paged_prefill_attention(out, q, kv, table, num_cached, scale)
    return out


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (4, 4, 64), (6, 2, 32),
                                                             (4, 1, 48), (10, 2, 20)])
@pytest.mark.parametrize(("tokens", "num_cached"), [(1, 0), (5, 0), (16, 0), (17, 0), (100, 0), (1, 40), (23, 9),
                                                    (64, 130)])
@pytest.mark.parametrize("block_size", [16, 8, 32])
def test_matches_the_reference(heads, kv_heads, head_dim, tokens, num_cached, block_size):
    g = torch.Generator().manual_seed(heads * 1000 + head_dim * 10 + tokens + num_cached + block_size)
    kv, table = cache(g, num_cached + tokens, kv_heads, head_dim, block_size)
    q = torch.randn(tokens, heads, head_dim, generator=g)
    scale = head_dim ** -0.5
    torch.testing.assert_close(run(q, kv, table, num_cached, scale), reference(q, kv, table, num_cached, scale),
                               rtol=1e-5, atol=1e-5)


def test_a_row_does_not_depend_on_its_chunk():
    """Rows computed in one chunk equal, bit for bit, the same rows computed in any later split."""
    g = torch.Generator().manual_seed(3)
    kv, table = cache(g, 150, 3, 64, 16)
    q = torch.randn(150, 9, 64, generator=g)
    whole = run(q, kv, table, 0, 0.125)
    for split in (1, 7, 16, 33, 149):
        assert torch.equal(run(q[split:], kv, table, split, 0.125), whole[split:])
        assert torch.equal(run(q[:split], kv, table, 0, 0.125), whole[:split])


def test_q_may_be_a_strided_view():
    g = torch.Generator().manual_seed(4)
    kv, table = cache(g, 40, 2, 64, 16)
    qkv = torch.randn(40, 4 * 64 + 2 * 2 * 64, generator=g)
    q = qkv[:, :4 * 64].view(40, 4, 64)  # rows strided by the fused projection's width
    assert not q.is_contiguous()
    assert torch.equal(run(q, kv, table, 0, 0.125), run(q.contiguous(), kv, table, 0, 0.125))


def test_bad_arguments_are_errors():
    g = torch.Generator().manual_seed(5)
    kv, table = cache(g, 32, 2, 64, 16)
    q = torch.randn(32, 4, 64, generator=g)
    ops = load_kernels()
    with pytest.raises(RuntimeError, match="block table must cover"):
        ops.paged_prefill_attention(torch.empty(32, 4, 64), q, kv, table, 1, 0.125)  # 33 rows > 2 blocks
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        ops.paged_prefill_attention(torch.empty(32, 3, 64), q[:, :3], kv, table, 0, 0.125)
    with pytest.raises(RuntimeError, match="fp32"):
        ops.paged_prefill_attention(torch.empty(32, 4, 64), q, kv.half(), table, 0, 0.125)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.paged_prefill_attention(torch.empty(64, 4, 64)[::2], q, kv, table, 0, 0.125)
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.paged_prefill_attention(torch.empty(32, 4, 64), q, kv, table + 100, 0, 0.125)
    long_table = torch.zeros((1 << 20) + 2, dtype=torch.int64)  # positions compared as floats: under 2^24 only
    with pytest.raises(RuntimeError, match="under 2\\^24 rows"):
        ops.paged_prefill_attention(torch.empty(32, 4, 64), q, kv, long_table, 1 << 24, 0.125)


def spy_on(backend, kernel: str, monkeypatch) -> list[int]:
    """Record the num_cached argument of every call the backend makes to `kernel`."""
    calls, real = [], backend._ops

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

    def call(*args):
        calls.append(args[-2])
        return getattr(real, kernel)(*args)

    spy = Spy()
    setattr(spy, kernel, call)
    monkeypatch.setattr(backend, "_ops", spy)
    return calls


def test_backend_takes_the_kernel_for_causal_fp32_chunks_only(monkeypatch):
    """Causal fp32 chunks call the kernel and match the torch backend; bf16 and other masks do not call it."""
    g = torch.Generator().manual_seed(6)
    kv, table = cache(g, 48, 2, 64, 16)
    q, k, v = (torch.randn(20, n, 64, generator=g) for n in (4, 2, 2))
    backend = CpuPagedAttentionBackend(4, 2, 64)
    calls = spy_on(backend, "paged_prefill_attention", monkeypatch)
    slots = table[torch.arange(28, 48) // 16] * 16 + torch.arange(28, 48) % 16
    meta = AttentionMetadata(slot_mapping=slots, prefills=[PrefillSpan(0, 20, 28, table)])
    got = backend.forward(q, k, v, kv.clone(), meta)
    want = TorchAttentionBackend(4, 2, 64).forward(q, k, v, kv.clone(), meta)
    assert calls == [28]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    bf16 = [t.to(torch.bfloat16) for t in (q, k, v, kv)]
    backend.forward(*bf16, meta)
    bidirectional = PrefillSpan(0, 20, 28, table, MaskSpec("chunk_bidirectional", start=30, end=40))
    backend.forward(q, k, v, kv.clone(), AttentionMetadata(slot_mapping=slots, prefills=[bidirectional]))
    assert calls == [28]


def int8_pool(g, kv):
    """Random int8 codes and fp16 scales shaped like the fp32 pool kv, and their dequantized rows."""
    return int8_cache(g, *kv.shape[1:])


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (6, 2, 32)])
@pytest.mark.parametrize(("tokens", "num_cached"), [(1, 0), (17, 0), (100, 0), (23, 9), (64, 130)])
@pytest.mark.parametrize("block_size", [16, 8])
def test_int8_matches_the_reference_on_its_dequantized_rows(heads, kv_heads, head_dim, tokens, num_cached,
                                                            block_size):
    g = torch.Generator().manual_seed(heads * 1000 + head_dim * 10 + tokens + num_cached + block_size)
    kv, table = cache(g, num_cached + tokens, kv_heads, head_dim, block_size)
    codes, scales, dequantized = int8_pool(g, kv)
    q = torch.randn(tokens, heads, head_dim, generator=g)
    out = torch.empty(q.shape)
    load_kernels().paged_prefill_attention_int8(out, q, codes, scales, table, num_cached, head_dim ** -0.5)
    torch.testing.assert_close(out, reference(q, dequantized, table, num_cached, head_dim ** -0.5),
                               rtol=1e-5, atol=1e-5)
    # The same dequantized values through the fp32 kernel: the same bits.
    assert torch.equal(out, run(q, dequantized, table, num_cached, head_dim ** -0.5))


def test_int8_bad_arguments_are_errors():
    g = torch.Generator().manual_seed(8)
    kv, table = cache(g, 32, 2, 64, 16)
    codes, scales, _ = int8_pool(g, kv)
    q = torch.randn(32, 4, 64, generator=g)
    ops = load_kernels()
    with pytest.raises(RuntimeError, match="int8 codes and fp16 scales"):
        ops.paged_prefill_attention_int8(torch.empty(q.shape), q, codes, scales.float(), table, 0, 0.125)
    with pytest.raises(RuntimeError, match="scales must be"):
        ops.paged_prefill_attention_int8(torch.empty(q.shape), q, codes, scales[:, :1], table, 0, 0.125)
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.paged_prefill_attention_int8(torch.empty(q.shape), q, codes, scales, table + 100, 0, 0.125)


def test_int8_backend_uses_the_kernel_without_a_window_and_matches_the_reference(monkeypatch):
    g = torch.Generator().manual_seed(9)
    kv, table = cache(g, 48, 2, 64, 16)
    q, k, v = (torch.randn(20, n, 64, generator=g) for n in (4, 2, 2))
    slots = table[torch.arange(28, 48) // 16] * 16 + torch.arange(28, 48) % 16
    meta = AttentionMetadata(slot_mapping=slots, prefills=[PrefillSpan(0, 20, 28, table)])
    codes, scales, _ = int8_pool(g, kv)
    fast = CpuPagedInt8AttentionBackend(4, 2, 64)
    calls = spy_on(fast, "paged_prefill_attention_int8", monkeypatch)
    outs = [backend.forward(q, k, v, Int8KVCache(codes.clone(), scales.clone()), meta)
            for backend in (fast, TorchInt8AttentionBackend(4, 2, 64))]
    assert calls == [28]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
def test_the_kernels_write_each_chunk_straight_into_the_steps_output(monkeypatch, int8):
    """Two chunks in one step: each kernel call's output is that chunk's rows of the tensor forward returns (no
    copy), and the values are those of a kernel call into a tensor of its own."""
    g = torch.Generator().manual_seed(10)
    kv, table = cache(g, 64, 2, 64, 16)
    table2 = table.flip(0)  # the second sequence's blocks: the same pool, another order
    q, k, v = (torch.randn(30, n, 64, generator=g) for n in (4, 2, 2))
    spans = [PrefillSpan(0, 12, 20, table), PrefillSpan(12, 18, 0, table2)]
    slots = torch.cat([table[torch.arange(20, 32) // 16] * 16 + torch.arange(20, 32) % 16,
                       table2[torch.arange(0, 18) // 16] * 16 + torch.arange(0, 18) % 16])
    meta = AttentionMetadata(slot_mapping=slots, prefills=spans)
    if int8:
        codes, scales, _ = int8_pool(g, kv)
        backend, kernel = CpuPagedInt8AttentionBackend(4, 2, 64), "paged_prefill_attention_int8"
        pool = Int8KVCache(codes, scales)
    else:
        backend, kernel, pool = CpuPagedAttentionBackend(4, 2, 64), "paged_prefill_attention", kv
    written, real = [], backend._ops

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

    def call(out, *args):
        written.append(out.data_ptr())
        return getattr(real, kernel)(out, *args)

    spy = Spy()
    setattr(spy, kernel, call)
    monkeypatch.setattr(backend, "_ops", spy)
    got = backend.forward(q, k, v, pool, meta).view(30, 4, 64)
    assert written == [got[0].data_ptr(), got[12].data_ptr()]
    for span in spans:  # the same bits as the kernel into a tensor of its own, over the cache forward wrote
        rows = slice(span.token_start, span.token_start + span.num_tokens)
        alone = torch.empty(span.num_tokens, 4, 64)
        args = (codes, scales) if int8 else (kv,)
        getattr(real, kernel)(alone, q[rows], *args, span.block_table, span.num_cached, backend.scale)
        assert torch.equal(got[rows], alone)
