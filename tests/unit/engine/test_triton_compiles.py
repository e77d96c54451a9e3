"""The bf16 attention kernels, the fused element-wise kernels and the quantized weight GEMMs compile for
sm_90 (H100/H200) with the ptxas Triton ships, on a machine without a GPU (tests/unit/engine/sm90_compile.py).

Each variant is the one the engine launches for the Llama-3-8B shape in bf16: decode with and without
the split, prefill at its default launch, and each GEMM at each of `_w8a16_blocks`' tiles. The 8-bit
KV kernels have their own file (test_triton_kvq_compiles.py).
"""

from __future__ import annotations

import pytest

from tests.unit.engine.sm90_compile import assert_no_spills, run_script

pytestmark = pytest.mark.slow

SCRIPT = r"""
import json
from engine.attention.triton_kernels import (PREFILL_KEYS, PREFILL_WARPS, _decode_kernel, _decode_reduce_kernel,
                                            _prefill_kernel)
from engine.models.fused_ops import _add_rms_norm_kernel, _silu_mul_kernel
from engine.quant.triton_kernels import _quantize_rows_kernel, _scaled_gemm_kernel, _w4a16_kernel, _w8a16_blocks
from tests.unit.engine.sm90_compile import compile_sm90

H, KVH, D, HIDDEN = 32, 8, 128, 4096  # Llama-3-8B
out = {}
for split in (False, True):
    out[f"decode bf16 split={split}"] = compile_sm90(
        _decode_kernel, {"bt_ptr": "*i64", "lens_ptr": "*i64", "part_ptr": "*fp32", "ml_ptr": "*fp32"},
        {"G": H // KVH, "G_PAD": 16, "D": D, "D_PAD": D, "BS": 16, "PAGES": 4, "SPLIT": split, "PRECISION": "tf32"})
out["decode reduce"] = compile_sm90(_decode_reduce_kernel, {"part_ptr": "*fp32", "ml_ptr": "*fp32"},
                                    {"D": D, "D_PAD": D, "S_PAD": 16})
out["prefill bf16"] = compile_sm90(
    _prefill_kernel, {"meta_ptr": "*i32", "bt_ptr": "*i32", "seg_ptr": "*i32"},
    {"G": H // KVH, "D": D, "D_PAD": D, "BS": 16, "BLOCK_M": 64, "PAGES": PREFILL_KEYS // 16, "NSEG_PAD": 16,
     "PRECISION": "tf32"}, warps=PREFILL_WARPS)
for res in (False, True):
    out[f"add_rms_norm res={res}"] = compile_sm90(_add_rms_norm_kernel, {}, {"HAS_RES": res, "BLOCK": HIDDEN})
out["silu_mul"] = compile_sm90(_silu_mul_kernel, {}, {"BLOCK": 1024})
out["quantize_rows fp8"] = compile_sm90(_quantize_rows_kernel, {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
                                        {"FMAX": 448.0, "SMIN": 1e-12, "BLOCK_K": HIDDEN})
for rows in (16, 64, 128):
    bm, bn, bk, warps = _w8a16_blocks(rows)
    tiles = {"BLOCK_M": bm, "BLOCK_N": bn}
    for fmt, codes in (("int8", "*i8"), ("fp8", "*fp8e4nv")):
        out[f"w8a16 {fmt} m={rows}"] = compile_sm90(
            _scaled_gemm_kernel, {"w_ptr": codes, "xs_ptr": "*fp32", "ws_ptr": "*fp32", "b_ptr": "*fp32"},
            {"HAS_BIAS": False, "FP8_ROWS": False, "BLOCK_K": bk, "PRECISION": "tf32", **tiles}, warps=warps)
    out[f"w4a16 m={rows}"] = compile_sm90(
        _w4a16_kernel, {"w_ptr": "*u8", "s_ptr": "*fp16", "o_ptr": "*fp16", "b_ptr": "*fp16"},
        {"HAS_BIAS": False, "RUNS": 4, "PRECISION": "tf32", **tiles}, warps=warps)
    out[f"w8a8 fp8 m={rows}"] = compile_sm90(
        _scaled_gemm_kernel, {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
                              "b_ptr": "*fp32"},
        {"HAS_BIAS": False, "FP8_ROWS": True, "BLOCK_K": bk, "PRECISION": "tf32", **tiles}, warps=warps)
print(json.dumps(out))
"""


def test_bf16_attention_fused_ops_and_weight_gemms_compile_for_sm90():
    assert_no_spills(run_script(SCRIPT), 20)
