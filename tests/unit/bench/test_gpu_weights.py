"""bench.gpu_weights on the CPU: the bytes a quantized decode step reads, the speed-up arithmetic and
targets, and a dry run of one engine row per format."""

from __future__ import annotations

import math

import pytest
import torch

from bench.gpu_check import TINY, write_config_only
from bench.gpu_weights import FORMATS, decode_weight_bytes, engine_rows, roofline, speedups, target_lines
from engine import EngineConfig, EngineCore

# TINY's linears (hidden 128, intermediate 256, 2 layers, 4 heads of 32, 2 KV heads): per layer
# qkv 256x128, o 128x128, gate_up 512x128, down 128x256; the LM head 512x128.
LAYER_OUTPUTS, LAYER_WEIGHTS = 256 + 128 + 512 + 128, 128 * 256 + 128 * 128 + 128 * 512 + 256 * 128
NORMS = 2 * 2 * 128 + 128


def _engine(**options) -> EngineCore:
    return EngineCore(EngineConfig(model=str(write_config_only(TINY)), dtype="float32", device="cpu",
                                   load_format="dummy", max_model_len=256, **options))


@pytest.mark.slow
def test_decode_weight_bytes_count_codes_and_scales_not_a_bf16_size():
    head = 512 * 128
    assert decode_weight_bytes(_engine()) == (2 * LAYER_WEIGHTS + head + NORMS) * 4
    # fp8: one byte a weight and an fp32 scale per output channel; the LM head stays fp32.
    fp8 = _engine(weight_bits=8, weight_format="fp8")
    assert decode_weight_bytes(fp8) == 2 * (LAYER_WEIGHTS + LAYER_OUTPUTS * 4) + head * 4 + NORMS * 4
    # int8 (in place, as for benchmarks): the LM head too.
    int8 = _engine(weight_bits=8, weight_format="int8")
    assert decode_weight_bytes(int8) == 2 * (LAYER_WEIGHTS + LAYER_OUTPUTS * 4) + head + 512 * 4 + NORMS * 4


def test_speedups_and_targets():
    def engine(fmt, tok_s):
        return {"model": "m", "format": fmt, "runs": [{"batch": 64, "decode_tok_s": tok_s[0]},
                                                     {"batch": 1, "decode_tok_s": tok_s[1]}]}

    rows = speedups([engine("bf16", (1000, 50)), engine("fp8", (1400, 70)), engine("int8", (900, 74)),
                     {"model": "m", "format": "int4", "error": "boom"}])
    assert [(r["format"], r["batch"], round(r["x_bf16"], 2)) for r in rows] == [
        ("fp8", 64, 1.4), ("fp8", 1, 1.4), ("int8", 64, 0.9), ("int8", 1, 1.48)]
    assert target_lines(rows, "m") == ["target: fp8 decode at batch 64 >= 1.3x bf16: 1.40x (met)",
                                       "target: fp8 decode at batch 1 >= 1.6x bf16: 1.40x (missed)",
                                       "target: int8 decode at batch 1 >= 1.5x bf16: 1.48x (missed)"]
    assert math.isclose(roofline(0.002, 3_000_000, 1_000_000, 4e9)["share_of_roofline"], 0.5)


@pytest.mark.slow
def test_engine_rows_dry_run_every_format():
    path = write_config_only(TINY)
    for fmt in FORMATS:
        row = engine_rows("tiny", path, torch.device("cpu"), "float32", True, fmt, 32, 2, (2, 1), 20e9)
        assert row["format"] == fmt and [r["batch"] for r in row["runs"]] == [2, 1]
        assert row["linear"] == {"bf16": "Linear", "int8": "Int8Linear", "int4": "Int4Linear"}.get(fmt, "Fp8Linear")
        assert row["w8a8_share"] == {"bf16": None, "int8": None, "int4": None, "fp8-w8a16": 0.0}.get(fmt, 1.0)
        for r in row["runs"]:
            assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 and r["kv_bytes"] > 0
            assert math.isclose(r["share_of_roofline"],
                                (row["decode_weight_bytes"] + r["kv_bytes"]) / 20e9 / (r["step_ms"] / 1e3))
