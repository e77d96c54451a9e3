"""The 8-bit KV kernels compile for sm_90 (H100/H200) with the ptxas Triton ships, on a machine without a GPU.

The interpreter the other kernel tests run is plain Python over numpy: it does not check what Triton's
compiler does (types carried through loops, fp8 conversions, dot operand types). This compiles each
kernel variant the engine launches for the 8B shape in bf16 and reads its registers and spills with
the cuobjdump beside ptxas (tests/unit/engine/sm90_compile.py).
"""

from __future__ import annotations

import pytest

from tests.unit.engine.sm90_compile import assert_no_spills, run_script

pytestmark = pytest.mark.slow

SCRIPT = r"""
import json
from engine.attention.triton_kvq import PREFILL_KEYS, PREFILL_WARPS, _qdecode_kernel, _qprefill_kernel
from engine.models.fused_ops import _rope_kv_kernel
from tests.unit.engine.sm90_compile import compile_sm90 as compile_

H, KVH, D = 32, 8, 128  # Llama-3-8B
CODES = {"int8": ("*i8", "*fp16"), "fp8": ("*fp8e4nv", "*fp32")}

out = {}
for fmt, (codes, scales) in CODES.items():
    ptrs = {"val_ptr": codes, "sc_ptr": scales, "bt_ptr": "*i64", "lens_ptr": "*i64", "part_ptr": "*fp32",
            "ml_ptr": "*fp32", "wslot_ptr": "*i64", "wlo_ptr": "*i64"}
    for w, split in ((0, False), (0, True), (16, False)):
        consts = {"G": H // KVH, "G_PAD": 16, "D": D, "D_PAD": D, "BS": 16, "PAGES": 2 if w else 4, "SPLIT": split,
                  "PER_ROW": fmt == "int8", "W": w, "PRECISION": "tf32"}
        out[f"decode {fmt} W={w} split={split}"] = compile_(_qdecode_kernel, ptrs, consts)
    ptrs = {"val_ptr": codes, "sc_ptr": scales, "meta_ptr": "*i32", "bt_ptr": "*i32", "seg_ptr": "*i32",
            "win_ptr": "*i32"}
    for w in (0, 16):
        consts = {"G": H // KVH, "D": D, "D_PAD": D, "BS": 16, "BLOCK_M": 64, "PAGES": PREFILL_KEYS // 16,
                  "NSEG_PAD": 16, "PER_ROW": fmt == "int8", "W": w, "PRECISION": "tf32"}
        out[f"prefill {fmt} W={w}"] = compile_(_qprefill_kernel, ptrs, consts, warps=PREFILL_WARPS)
for quant, (kv, sc) in enumerate((("*bf16", "*bf16"), CODES["int8"], CODES["fp8"])):
    for rotate in (False, True) if quant else (False,):  # fp8 rotates keys by default, int8 with hadamard
        consts = {"NQ": H, "NKV": KVH, "NH_PAD": 64, "NKV_PAD": 8, "D": D, "D_PAD": D, "HALF": D // 2,
                  "HALF_PAD": D // 2, "WRITE": True, "QUANT": quant, "ROTATE": rotate}
        ptrs = {"kv_ptr": kv, "sc_ptr": sc, "pos_ptr": "*i64", "slot_ptr": "*i64", "rot_ptr": "*fp32"}
        out[f"rope_kv QUANT={quant}" + " rotated" * rotate] = compile_(_rope_kv_kernel, ptrs, consts, {"s_kv": "i64"})
print(json.dumps(out))
"""


def test_8bit_kv_kernels_compile_for_sm90_without_spills():
    # NOTE: the windowed prefill (a second score tile) still spills a little; it compiles.
    assert_no_spills(run_script(SCRIPT), 15, may_spill=lambda name: "prefill" in name and "W=16" in name)
