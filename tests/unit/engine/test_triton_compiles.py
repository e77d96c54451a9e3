"""The bf16 attention kernels, the fused element-wise kernels and the quantized weight GEMMs compile for
sm_90 (H100/H200) with the ptxas Triton ships, on a machine without a GPU (tests/unit/engine/sm90_compile.py).

Each launch is the one the engine's wrapper makes for the Llama-3-8B shape in bf16 at a 4k context,
recorded from the wrapper itself and specialised on its arguments as Triton's JIT does on a device:
decode at batch 64 and split at batch 1, a prefill chunk after a cached prefix, each GEMM at each of
`_w8a16_blocks`' tiles, and the weight-only GEMMs with K split at batch 1. The 8-bit KV kernels have their own file (test_triton_kvq_compiles.py).
"""

from __future__ import annotations

import pytest

from tests.unit.engine.sm90_compile import assert_no_spills, run_script

pytestmark = pytest.mark.slow

SCRIPT = r"""
import json

import torch

from engine.attention.metadata import MaskSpec, PrefillSpan
from engine.attention.triton_kernels import paged_decode, paged_prefill
from engine.models.fused_ops import add_rms_norm, silu_mul
from engine.quant.triton_kernels import quantize_rows_fp8, w4a16_linear, w8a8_fp8_linear, w8a16_linear
from tests.unit.engine.sm90_compile import compile_step, divisible_args, record_launches

H, KVH, D, HIDDEN, BS, CTX = 32, 8, 128, 4096, 16, 4096  # Llama-3-8B, 4k context
BF = torch.bfloat16
kv = torch.zeros(2, 64 * CTX // BS, BS, KVH, D, dtype=BF)
tables = torch.arange(64 * CTX // BS).view(64, -1)  # int64, as AttentionMetadata's decode_block_tables
lens = torch.full((64,), CTX)
out = {}


def add(name, step, sass=False):
    for kernel, usage in compile_step(step, sass).items():
        out[f"{name}: {kernel}"] = usage


def decode():
    paged_decode(torch.zeros(64, H, D, dtype=BF), kv, tables, lens, 0.1)


add("decode batch 64", decode, sass=True)
add("decode batch 64 rows=16", lambda: paged_decode(torch.zeros(64, H, D, dtype=BF), kv, tables, lens, 0.1,
                                                   group_rows=16), sass=True)
# An H100's 132 multiprocessors split one sequence's 4k context 32 ways (decode_splits); the CPU has none.
add("decode batch 1 split", lambda: paged_decode(torch.zeros(1, H, D, dtype=BF), kv, tables[:1], lens[:1], 0.1,
                                                  splits=32))
span = PrefillSpan(0, 512, 1024, tables[0, :96], MaskSpec(), block_ids=tables[0, :96].tolist())
# A GPU launch takes 64-row query tiles (prefill_launch); the CPU's default is 16.
add("prefill", lambda: paged_prefill(torch.zeros(512, H, D, dtype=BF), kv, [span], 0.1, block_m=64))
x = torch.zeros(64, HIDDEN, dtype=BF)
add("add_rms_norm", lambda: add_rms_norm(x, torch.ones(HIDDEN, dtype=BF), 1e-5))
add("add_rms_norm residual", lambda: add_rms_norm(x, torch.ones(HIDDEN, dtype=BF), 1e-5, x))
add("silu_mul", lambda: silu_mul(torch.zeros(64, 2 * 14336, dtype=BF)))
add("quantize_rows fp8", lambda: quantize_rows_fp8(x))
N = (H + 2 * KVH) * D  # the qkv projection
scales = torch.ones(N)
for rows in (16, 64, 128):  # the three tiles of _w8a16_blocks
    x = torch.zeros(rows, HIDDEN, dtype=BF)
    for fmt, dtype in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
        add(f"w8a16 {fmt} m={rows}", lambda: w8a16_linear(x, torch.zeros(N, HIDDEN, dtype=dtype), scales))
    add(f"w4a16 m={rows}", lambda: w4a16_linear(x, torch.zeros(N, HIDDEN // 2, dtype=torch.uint8),
                                                torch.ones(N, HIDDEN // 128, dtype=torch.float16),
                                                torch.zeros(N, HIDDEN // 128, dtype=torch.float16)))
    xq, xs = torch.zeros(rows, HIDDEN, dtype=torch.float8_e4m3fn), torch.ones(rows, 1)
    add(f"w8a8 fp8 m={rows}", lambda: w8a8_fp8_linear(xq, xs, torch.zeros(N, HIDDEN, dtype=torch.float8_e4m3fn),
                                                      scales))
# Batch 1 on an H100 splits the qkv projection's K in 3 (k_splits; the CPU counts 4 multiprocessors, and
# 96 tiles fill them): each kernel's split variant and the reduce kernel that sums the partials.
x = torch.zeros(1, HIDDEN, dtype=BF)
add("w8a16 int8 m=1 split", lambda: w8a16_linear(x, torch.zeros(N, HIDDEN, dtype=torch.int8), scales, splits=3))
add("w4a16 m=1 split", lambda: w4a16_linear(x, torch.zeros(N, HIDDEN // 2, dtype=torch.uint8),
                                            torch.ones(N, HIDDEN // 128, dtype=torch.float16),
                                            torch.zeros(N, HIDDEN // 128, dtype=torch.float16), splits=3))
(launch,) = record_launches(decode)
from engine.attention.triton_kernels import _dot_takes_small_rows

print(json.dumps({"usage": out, "decode_divisible": sorted(divisible_args(launch)),
                  "small_rows": _dot_takes_small_rows()}))
"""


def test_bf16_attention_fused_ops_and_weight_gemms_compile_for_sm90():
    got = run_script(SCRIPT)
    assert_no_spills(got["usage"], 25)
    # The 4-head query group in its own 4 rows (group_rows): the same tensor-core products as padded to 16
    # (tl.dot pads to the MMA shape itself), less softmax arithmetic, less staged in shared memory. Before
    # Triton 3.5 the group takes 16 rows, the one launch.
    own, padded = (got["usage"][f"decode batch 64{rows}: _decode_kernel"] for rows in ("", " rows=16"))
    assert own["ops"]["HMMA"] == padded["ops"]["HMMA"] > 0, (own, padded)
    if not got["small_rows"]:
        assert own == padded
        return
    assert own["ops"]["FMUL"] < padded["ops"]["FMUL"] and own["ops"]["MUFU"] < padded["ops"]["MUFU"], (own, padded)
    assert own["shared"] < padded["shared"], (own, padded)
    # The compile is specialised as a device launch is: the cache's pointer and strides are marked
    # divisible by 16 (so K/V rows load as vectors); the sequence lengths, a scalar per program, too.
    assert {"kv_ptr", "q_ptr", "s_blk", "s_tok", "s_head", "s_kv", "lens_ptr"} <= set(got["decode_divisible"])
    assert "scale" not in got["decode_divisible"]
