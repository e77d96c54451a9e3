"""Registers and local memory of our Triton GPU kernels, compiled for a GPU target on a machine without one.

    python -m bench.kernel_resources                 # sm_90 (H100/H200), the shapes of Llama-3-8B and SmolLM2,
                                                     # and the decode kernel by blocks per iteration and warps
    python -m bench.kernel_resources --arch 80       # another compute capability

Triton compiles to a cubin with the ptxas it ships, and `cuobjdump --dump-resource-usage`
(shipped beside it) reads each kernel's registers, local memory (spills land there) and
shared memory. No device time is needed to see whether a tile is too large for the
register file. The numbers come from this machine's Triton, which can differ from the
device's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SHAPES = {  # (heads, KV heads, head dim, hidden, intermediate)
    "llama3-8b": (32, 8, 128, 4096, 14336),
    "smollm2": (9, 3, 64, 576, 1536),
}


def _p2(n: int) -> int:
    return triton.next_power_of_2(n)


def kernels(h: int, kvh: int, d: int, hidden: int, inter: int) -> dict[str, tuple]:
    """(jit function, signature, constexprs) of each kernel as the engine launches it in bf16."""
    # Imported here, not at the top: importing decorates the kernels, and a process that runs them under
    # TRITON_INTERPRET=1 (the CPU tests) must set that first.
    from engine.attention.triton_kernels import _decode_kernel
    from engine.models.fused_ops import _add_rms_norm_kernel, _rope_kv_kernel, _silu_mul_kernel

    ptr, i32, i64, f32, c = "*bf16", "i32", "i64", "fp32", "constexpr"
    g = h // kvh
    rope = ({"qkv_ptr": ptr, "pos_ptr": "*i64", "cos_ptr": ptr, "sin_ptr": ptr, "kv_ptr": ptr, "slot_ptr": "*i64",
             "s_row": i32, "s_cos": i32, "s_kv": i64, "s_slot": i32, **dict.fromkeys(
                 ["NQ", "NKV", "NH_PAD", "NKV_PAD", "D", "D_PAD", "HALF", "HALF_PAD", "WRITE"], c)},
            {"NQ": h, "NKV": kvh, "NH_PAD": _p2(h + kvh), "NKV_PAD": _p2(kvh), "D": d, "D_PAD": _p2(d), "HALF": d // 2,
             "HALF_PAD": _p2(d // 2), "WRITE": True})
    decode_sig = {"q_ptr": ptr, "kv_ptr": ptr, "bt_ptr": "*i64", "lens_ptr": "*i64", "out_ptr": ptr,
                  "part_ptr": "*fp32", "ml_ptr": "*fp32", "scale": f32, "blocks_per_split": i32,
                  **dict.fromkeys(["s_qb", "s_qh", "s_kv", "s_blk", "s_tok", "s_head", "s_bt", "s_ob", "s_oh"], i32),
                  **dict.fromkeys(["G", "G_PAD", "D", "D_PAD", "BS", "PAGES", "SPLIT", "PRECISION"], c)}
    decode_consts = {"G": g, "G_PAD": max(16, _p2(g)), "D": d, "D_PAD": max(16, _p2(d)), "BS": 16, "PAGES": 4,
                     "PRECISION": "tf32"}
    norm = ({"x_ptr": ptr, "res_ptr": ptr, "w_ptr": ptr, "out_ptr": ptr, "res_out_ptr": ptr, "n_cols": i32,
             "eps": f32, "HAS_RES": c, "BLOCK": c}, {"HAS_RES": True, "BLOCK": _p2(hidden)})
    silu = ({"gu_ptr": ptr, "out_ptr": ptr, "n_cols": i32, "BLOCK": c}, {"BLOCK": min(1024, _p2(inter))})
    return {
        "rope_kv": (_rope_kv_kernel, *rope),
        "decode": (_decode_kernel, decode_sig, {**decode_consts, "SPLIT": False}),
        "decode (split)": (_decode_kernel, decode_sig, {**decode_consts, "SPLIT": True}),
        "add_rms_norm": (_add_rms_norm_kernel, *norm),
        "silu_mul": (_silu_mul_kernel, *silu),
    }


def resource_usage(fn, signature: dict, constexprs: dict, arch: int, num_warps: int = 4) -> dict:
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's current default, stated (else it warns)
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource line for {fn.__name__}:\n{text}")
    regs, stack, shared, local = map(int, found.groups())
    return {"registers": regs, "stack": stack, "shared": shared, "local": local}


def decode_launches(arch: int, model: str = "llama3-8b") -> dict[str, dict]:
    """The decode kernel's resources by blocks per iteration (PAGES) and warps, for one model's shape."""
    fn, sig, consts = kernels(*SHAPES[model])["decode"]
    return {f"pages={pages} warps={warps}": resource_usage(fn, sig, {**consts, "PAGES": pages}, arch, warps)
            for pages in (1, 2, 4, 8) for warps in (4, 8)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200 (default 90)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("TRITON_INTERPRET=1 is set: the kernels would be interpreted, not compiled; unset it")
    usage = {model: {name: resource_usage(fn, sig, consts, args.arch) for name, (fn, sig, consts) in kernels(*shape).items()}
             for model, shape in SHAPES.items()}
    launches = decode_launches(args.arch)
    if args.json:
        print(json.dumps({"kernels": usage, "decode_launches_llama3_8b": launches}))
        return
    print(f"triton {triton.__version__}, sm_{args.arch}; local or stack > 0 means spills")
    print(f"{'model':10} {'kernel (4 warps)':17} {'registers':>9} {'local':>6} {'stack':>6} {'shared':>7}")
    for model, rows in usage.items():
        for name, r in rows.items():
            print(f"{model:10} {name:17} {r['registers']:9d} {r['local']:6d} {r['stack']:6d} {r['shared']:7d}")
    print("llama3-8b decode kernel by launch (warps an SM holds, about: whole programs of 65536 registers, 64 at most):")
    for name, r in launches.items():
        warps = int(name.rsplit("=", 1)[1])
        per_sm = min(65536 // (r["registers"] * 32 * warps), 64 // warps) * warps
        print(f"  {name:17} {r['registers']:9d} registers, stack {r['stack']:5d}, {per_sm:2d} warps per SM")


if __name__ == "__main__":
    main()
