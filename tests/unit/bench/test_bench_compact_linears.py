"""bench.kernels.compact_linears' passes: both arms on the same packed weights, and a clear stop where outputs differ."""

from __future__ import annotations

import numpy as np
import pytest

from engine.kernels import cpu_build
from engine.kernels.cpu_build import cpu_kernels
from engine.models import compact_weights as cw
from tests.unit.engine.test_compact_weights import gguf_roundtrip

# Slow tier (builds and runs the C++ kernels): `ops/dev.sh test --fast` leaves it out.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(cpu_build.host_isa() == "baseline", reason="this host lacks AVX2: the panel kernel needs AVX2 or AVX-512")]


def test_compare_times_both_arms_and_stops_where_their_outputs_differ():
    from bench.kernels import compact_linears

    ops = cpu_kernels()
    rng = np.random.default_rng(0)
    linears = []
    for n, k in ((576, 64), (96, 128)):
        w = gguf_roundtrip((rng.standard_normal((n, k)) * 0.05).astype(np.float32), "Q4_1")
        linears.append((cw.pack_compact(w, ops.pack_compact_panels, ops.compact_panels_match), k, n))
    result = compact_linears.compare(ops, ops, linears, rows=2, rounds=3)
    assert result["rows"] == 2 and len(result["this"]) == len(result["base"]) == 3
    assert all(t > 0 for t in result["this"] + result["base"])

    class Wrong:
        @staticmethod
        def panel_linear(x, packed, n, bias):
            return ops.panel_linear(x, packed, n, bias) + 1

    with pytest.raises(SystemExit, match="2 rows: the two kernels' outputs differ"):
        compact_linears.compare(ops, Wrong, linears, rows=2, rounds=1)
