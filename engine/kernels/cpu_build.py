"""Build and load the one C++ extension that holds every CPU kernel, for the instruction set this host takes.

Attention (engine/attention/csrc), quantized linears (engine/quant/csrc) and the model's fused ops
(engine/models/csrc) compile together as one translation unit, cached on disk per machine, torch install, source
version and instruction set. The kernels are written once, on ATen's portable vectors (at::vec), and
the same sources build one module per instruction set ("avx512", "avx2", "baseline"): `load_kernels()`
loads the one for `target_isa()` (the host's best, or the INFINILM_CPU_ISA cap), and `load_kernels(isa)`
any other this CPU can run, so tests compare the paths in one process. `load_kernels()` raises where it
cannot be built (no compiler); `cpu_kernels()` is then None and callers run the plain torch ops. Callers
look functions up on the module at call time, so the benchmark's profiler labels (bench.throughput
--profile) see every call.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import threading
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)
_ENGINE = Path(__file__).resolve().parents[1]
# Compiled in this order (the int8 attention kernel reuses the fp32 one's helpers).
_SOURCES = (
    _ENGINE / "kernels" / "csrc" / "vec_loads.cpp",
    _ENGINE / "attention" / "csrc" / "paged_attention_cpu.cpp",
    _ENGINE / "attention" / "csrc" / "paged_attention_int8_cpu.cpp",
    _ENGINE / "attention" / "csrc" / "prefill_attention_cpu.cpp",
    _ENGINE / "quant" / "csrc" / "quant_linear_cpu.cpp",
    _ENGINE / "models" / "csrc" / "fused_cpu.cpp",
    _ENGINE / "models" / "csrc" / "panel_gemm.cpp",
    _ENGINE / "models" / "csrc" / "compact_codes.cpp",
    _ENGINE / "models" / "csrc" / "decode_layers.cpp",
)
_FUNCTIONS = ["vector_lanes", "set_torch_vector_lanes", "paged_decode_attention", "skinny_linear", "invariant_linear", "paged_decode_attention_int8",
              "int8_linear", "int4_linear", "rms_norm_rows", "add_rms_norm_rows", "rope_rows_", "silu_mul_rows_",
              "panel_gemm_available", "pack_panels", "panel_linear", "unpack_compact_panels", "compact_rows",
              "pack_compact_panels", "compact_panels_match", "decode_layers", "stream_read_all",
              "decode_row_groups", "argmax_rows", "paged_prefill_attention", "paged_prefill_attention_int8"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


# Caps the instruction set the kernels are built for, e.g. "avx2" on an AVX-512 host to run and test the
# path every other x86 host takes. Unset: the host's best.
ISA_ENV = "INFINILM_CPU_ISA"
ISAS = ("avx512", "avx2", "baseline")


def host_isa() -> str:
    """The best instruction set of this CPU the kernels have a path for."""
    cpu = _cpu_flags()
    if " avx512f" in cpu and " avx512bw" in cpu and " avx512vl" in cpu and " avx512dq" in cpu:
        return "avx512"
    if " avx2" in cpu and " fma" in cpu:
        return "avx2"
    return "baseline"


def bf16_matmul_isa() -> str | None:
    """The instructions oneDNN multiplies bf16 with on this CPU (AMX or AVX512-BF16), or None: none, or the
    INFINILM_CPU_ISA cap is below AVX-512 (that run stands for a host without them)."""
    cpu = _cpu_flags()
    if target_isa() != "avx512":
        return None
    return next((name for name in ("amx_bf16", "avx512_bf16") if f" {name}" in cpu), None)


def target_isa() -> str:
    """The instruction set the kernels are built for: the host's best, or less where INFINILM_CPU_ISA says so.
    Raises ValueError for an unknown name or one this CPU lacks."""
    wanted = os.environ.get(ISA_ENV, "").strip().lower()
    return checked_isa(wanted, source=f"{ISA_ENV}={wanted!r}") if wanted else host_isa()


def runnable_isas() -> tuple[str, ...]:
    """The instruction sets this CPU can run a module of, best first."""
    return ISAS[ISAS.index(host_isa()):]


def checked_isa(isa: str | None, source: str = "isa") -> str:
    """`isa`, or target_isa() for None. Raises ValueError for an unknown name or one this CPU lacks."""
    if isa is None:
        return target_isa()
    if isa not in ISAS:
        raise ValueError(f"{source}: expected one of {', '.join(ISAS)}")
    if isa not in runnable_isas():
        raise ValueError(f"{source}: this CPU cannot run {isa}; this CPU's best is {host_isa()!r}")
    return isa


def build_flags(isa: str | None = None) -> list[str]:
    """The compiler flags for the module of `isa` (default target_isa()): native code capped at that instruction
    set, OpenMP, and ATen's vector width (CPU_CAPABILITY_*: at::vec::Vectorized<float> is 16 floats on AVX-512, 8
    on AVX2 and on the scalar baseline)."""
    # NOTE: -ffp-contract=off: no product is fused with an add unless the source writes the FMA, so the compact
    # panels' rebuilt weights, and every at::vec expression, round alike on both instruction sets.
    flags = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
    isa, host = checked_isa(isa), host_isa()
    if isa == "avx512":
        flags.append("-DCPU_CAPABILITY_AVX512")
    elif isa == "avx2":
        # -mno-avx512f turns off every AVX-512 subset: AVX2 and FMA code, as on an AVX2-only host.
        flags += (["-mno-avx512f"] if host == "avx512" else []) + ["-DCPU_CAPABILITY_AVX2"]
    elif host != "baseline":
        flags += ["-mno-avx512f", "-mno-avx2", "-mno-fma"]
    return flags


def load_kernels(isa: str | None = None) -> ModuleType:
    """The kernel module for `isa` (default target_isa()), built once per machine, torch install, source version
    and instruction set (cached on disk: module_name) and loaded once per process. Raises ValueError for an
    instruction set this CPU lacks."""
    return _load_module(checked_isa(isa))


def _source() -> str:
    return "\n".join(path.read_text() for path in _SOURCES)


def module_name(isa: str) -> str:
    """The extension's name for `isa`, which names its build directory: one per source version, flags, CPU and
    torch install."""
    # NOTE: the torch install's path is in the digest: ninja rebuilds whenever the compile command changes, and
    # that command names the install's include paths, so two checkouts' venvs sharing one build directory would
    # rebuild it for each other on every run.
    key = " ".join([_source(), *build_flags(isa), _cpu_flags(), torch.__version__, str(Path(torch.__file__).parent)])
    return f"infinilm_cpu_kernels_{isa}_{hashlib.sha1(key.encode()).hexdigest()[:12]}"


@cache
def _load_module(isa: str) -> ModuleType:
    from torch.utils.cpp_extension import load_inline

    shown = status_while_slow(f"building the CPU kernels for {isa} (cached after this run)") if SHOW_BUILD_STATUS \
        else contextlib.nullcontext()
    with shown:
        module = load_inline(
            name=module_name(isa),
            cpp_sources=[_source()],
            functions=_FUNCTIONS,
            extra_cflags=build_flags(isa),
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    # silu_mul_rows_ splits a row as ATen's own loop does, by ATen's vector width, to keep torch's bits.
    module.set_torch_vector_lanes(16 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 8)
    return module


# False where the caller shows the build's progress itself (`infinilm kernels build`).
SHOW_BUILD_STATUS = True
# Loading a cached build takes well under this; a first build compiles for far longer, so it says what it is doing.
STATUS_AFTER_S = 2.0


@contextlib.contextmanager
def status_while_slow(description: str, after: float = STATUS_AFTER_S) -> Iterator[None]:
    """Once the block has run `after` seconds: `description` in the log, and with a spinner and the time
    elapsed on stderr until the block ends. A block that ends sooner shows nothing."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                   console=Console(stderr=True), transient=False)
    shown = threading.Event()

    def show() -> None:
        log.info("%s", description)
        bar.add_task(description, total=None)
        bar.start()
        shown.set()

    timer = threading.Timer(after, show)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()  # a show() under way has finished before the bar stops
        if shown.is_set():
            bar.stop()


def kernels_available() -> bool:
    try:
        load_kernels()
        return True
    except Exception as exc:  # a missing compiler or headers: fall back, but say why
        log.warning("CPU kernels unavailable (%s); using the torch ops", exc)
        return False


@cache
def cpu_kernels() -> ModuleType | None:
    """The extension module, or None where it cannot be built."""
    return load_kernels() if kernels_available() else None


def fused_cpu_ok(x: torch.Tensor) -> bool:
    """Whether x takes the fused fp32 CPU kernels: fp32 on the CPU, inference only, kernels built."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled()
            and cpu_kernels() is not None)
