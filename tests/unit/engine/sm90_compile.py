"""Compile the Triton launches the engine makes for sm_90 (H100/H200) on a machine without a GPU, and read
each kernel's resources.

`record_launches` runs the engine's own launch wrappers on CPU tensors of the model's shape and keeps
each Triton launch instead of running it; `compile_sm90` compiles a kept launch the way Triton's JIT
would on an H100: the same argument types and constexprs, and the same specialisation on the argument
values (16-byte aligned pointers and strides divisible by 16 are marked so, which lets the compiler
vectorise loads; without it a [64, 128] bf16 tile is read one element and one 64-bit address at a
time, and the register counts read here were twice the launched kernel's). Triton's compiler and the
ptxas it ships run without a device; cuobjdump beside them reports each cubin's registers per thread
and spills. The interpreter the other kernel tests use is plain Python over numpy, so it cannot catch
what only the compiler checks (types carried through loops, fp8 conversions, dot operand types,
register pressure). A process that interprets kernels cannot also compile them, so callers run their
compile scripts through `run_script` in a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from unittest import mock


@dataclass
class Launch:
    """One Triton launch as the wrapper made it: the kernel and its arguments, grid aside."""

    kernel: object  # triton.runtime.jit.JITFunction
    args: tuple
    kwargs: dict

    @property
    def name(self) -> str:
        return self.kernel.__name__


def record_launches(step) -> list[Launch]:
    """Call `step()` with every Triton kernel launch kept, in order, instead of run (outputs stay unwritten)."""
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []

    def keep(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, dict(kwargs)))

    with mock.patch.object(JITFunction, "run", keep):
        step()
    return launches


def _target():
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


def specialise(launch: Launch):
    """(options, signature, constexprs, attrs) of `launch` for sm_90, as JITFunction.run derives them from
    the argument values (create_function_from_signature's binder, then _pack_args)."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(_target())
    fn, kwargs = launch.kernel, dict(launch.kwargs)
    kwargs.setdefault("debug", fn.debug)
    bind = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = bind(*launch.args, **kwargs)
    if hasattr(fn, "_pack_args"):
        return fn._pack_args(backend, kwargs, bound, specialization, options)
    return _pack_args_inline(fn, backend, kwargs, bound, specialization)


def _pack_args_inline(fn, backend, kwargs: dict, bound: dict, specialization: list):
    """What JITFunction.run derives inline before Triton moved it into _pack_args (3.4, the Docker image's)."""
    from triton.runtime.jit import find_paths_if, get_iterable_path

    sigvals = [x[0] for x in specialization]
    constexprs = {path: get_iterable_path(list(bound.values()), path)
                  for path in find_paths_if(sigvals, lambda _, val: val == "constexpr")}
    attrvals = [x[1] for x in specialization]
    attrs = {path: backend.parse_attr(get_iterable_path(attrvals, path))
             for path in find_paths_if(attrvals, lambda _, x: isinstance(x, str))}
    return backend.parse_options(kwargs), dict(zip([p.name for p in fn.params], sigvals, strict=True)), constexprs, attrs


def divisible_args(launch: Launch) -> set[str]:
    """The arguments `launch` passes as multiples of 16 (pointers: 16-byte aligned), which the compiler may
    vectorise on."""
    _, _, _, attrs = specialise(launch)
    names = [p.name for p in launch.kernel.params]
    return {names[path[0]] for path, marks in attrs.items() if ["tt.divisibility", 16] in marks}


# SASS opcodes compile_sm90 counts: tensor-core products, and the fp32 multiplies and special-function
# (exp) instructions of an online softmax.
COUNTED_OPS = ("HMMA", "FMUL", "MUFU")


def compile_sm90(launch: Launch, sass: bool = False) -> dict:
    """{"registers", "stack", "local", "warps", "shared"} of `launch` compiled for sm_90 as specialise()
    describes it; "shared" is the bytes of shared memory a program takes (pipelined loads stage there).
    With `sass`, also "ops": the count of each COUNTED_OPS opcode in its SASS (a disassembly takes about
    a second of CPU a kernel, so only the launches whose instructions a test compares ask for it)."""
    import triton
    from triton.compiler import ASTSource

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    options, signature, constexprs, attrs = specialise(launch)
    kernel = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=_target(),
                            options=options.__dict__)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
        listing = ""
        if sass:
            listing = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    regs, stack, _, local = map(int, re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text).groups())
    usage = {"registers": regs, "stack": stack, "local": local, "warps": options.num_warps,
             "shared": kernel.metadata.shared}
    if sass:
        opcodes = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", listing)
        usage["ops"] = {op: opcodes.count(op) for op in COUNTED_OPS}
    return usage


def compile_step(step, sass: bool = False) -> dict[str, dict]:
    """compile_sm90 of each launch `step()` makes, by kernel name (numbered when one kernel runs twice)."""
    out: dict[str, dict] = {}
    for launch in record_launches(step):
        name, n = launch.name, 2
        while name in out:
            name, n = f"{launch.name}#{n}", n + 1
        out[name] = compile_sm90(launch, sass)
    return out


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
