"""bench.gpu_check's accounting, on the CPU: the bytes a decode step reads, and a speed run's rows."""

from __future__ import annotations

import math

import torch

from bench.gpu_check import TINY, bytes_read_per_decode_step, speed_suite, write_config_only
from engine import EngineConfig, EngineCore


def test_bytes_read_per_decode_step_counts_weights_but_not_an_untied_embedding():
    engine = EngineCore(EngineConfig(model=str(write_config_only(TINY)), dtype="float32", device="cpu",
                                     load_format="dummy", max_model_len=256))
    weights, kv = bytes_read_per_decode_step(engine, [10, 20])
    # Parameters by hand for TINY (hidden 128, intermediate 256, 2 layers, 4 heads of 32, 2 KV heads,
    # vocab 512): the LM head 512*128, per layer qkv 128*256 + o 128*128 + gate_up 128*512 + down 256*128
    # + two norms of 128, and the final norm; the embedding table (512*128) is gathered, not read.
    params = 512 * 128 + 2 * (128 * 256 + 128 * 128 + 128 * 512 + 256 * 128 + 2 * 128) + 128
    assert weights == params * 4
    # K and V of 2 layers x 2 KV heads x 32 dims in fp32, for 30 rows.
    assert kv == 30 * 2 * 2 * 2 * 32 * 4


def test_speed_suite_reports_every_mode_against_the_roofline():
    bandwidth = 20e9
    result = speed_suite("tiny", write_config_only(TINY), torch.device("cpu"), "float32", True, 64, 3, (4, 1),
                         bandwidth)
    runs = result["runs"]
    assert [(r["batch"], r["mode"]) for r in runs] == [(4, "eager+pipelined"), (1, "eager+pipelined")]
    for r in runs:
        assert r["step_ms"] > 0 and r["decode_tok_s"] == r["batch"] / (r["step_ms"] / 1e3)
        assert math.isclose(r["roofline_step_ms"], (r["weight_bytes"] + r["kv_bytes"]) / bandwidth * 1e3)
        assert math.isclose(r["share_of_roofline"], r["roofline_step_ms"] / r["step_ms"])
        assert r["device_idle_ms_per_step"] is None  # measured with CUDA events only
    # Each sequence's KV at the middle of the timed steps: a 64-token prompt, 3 warm-up steps, then 3 more.
    per_row = 2 * 2 * 2 * 32 * 4
    assert runs[0]["kv_bytes"] > 4 * 64 * per_row


def _run(batch, mode, step_ms, roof_ms):
    return {"batch": batch, "mode": mode, "step_ms": step_ms, "roofline_step_ms": roof_ms,
            "share_of_roofline": roof_ms / step_ms}


def test_targets_fusion_ratios_and_merged_runs():
    import argparse

    import pytest

    from bench.gpu_check import fusion_lines, merge_reports, section_list, target_lines

    fused = {"runs": [_run(64, "graphs+pipelined", 8.0, 5.8), _run(1, "graphs+pipelined", 5.0, 3.6)]}
    plain = {"runs": [_run(64, "graphs+pipelined", 10.0, 5.8), _run(1, "graphs, synchronous", 6.0, 3.6)]}
    a = {"device": "H", "seconds": 10, "kernels": {"ok": True}, "llama3_8b_shaped": fused}
    b = {"device": "H", "seconds": 5, "llama3_8b_unfused": plain, "date": "later"}
    merged = merge_reports([a, b])
    assert merged["seconds"] == 15 and merged["llama3_8b_unfused"] is plain and "date" not in merged
    assert target_lines(merged) == [
        "target: decode at batch 64 >= 70% of the HBM roofline: 72.5% (met)",
        "target: single-stream step within 1.5x of the roofline: 1.39x (met)"]
    # Only the modes both decoders ran are compared.
    assert fusion_lines(merged) == ["batch 64, graphs+pipelined: 10.00 ms unfused -> 8.00 ms fused (1.25x)"]
    with pytest.raises(SystemExit):
        merge_reports([a, {**b, "device": "other"}])
    assert section_list("kernels, smollm2_speed") == ["kernels", "smollm2_speed"]
    with pytest.raises(argparse.ArgumentTypeError):
        section_list("kernels,warp_drive")
