"""Mask policies: the paged attention backends against dense attention with the explicit mask."""

from __future__ import annotations

import pytest
import torch

from engine.attention.masks import build_mask, mask_positions
from engine.attention.metadata import AttentionMetadata, MaskSpec, PrefillSpan
from engine.attention.torch_backend import TorchAttentionBackend

H, KVH, D, BS = 4, 2, 16, 4

POLICIES = {
    "causal": MaskSpec(),
    "chunk_bidirectional": MaskSpec("chunk_bidirectional", start=7, end=13),
    "prefix_bidirectional": MaskSpec("prefix_bidirectional", end=6),
    "packed_segments": MaskSpec("packed_segments", start=5, segment_starts=(5, 9, 14)),
}


def dense_reference(q, k, v, mask):
    """softmax(q k^T / sqrt(d) + mask) v, with GQA heads repeated, in float64."""
    q, k, v = (t.double() for t in (q, k, v))
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / D**0.5
    scores = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v).float()


def test_mask_shapes_by_hand():
    rows = torch.arange(4)
    assert build_mask(MaskSpec(), rows, 4).tolist() == [
        [True, False, False, False], [True, True, False, False], [True, True, True, False], [True, True, True, True]]
    bi = build_mask(MaskSpec("chunk_bidirectional", start=1, end=3), rows, 4)
    assert bi.tolist() == [
        [True, False, False, False], [True, True, True, False], [True, True, True, False], [True, True, True, True]]
    packed = build_mask(MaskSpec("packed_segments", start=1, segment_starts=(1, 3)), rows, 4)
    assert packed.tolist() == [
        [True, False, False, False], [True, True, False, False], [True, True, True, False], [True, False, False, True]]
    assert mask_positions(MaskSpec("packed_segments", start=1, segment_starts=(1, 3)), rows).tolist() == [0, 1, 2, 1]


# A cached prefix can only precede a policy's region (the engine prefills a region in one step),
# so prefix_bidirectional, whose region starts at row 0, has no cached case.
CASES = [(name, 0) for name in POLICIES] + [(name, 4) for name in POLICIES if name != "prefix_bidirectional"]


def backends():
    """The torch backend, and the CPU one (its own kernel for causal chunks) where the extension builds."""
    from engine.attention.cpu_paged import CpuPagedAttentionBackend
    from engine.kernels.cpu_build import kernels_available

    return [TorchAttentionBackend] + ([CpuPagedAttentionBackend] if kernels_available() else [])


@pytest.mark.parametrize("backend_cls", backends(), ids=lambda c: c.name)
@pytest.mark.parametrize(("name", "num_cached"), CASES)
def test_paged_prefill_matches_dense_attention(name, num_cached, backend_cls):
    torch.manual_seed(0)
    spec = POLICIES[name]
    total = 18
    q, k, v = torch.randn(total, H, D), torch.randn(total, KVH, D), torch.randn(total, KVH, D)
    num_blocks = 16
    kv_cache = torch.zeros(2, num_blocks, BS, KVH, D)
    table = torch.tensor([7, 2, 9, 0, 5])  # scattered on purpose
    backend = backend_cls(H, KVH, D)
    slots = lambda rows: table[rows // BS] * BS + rows % BS  # noqa: E731
    out = torch.empty(total, H * D)
    if num_cached:
        # An earlier chunk of this sequence (causal, below the mask's region) filled the cache.
        first = torch.arange(num_cached)
        meta = AttentionMetadata(slot_mapping=slots(first), prefills=[PrefillSpan(0, num_cached, 0, table, spec)])
        out[:num_cached] = backend.forward(q[:num_cached], k[:num_cached], v[:num_cached], kv_cache, meta)
    rows = torch.arange(num_cached, total)
    meta = AttentionMetadata(slot_mapping=slots(rows), prefills=[PrefillSpan(0, len(rows), num_cached, table, spec)])
    out[num_cached:] = backend.forward(q[num_cached:], k[num_cached:], v[num_cached:], kv_cache, meta)
    ref = dense_reference(q, k, v, build_mask(spec, torch.arange(total), total)).reshape(total, H * D)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_block_keys_share_causal_prefixes_and_separate_regions():
    tokens = list(range(40))
    causal = MaskSpec()
    region = MaskSpec("chunk_bidirectional", start=16, end=28)
    assert causal.block_key(8, tokens) == b""
    assert region.block_key(16, tokens) == b""  # rows before the region are plain causal
    inside = region.block_key(24, tokens)
    assert inside and region.block_key(24, [*tokens[:27], 999, *tokens[28:]]) != inside  # sees later region tokens
    assert region.block_key(32, tokens) == region.block_key(32, [*tokens[:27], 999, *tokens[28:]])  # chain covers it
    packed = MaskSpec("packed_segments", start=8, segment_starts=(8, 12, 20))
    assert packed.block_key(8, tokens) == b"" and packed.block_key(16, tokens) != packed.block_key(24, tokens)
