"""Compile a Triton kernel for sm_90 (H100/H200) on a machine without a GPU, and read its resources.

Triton's compiler and the ptxas it ships run without a device; cuobjdump beside them reports each
cubin's registers per thread and spills. The interpreter the other kernel tests use is plain Python
over numpy, so it cannot catch what only the compiler checks (types carried through loops, fp8
conversions, dot operand types, register pressure). A process that interprets kernels cannot also
compile them, so callers run their compile scripts through `run_script` in a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile


def compile_sm90(fn, ptrs: dict, consts: dict, scalars: dict | None = None, warps: int = 4) -> dict:
    """{"registers", "stack", "local"} of `fn` compiled for sm_90: pointer arguments typed by `ptrs`
    (bf16 when absent), `consts` its constexprs, other arguments i32 unless `scalars` says otherwise
    ("scale" and "eps" are fp32)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ptrs.get(name, "*bf16")
        else:
            sig[name] = (scalars or {}).get(name, "fp32" if name in ("scale", "eps") else "i32")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    regs, stack, _, local = map(int, re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text).groups())
    return {"registers": regs, "stack": stack, "local": local}


def run_script(script: str) -> dict:
    """Run `script` (which prints one JSON object last) in a fresh interpreter without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_no_spills(usage: dict, expected: int, may_spill=lambda name: False) -> None:
    """Each compiled variant fits in 255 registers and, unless `may_spill(name)`, keeps no stack."""
    assert len(usage) == expected, sorted(usage)
    for name, r in usage.items():
        print(name, r)
    for name, r in usage.items():
        assert 0 < r["registers"] <= 255, name
        if not may_spill(name):
            assert r["local"] == 0 and r["stack"] == 0, f"{name} spills: {r}"
