"""bench.overlap: its probe really streams the buffer, and its bounds' arithmetic on hand-made numbers."""

from __future__ import annotations

import math

import pytest
import torch

from bench.overlap import arm_medians, decode_bounds, factor_at, overlap_factors, probe
from bench.roofline import FlopModel

# Slow tier (builds and runs the C++ kernels): `ops/dev.sh test --fast` leaves it out.
pytestmark = pytest.mark.slow

ROWS = overlap_factors({
    1: {"stream": 4.0, "compute": 2.0, "both": 5.0},  # compute/stream 0.5, 1.25 over the longer
    2: {"stream": 4.0, "compute": 4.0, "both": 6.0},  # 1.0 -> 1.5
    4: {"stream": 4.0, "compute": 8.0, "both": 8.0},  # 2.0 -> 1.0
})


def test_overlap_factors_divide_the_interleaved_time_by_the_longer_arm_and_by_the_sum():
    assert [r["compute_over_stream"] for r in ROWS] == [0.5, 1.0, 2.0]
    assert [r["over_max"] for r in ROWS] == [1.25, 1.5, 1.0]
    assert [r["over_sum"] for r in ROWS] == [5 / 6, 6 / 8, 8 / 12]


def test_factor_at_interpolates_between_intensities_and_holds_the_ends():
    assert factor_at(ROWS, 0.75) == pytest.approx(1.375)
    assert factor_at(ROWS, 1.5) == pytest.approx(1.25)
    assert factor_at(ROWS, 1.0) == pytest.approx(1.5)
    assert factor_at(ROWS, 0.1) == 1.25
    assert factor_at(ROWS, 9.0) == 1.0


def test_arm_medians_take_each_arm_at_its_best_prefetch_plan():
    got = arm_medians({"compute": [3.0, 1.0, 2.0], "stream@0:1024": [5.0, 6.0, 7.0], "stream@1:16384": [4.0, 9.0, 4.5],
                       "both@0:1024": [8.0, 8.0, 8.0], "both@2:65536": [9.0, 9.0, 9.0]})
    assert got == {"compute": 2.0, "stream": 4.5, "both": 8.0}


def test_decode_bounds_take_each_step_overlapped_or_in_turns_whichever_is_shorter():
    # Units chosen so that FLOPs / peak and bytes / bandwidth come out in whole seconds: peak 1 GFLOP/s, 1 GB/s.
    g = 10**9
    run = {
        "machine": {"date": "d"},
        "machine_rates": {"peak_gflops": 1.0, "read_gbps": 1.0},
        "engine": {"steps": [
            [9.0, 100, 4, 0],   # a step with prefill: not a decode-only step, left out
            [7.0, 0, 40, 2],    # decode at batch 40: GEMMs 4 s, attention 2 s; weights 2 s, KV 2 s
            [5.0, 0, 8, 4],     # decode at batch 8: GEMMs 0.8 s, attention 4 s; weights 2 s, KV 4 s
            [1.0, 0, 0, 0],     # an empty step: left out
        ]},
        "roofline": {"decode_min_batch": 32, "weight_bytes": 2 * g, "decode_share": 0.4,
                     "decode_share_bound_serial": 0.6, "roofline_s": 20.0, "roofline_share": 0.5,
                     "roofline_share_bound_serial": 0.7},
    }
    # per row: linear 0.09 GFLOP + LM head 0.01 GFLOP; attention 1 GFLOP and 1 GB of KV per context row
    bounds = decode_bounds(run, ROWS, FlopModel(linear_per_token=9 * 10**7, lm_head_per_row=10**7,
                                                attention_per_context=g), kv_token_bytes=g)
    # Batch 40: c = 6 s, m = 4 s, ratio 1.5 -> factor 1.25 -> 7.5 s overlapped; in turns max(4, 2) + max(2, 2) = 6 s.
    # Batch 8: c = 4.8 s, m = 6 s, ratio 0.8 -> factor 1.4 -> 8.4 s; in turns max(0.8, 2) + max(4, 4) = 6 s.
    assert bounds["decode_share_bound_overlap"] == pytest.approx(6 / 6)
    assert bounds["roofline_share_bound_overlap"] == pytest.approx(20 / (20 + (6 - 6) + (6 - 4.8)))
    assert bounds["decode_share"] == 0.4 and bounds["roofline_share_bound_serial"] == 0.7


def test_decode_bounds_use_the_overlap_where_it_beats_taking_turns():
    g = 10**9
    run = {"machine": {"date": "d"}, "machine_rates": {"peak_gflops": 1.0, "read_gbps": 1.0},
           "engine": {"steps": [[7.0, 0, 40, 2]]},
           "roofline": {"decode_min_batch": 32, "weight_bytes": 2 * g, "decode_share": 0.4,
                        "decode_share_bound_serial": 0.6, "roofline_s": 6.0, "roofline_share": 0.5,
                        "roofline_share_bound_serial": 0.7}}
    kw = {"kv_token_bytes": g,
          "flops": FlopModel(linear_per_token=9 * 10**7, lm_head_per_row=10**7, attention_per_context=g // 4)}
    # GEMMs 4 s against 2 s of weights, attention 0.5 s against 2 s of KV: c = 4.5 s, m = 4 s, in turns 4 + 2 = 6 s.
    perfect = overlap_factors({1: {"stream": 1.0, "compute": 1.0, "both": 1.0}})  # a core that overlaps fully
    assert decode_bounds(run, perfect, **kw)["decode_share_bound_overlap"] == pytest.approx(4.5 / 4.5)
    slower = overlap_factors({1: {"stream": 1.0, "compute": 1.0, "both": 1.2}})  # 1.2 * 4.5 s = 5.4 s
    assert decode_bounds(run, slower, **kw)["decode_share_bound_overlap"] == pytest.approx(4.5 / 5.4)
    poor = overlap_factors({1: {"stream": 1.0, "compute": 1.0, "both": 1.5}})  # 6.75 s: taking turns is better
    bounds = decode_bounds(run, poor, **kw)
    assert bounds["decode_share_bound_overlap"] == pytest.approx(4.5 / 6)
    assert bounds["roofline_share_bound_overlap"] == pytest.approx(6 / (6 + 6 - 4.5))


@pytest.mark.parametrize("mode", [1, 3])
def test_the_probe_reads_every_float_of_its_buffer(mode):
    buf = torch.ones(1 << 16)
    threads = 2
    seconds, total = probe(buf, 2, 1, mode, threads, hint=1, prefetch_bytes=4096)
    assert math.isfinite(seconds) and seconds > 0
    assert total == 2 * buf.numel()  # two passes over every float of the buffer, split between the threads


def test_the_probe_reads_nothing_when_it_only_computes_and_refuses_bad_arguments():
    buf = torch.ones(1 << 12)
    _, total = probe(buf, 1, 2, 2, 1)
    assert total == 0
    with pytest.raises(RuntimeError, match="bad probe arguments"):
        probe(buf, 1, 2, 4, 1)
    with pytest.raises(RuntimeError, match="too small"):
        probe(torch.ones(16), 1, 1, 1, 1)
