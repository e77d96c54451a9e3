"""bench.llc_prefetch: its probe computes the real products, with and without the KV prefetch, and reads all the KV."""

from __future__ import annotations

import pytest
import torch

from bench.llc_prefetch import avx512, probe_module

# Slow tier (builds and runs the C++ kernels): `ops/dev.sh test --fast` leaves it out.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not avx512(), reason="the probe's tiles need an AVX-512 CPU")]


def test_probe_gemms_compute_the_product_and_the_reads_sum_every_kv_float():
    from engine.attention.cpu_paged import load_kernels

    ops, m = load_kernels(), probe_module()
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 96), (64, 64), (64, 256), (128, 64)]  # (in, out) per linear; the last reads h, the others x
    plain = [torch.randn(n, k, generator=gen) for k, n in shapes]
    weights = [ops.pack_panels(w) for w in plain]
    kvs = [torch.ones(5000)]
    x, h = torch.randn(24, 64, generator=gen), torch.randn(24, 128, generator=gen)
    want = h @ plain[3].t()
    for rate, cap_lines in ((0.0, 0), (1.0, 1 << 62), (0.25, 10)):
        y = torch.full((24, 256), float("nan"))
        gemm_s, read_s, total = m.decode_layers(weights, kvs, x, h, y, rate, cap_lines)
        assert total == 5000  # ones: the reads saw every float once
        assert gemm_s > 0 and read_s > 0
        # Each product is written densely from y's start ([24, 64] for the last one, down: h . W^T).
        torch.testing.assert_close(y.view(-1)[:24 * 64].view(24, 64), want, rtol=1e-4, atol=1e-4)
