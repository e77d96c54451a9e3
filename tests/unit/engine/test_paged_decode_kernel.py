"""The CPU paged decode-attention kernel against a plain torch reference.

Covers both code paths of engine/attention/csrc/paged_attention_cpu.cpp and of its int8-cache
variant (paged_attention_int8_cpu.cpp): the per-sequence AVX-512 path (head_dim 64 or 128) and
the per-(sequence, KV head) path (other head sizes, half-precision caches), with GQA groups,
lengths around block edges and scattered blocks.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu_build import load_kernels

# Slow tier (builds and runs the C++ kernels): `ops/dev.sh test --fast` leaves it out.
# Every test runs on the AVX2 and the AVX-512 kernel module (tests/conftest.py's kernel_isa).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("kernel_isa")]


def reference(q, kv, tables, lens, scale):
    """softmax(q k^T * scale) v per sequence, from K/V gathered through the block table, in float64."""
    bs, kvh = kv.shape[2], kv.shape[3]
    out = torch.empty_like(q)
    for b, n in enumerate(lens.tolist()):
        rows = torch.arange(n)
        blocks = tables[b, rows // bs]
        k = kv[0, blocks, rows % bs].double()  # [n, kvh, d]
        v = kv[1, blocks, rows % bs].double()
        g = q.shape[1] // kvh
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [n, h, d]
        scores = torch.einsum("hd,nhd->hn", q[b].double(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out


def batch(g, heads, head_dim, block_size, spare_blocks=5):
    """Sequence lengths around block edges, scattered block tables over a pool with spare blocks, and q."""
    lens = torch.tensor([1, 15, 16, 17, 33, 100, 7], dtype=torch.int64)
    max_blocks = -(-int(lens.max()) // block_size)
    num_blocks = len(lens) * max_blocks + spare_blocks
    tables = torch.randperm(num_blocks, generator=g)[:len(lens) * max_blocks].view(len(lens), max_blocks)
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    return lens, num_blocks, tables, q


# The AVX-512 path's second pass takes a KV head's query heads three at a time for head_dim 64 (one at a time
# for 128): groups of 3 (9 over 3), 2 (4 over 2), 3 + 1 (8 over 2) and 1 (4 over 4, 8 over 2 at 128).
GROUPS = [(9, 3, 64), (4, 2, 64), (8, 2, 64), (8, 2, 128), (4, 4, 64)]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [*GROUPS, (6, 2, 32), (4, 1, 48)])
@pytest.mark.parametrize("block_size", [16, 8, 32])
def test_matches_the_reference(heads, kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(heads * 100 + head_dim + block_size)
    lens, num_blocks, tables, q = batch(g, heads, head_dim, block_size)
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    scale = head_dim ** -0.5
    got = load_kernels().paged_decode_attention(q, kv, tables, lens, scale)
    torch.testing.assert_close(got, reference(q, kv, tables, lens, scale), rtol=1e-5, atol=1e-5)


def test_each_sequence_is_independent_of_the_batch():
    g = torch.Generator().manual_seed(5)
    kv = torch.randn(2, 64, 16, 3, 64, generator=g)
    tables = torch.randperm(64, generator=g)[:60].view(6, 10)
    lens = torch.tensor([150, 3, 160, 77, 16, 90], dtype=torch.int64)
    q = torch.randn(6, 9, 64, generator=g)
    full = load_kernels().paged_decode_attention(q, kv, tables, lens, 0.125)
    for b in range(6):
        alone = load_kernels().paged_decode_attention(q[b:b + 1], kv, tables[b:b + 1], lens[b:b + 1], 0.125)
        assert torch.equal(alone, full[b:b + 1])


def test_half_precision_cache():
    g = torch.Generator().manual_seed(6)
    kv = torch.randn(2, 20, 16, 2, 64, generator=g).to(torch.bfloat16)
    tables = torch.arange(20).view(2, 10)
    lens = torch.tensor([40, 151], dtype=torch.int64)
    q = torch.randn(2, 4, 64, generator=g)
    got = load_kernels().paged_decode_attention(q, kv, tables, lens, 0.125)
    torch.testing.assert_close(got, reference(q, kv.float(), tables, lens, 0.125), rtol=1e-4, atol=1e-4)


def int8_cache(g, num_blocks, block_size, kv_heads, head_dim):
    codes = torch.randint(-127, 128, (2, num_blocks, block_size, kv_heads, head_dim), generator=g, dtype=torch.int8)
    scales = (torch.rand(2, num_blocks, block_size, kv_heads, generator=g) * 0.02 + 1e-3).to(torch.float16)
    return codes, scales, codes.float() * scales.float().unsqueeze(-1)


# head_dim 64 and 128 take the AVX-512 sequence-per-task path (where the CPU has it), which applies each row's
# scale to its score and to its weight in the sum of V; 32 and 48 the per-(sequence, KV head) path, which
# dequantizes value * scale. Both attend in fp32.
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [*GROUPS, (6, 2, 32), (4, 1, 48)])
@pytest.mark.parametrize("block_size", [16, 8, 32])
def test_int8_cache_matches_the_reference_on_its_dequantized_rows(heads, kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(heads * 10 + head_dim + block_size)
    lens, num_blocks, tables, q = batch(g, heads, head_dim, block_size, spare_blocks=3)
    codes, scales, dequantized = int8_cache(g, num_blocks, block_size, kv_heads, head_dim)
    scale = head_dim ** -0.5
    got = load_kernels().paged_decode_attention_int8(q, codes, scales, tables, lens, scale, None, None, None)
    torch.testing.assert_close(got, reference(q, dequantized, tables, lens, scale), rtol=1e-5, atol=1e-5)


def test_int8_cache_each_sequence_is_independent_of_the_batch():
    g = torch.Generator().manual_seed(8)
    codes, scales, _ = int8_cache(g, 64, 16, 3, 64)
    tables = torch.randperm(64, generator=g)[:60].view(6, 10)
    lens = torch.tensor([150, 3, 160, 77, 16, 90], dtype=torch.int64)
    q = torch.randn(6, 9, 64, generator=g)
    ops = load_kernels()
    full = ops.paged_decode_attention_int8(q, codes, scales, tables, lens, 0.125, None, None, None)
    for b in range(6):
        alone = ops.paged_decode_attention_int8(q[b:b + 1], codes, scales, tables[b:b + 1], lens[b:b + 1], 0.125,
                                                None, None, None)
        assert torch.equal(alone, full[b:b + 1])


@pytest.mark.parametrize("cache", ["fp32", "int8"])
def test_thread_count_and_batch_order_do_not_change_results(cache):
    """Threads take sequences longest first from a shared counter: a sequence's output is the same
    bits whichever thread computes it, in whatever order the batch lists it, and an empty one is zeros."""
    g = torch.Generator().manual_seed(9)
    tables = torch.randperm(96, generator=g)[:88].view(8, 11)
    lens = torch.tensor([170, 3, 0, 96, 16, 1, 121, 47], dtype=torch.int64)
    q = torch.randn(8, 9, 64, generator=g)
    ops = load_kernels()
    if cache == "fp32":
        kv = torch.randn(2, 96, 16, 3, 64, generator=g)
        values = kv

        def attend(q, tables, lens):
            return ops.paged_decode_attention(q, kv, tables, lens, 0.125)
    else:
        codes, scales, values = int8_cache(g, 96, 16, 3, 64)

        def attend(q, tables, lens):
            return ops.paged_decode_attention_int8(q, codes, scales, tables, lens, 0.125, None, None, None)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = attend(q, tables, lens)
        torch.set_num_threads(1)
        one = attend(q, tables, lens)
    finally:
        torch.set_num_threads(threads)
    perm = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])
    shuffled = attend(q[perm], tables[perm], lens[perm])
    assert torch.equal(two, one)
    assert torch.equal(shuffled, two[perm])
    assert torch.equal(two[2], torch.zeros_like(two[2]))
    live = lens > 0
    torch.testing.assert_close(two[live], reference(q[live], values, tables[live], lens[live], 0.125),
                               rtol=1e-5, atol=1e-5)
