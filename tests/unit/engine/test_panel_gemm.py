"""The panel GEMM kernel (engine/models/csrc/panel_gemm.cpp) that packed weights run at 1-256 rows.

Results equal a float64 reference within fp32 rounding for any row count, odd widths and the
bias; a row's result is bitwise the same whatever the rows beside it; bad input gets a clear
error; and `linear` takes the kernel exactly where it should.
"""

from __future__ import annotations

import pytest
import torch

from engine import hugepages
from engine.kernels.cpu_build import cpu_kernels
from engine.models import linear as lin

# Slow tier (builds and runs the C++ kernels): `ops/dev.sh test --fast` leaves it out.
# Every test runs on the AVX2 and the AVX-512 kernel module (tests/conftest.py's kernel_isa).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("kernel_isa")]


def reference(x, w, b=None):
    y = x.double() @ w.double().T
    return (y if b is None else y + b.double()).float()


@pytest.mark.parametrize("rows", [1, 2, 7, 12, 13, 25, 50, 64, 97, 255, 256])
@pytest.mark.parametrize(("out_features", "in_features"), [(32, 16), (100, 70), (576, 576), (33, 1)])
def test_matches_the_float64_reference(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x, w = torch.randn(rows, in_features, generator=g), torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    packed = cpu_kernels().pack_panels(w)
    assert packed.shape == (-(-out_features // 32), in_features, 32)
    for bias in (None, b):
        got = cpu_kernels().panel_linear(x, packed, out_features, bias)
        assert got.shape == (rows, out_features) and got.dtype == torch.float32
        torch.testing.assert_close(got, reference(x, w, bias), rtol=1e-5, atol=1e-4 * in_features ** 0.5)


def test_rows_are_independent_of_the_batch():
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(200, 96, generator=g), torch.randn(75, 96, generator=g), torch.randn(75, generator=g)
    packed = cpu_kernels().pack_panels(w)
    full = cpu_kernels().panel_linear(x, packed, 75, b)
    for start, stop in [(0, 1), (5, 17), (40, 90), (199, 200), (0, 199)]:
        assert torch.equal(cpu_kernels().panel_linear(x[start:stop], packed, 75, b), full[start:stop])


def test_calls_of_few_rows_prefetch_page_heads_and_compute_the_same_bits():
    # Calls of few rows (fewer than 8 on AMD CPUs, single rows elsewhere: page_head_rows) take the tile that
    # prefetches 4 KiB page heads instead of the next panel, the others spread the next panel; the panels here
    # span many pages (in_features 1536: 192 KiB each), in torch's pages and, where the host has them, in huge
    # pages. Only where lines go to L2 changes: each row's result is the 16-row call's, bit for bit.
    g = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(16, 1536, generator=g), torch.randn(130, 1536, generator=g), torch.randn(130, generator=g)
    packed = cpu_kernels().pack_panels(w)
    copies = [packed]
    if hugepages.available():
        (huge,) = hugepages.zeros([(packed.shape, packed.dtype)])
        copies.append(huge.copy_(packed))
    full = cpu_kernels().panel_linear(x, packed, 130, b)
    torch.testing.assert_close(full, reference(x, w, b), rtol=1e-5, atol=1e-4 * 1536 ** 0.5)
    for copy in copies:
        for rows in range(1, 10):
            assert torch.equal(cpu_kernels().panel_linear(x[16 - rows:], copy, 130, b), full[16 - rows:]), rows


def test_non_contiguous_input_and_zero_rows():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 24, generator=g)
    packed = cpu_kernels().pack_panels(w)
    wide = torch.randn(9, 48, generator=g)
    x = wide[:, ::2]  # strided view
    torch.testing.assert_close(cpu_kernels().panel_linear(x, packed, 40, None), reference(x, w))
    assert cpu_kernels().panel_linear(torch.empty(0, 24), packed, 40, None).shape == (0, 40)
    # Row-strided views (the gate half of a gate_up output) are read in place: the same bits as a copy.
    for cols in (wide[:, :24], wide[:, 24:], wide[3:4, 5:29]):
        assert torch.equal(cpu_kernels().panel_linear(cols, packed, 40, None),
                           cpu_kernels().panel_linear(cols.contiguous(), packed, 40, None))


def test_bad_input_gets_a_clear_error():
    w = torch.randn(40, 24)
    packed = cpu_kernels().pack_panels(w)
    with pytest.raises(RuntimeError, match="features"):
        cpu_kernels().panel_linear(torch.randn(3, 25), packed, 40, None)
    with pytest.raises(RuntimeError, match="does not match the packing"):
        cpu_kernels().panel_linear(torch.randn(3, 24), packed, 80, None)
    with pytest.raises(RuntimeError, match="pack_panels"):
        cpu_kernels().panel_linear(torch.randn(3, 24), w, 40, None)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_kernels().panel_linear(torch.randn(3, 24), packed, 40, torch.randn(39))
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_kernels().pack_panels(w.double())


@pytest.mark.parametrize("rows", [1, 8, 9, 100, 256, 257])
def test_linear_uses_the_kernel_for_packed_weights_up_to_256_rows(rows, monkeypatch):
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 64, generator=g), torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    packed = lin.prepack(w)
    assert lin.is_panel_packed(packed)
    calls = []
    ops = cpu_kernels()
    real = ops.panel_linear
    monkeypatch.setattr(ops, "panel_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with torch.no_grad():
        got = lin.linear(x, w, b, packed=packed)
        out = torch.empty(rows, 48)
        into = lin.linear(x, w, b, out=out, packed=packed)
    torch.testing.assert_close(got, reference(x, w, b), rtol=1e-5, atol=1e-4)
    assert into is out and torch.equal(out, got)
    assert calls == ([rows, rows] if rows <= lin.PANEL_MAX_ROWS else [])
