"""One kernel source, two instruction sets: the modules built for AVX2 and for AVX-512 (engine/kernels/cpu_build.py)
pack the same compact panels, byte for byte, and compute the same panel GEMM results, bit for bit, in one process.

The AVX2 module is built and compared on every x86 host; the comparison with AVX-512 needs a host that has it and
skips, naming the instruction set, elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kernels import cpu_build
from engine.models import compact_weights as cw
from tests.unit.engine.test_compact_weights import BLOCK, bits, gguf_roundtrip

pytestmark = [pytest.mark.slow, pytest.mark.skipif(cpu_build.host_isa() == "baseline",
                                                     reason="this host has no AVX2: no SIMD kernel path to test")]
NEEDS_AVX512 = pytest.mark.skipif(cpu_build.host_isa() != "avx512",
                                  reason="this host lacks AVX-512: the avx512 kernel path is not run here")


@pytest.mark.parametrize(("isa", "lanes"), [pytest.param("avx512", 16, marks=NEEDS_AVX512), ("avx2", 8)])
def test_each_module_is_built_for_its_instruction_set(isa, lanes):
    ops = cpu_build.load_kernels(isa)
    assert ops.vector_lanes() == lanes
    assert ops.panel_gemm_available()


def test_a_module_above_the_host_is_refused(monkeypatch):
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "flags : fpu avx2 fma")
    with pytest.raises(ValueError, match="this CPU's best is 'avx2'"):
        cpu_build.load_kernels("avx512")


@NEEDS_AVX512
@pytest.mark.parametrize("kind", list(BLOCK))
@pytest.mark.parametrize(("n", "k"), [(100, 576), (7, 1536), (150, 128)])
def test_compact_panels_are_the_same_bytes_and_results_on_both(kind, n, k):
    wide, narrow = cpu_build.load_kernels("avx512"), cpu_build.load_kernels("avx2")
    rng = np.random.default_rng(n * k)
    w = gguf_roundtrip((rng.standard_normal((n, k)) * 0.05).astype(np.float32), kind)
    packed = {ops.vector_lanes(): cw.pack_compact(w, ops.pack_compact_panels, ops.compact_panels_match)
              for ops in (wide, narrow)}
    assert packed[16] is not None and torch.equal(packed[16], packed[8])
    # Each module rebuilds the other's packing bit for bit.
    assert wide.compact_panels_match(packed[8], w) and narrow.compact_panels_match(packed[16], w)
    assert torch.equal(bits(narrow.unpack_compact_panels(packed[16], n)), bits(w))
    ids = torch.tensor([0, n - 1, n // 2])
    assert torch.equal(bits(narrow.compact_rows(packed[16], ids, n)), bits(wide.compact_rows(packed[16], ids, n)))
    fp32 = narrow.pack_panels(w)
    assert torch.equal(fp32, wide.pack_panels(w))
    bias = torch.randn(n)
    # Rows straight from the codes on each (AVX-512 up to 12, AVX2 up to 3) and through a rebuilt panel.
    for rows in (1, 2, 3, 4, 5, 12, 13, 50):
        x = torch.randn(rows, k)
        for b in (None, bias):
            want = bits(wide.panel_linear(x, fp32, n, b))
            for ops in (wide, narrow):
                assert torch.equal(bits(ops.panel_linear(x, packed[16], n, b)), want), (ops.vector_lanes(), rows)
                assert torch.equal(bits(ops.panel_linear(x, fp32, n, b)), want), (ops.vector_lanes(), rows)


@NEEDS_AVX512
@pytest.mark.parametrize("rows", [1, 3, 6, 7, 12, 13, 64, 256])
def test_fp32_panels_compute_the_same_bits_on_both(rows):
    """Every output is one FMA chain over k in order on both, whatever the tile shapes (AVX-512 12 x 32, AVX2 6 x 16)."""
    wide, narrow = cpu_build.load_kernels("avx512"), cpu_build.load_kernels("avx2")
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 200, generator=g), torch.randn(77, 200, generator=g), torch.randn(77, generator=g)
    packed = narrow.pack_panels(w)
    for bias in (None, b):
        assert torch.equal(bits(narrow.panel_linear(x, packed, 77, bias)), bits(wide.panel_linear(x, packed, 77, bias)))


def test_the_scalar_baseline_module_packs_the_same_panels_and_computes_close():
    """The same sources on at::vec's scalar fallback (a CPU without AVX2): no fast path is claimed there
    (panel_gemm_available is false, the engine runs torch's ops), but the kernels build, pack the same compact
    bytes and compute within fp32 rounding (no FMA: products round on their own)."""
    base, narrow = cpu_build.load_kernels("baseline"), cpu_build.load_kernels("avx2")
    assert base.vector_lanes() == 8 and not base.panel_gemm_available()
    rng = np.random.default_rng(3)
    w = gguf_roundtrip((rng.standard_normal((70, 256)) * 0.05).astype(np.float32), "Q4_1")
    packed = cw.pack_compact(w, base.pack_compact_panels, base.compact_panels_match)
    assert packed is not None and torch.equal(packed, cw.pack_compact(w, narrow.pack_compact_panels,
                                                                      narrow.compact_panels_match))
    assert torch.equal(bits(base.unpack_compact_panels(packed, 70)), bits(w))
    x = torch.randn(5, 256)
    torch.testing.assert_close(base.panel_linear(x, packed, 70, None), narrow.panel_linear(x, packed, 70, None),
                               rtol=1e-5, atol=1e-5)
